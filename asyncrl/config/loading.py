"""Loading a curriculum: TOML in, `--set` overrides, validation errors that name the key, JSON out.

Owns: `load` (TOML file + `--set a.b.c=value` overrides -> `RunConfig`), `from_dict`,
`apply_overrides`, translating msgspec's validation errors into `ConfigError` with the failing
key's dotted path, and writing the resolved config (`to_dict`, `dump_json`, `write_resolved`).
Does not own: the schema (`asyncrl.config.schema`).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config.schema import RunConfig
from asyncrl.errors import ConfigError

_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD_RE = re.compile(r"^(?P<field>[\w\[\]\.]+): (?P<msg>.*)$", re.S)


def _dotted(path: str) -> str:
    """msgspec's `$.a.b[2].c` -> `a.b[2].c`."""
    return path[1:] if path.startswith(".") else path


def _translate(err: msgspec.ValidationError, data: Any = None) -> ConfigError:
    m = _PATH_RE.match(str(err))
    assert m is not None  # the regex matches any string
    msg, path = m.group("msg"), _dotted(m.group("path") or "")
    unknown = re.match(r"Object contains unknown field `(\w+)`", msg)
    if unknown:
        name = unknown.group(1)
        key = f"{path}.{name}" if path else name
        kind = _kind_at(data, path)
        structs = _structs_at(path)
        own = [s for s in structs if s.tag == kind] if kind is not None else []
        if own:  # a tagged union: the keys of the kind the table names, not of every kind
            others = sorted({str(s.tag) for s in structs if s not in own
                             and name in {f.encode_name for f in s.fields}})
            if others:
                return ConfigError(key, f"a key of kind {'/'.join(others)}, not of kind "
                                        f"{kind!r}")
            structs = own
        fields = sorted({f.encode_name for st in structs for f in st.fields})
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
        return ConfigError(key, f"unknown key{hint}")
    missing = re.match(r"Object missing required field `(\w+)`", msg)
    if missing:
        key = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return ConfigError(key, "required key is missing")
    bad_tag = re.match(r"Invalid value '([^']*)'", msg)
    if bad_tag and path.endswith("kind"):
        kinds = {"engine.kind": "local, sglang, vllm", "trainer.kind": "torch, megatron",
                 "sandbox.kind": "local, remote"}.get(path, "")
        return ConfigError(path, f"unknown kind {bad_tag.group(1)!r}; expected one of: {kinds}")
    field = _FIELD_RE.match(msg)
    if field:
        key = f"{path}.{field.group('field')}" if path else field.group("field")
        return ConfigError(key, field.group("msg"))
    return ConfigError(path or "<root>", msg)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _structs(t: Any) -> list[Any]:
    """The struct types a type info can hold (through unions, options, lists, dicts)."""
    from msgspec import inspect as mi

    if isinstance(t, mi.StructType):
        return [t]
    if isinstance(t, mi.UnionType):
        return [s for u in t.types for s in _structs(u)]
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        return _structs(getattr(t, "item_type", None))
    if isinstance(t, mi.DictType):
        return _structs(t.value_type)
    return []


def _structs_at(path: str) -> list[Any]:
    """The struct types a table at `path` (`rollout`, `stages[0]`, `engine`) may be: one, or
    every variant of a tagged union (`engine`: local, sglang, vllm)."""
    from msgspec import inspect as mi

    structs = _structs(mi.type_info(RunConfig))
    for part in filter(None, re.sub(r"\[\d+\]", "", path).split(".")):
        structs = [s for st in structs for f in st.fields if f.encode_name == part
                   for s in _structs(f.type)]
    return structs


def _kind_at(data: Any, path: str) -> Any:
    """The `kind` the raw table at `path` names, or None."""
    node = data
    for part in filter(None, re.split(r"\.|\[(\d+)\]", path) if path else []):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node.get("kind") if isinstance(node, dict) else None


# A variant table written without `kind` means the default variant.
_DEFAULT_KINDS = {"engine": "local", "trainer": "torch", "sandbox": "local"}


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a plain dict (as parsed from TOML) into a `RunConfig`."""
    data = dict(data)
    for section, default_kind in _DEFAULT_KINDS.items():
        if isinstance(data.get(section), dict) and "kind" not in data[section]:
            data[section] = {"kind": default_kind, **data[section]}
    data = _teacher_engine_kinds(data)
    try:
        cfg = msgspec.convert(data, RunConfig, strict=True)
    except msgspec.ValidationError as e:
        raise _translate(e, data) from None
    algo = data.get("algorithm")
    if cfg.rollout.max_staleness > 0 and not (isinstance(algo, dict) and "correction" in algo):
        # an unset correction follows the staleness (AlgorithmSection.correction)
        cfg = msgspec.structs.replace(
            cfg, algorithm=msgspec.structs.replace(cfg.algorithm, correction="decoupled"))
    return cfg


def _teacher_engine_kinds(data: dict[str, Any]) -> dict[str, Any]:
    """A distill stage's `[stages.distill.teacher.engine]` without `kind` is a local engine,
    as `[engine]` is (copies of the tables it changes; `data` is left alone)."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return data
    out = []
    for st in stages:
        teacher = (st.get("distill") or {}).get("teacher") if isinstance(st, dict) else None
        eng = teacher.get("engine") if isinstance(teacher, dict) else None
        if isinstance(eng, dict) and "kind" not in eng:
            assert isinstance(st, dict) and isinstance(teacher, dict)
            st = {**st, "distill": {**st["distill"], "teacher": {
                **teacher, "engine": {"kind": "local", **eng}}}}
        out.append(st)
    return {**data, "stages": out}


def _parse_value(text: str) -> Any:
    """An override's value, read as a TOML value when it parses as one, else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a raw config dict (returns a new dict).

    Values are parsed as TOML (`3`, `1e-6`, `true`, `"x"`, `[1, 2]`); a bare word is a string.
    `stages.N.key=value` addresses the N-th stage. Types are checked afterwards by `from_dict`,
    so `rollout.group_size=abc` fails naming `rollout.group_size`.
    """
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override must look like key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(key, "empty segment in override key")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(where, f"no list item {part!r} (have {len(node)})")
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise ConfigError(where, "is a value, not a table")
            if not isinstance(node, (dict, list)):
                raise ConfigError(where, "is a value, not a table")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(key, f"no list item {last!r}")
            node[int(last)] = _parse_value(raw.strip())
        else:
            node[last] = _parse_value(raw.strip())
    return out


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a curriculum TOML file, apply overrides, validate. Raises `ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read {p}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("<file>", f"{p} is not valid TOML: {e}") from None
    return from_dict(apply_overrides(data, overrides or []))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config (defaults filled in) as plain data."""
    return msgspec.to_builtins(cfg)


def dump_json(cfg: RunConfig) -> bytes:
    """The resolved config as indented JSON bytes."""
    return msgspec.json.format(msgspec.json.encode(cfg), indent=2)


def write_resolved(cfg: RunConfig, run_dir: Path) -> Path:
    """Write `config.json` (the resolved config) into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.json"
    out.write_bytes(dump_json(cfg) + b"\n")
    return out
