"""Trajectory viewer: one self-contained HTML page per run, `RUN_DIR/report/viewer.html`.

Owns: reading the rollouts a run keeps (`eval/*.jsonl`: every eval; `rollouts/step_*.jsonl`:
the RL waves `logging.rollouts_every` keeps), turning each into what a person reads (the
prompt, each assistant turn, each tool call with its code, status and output, the reward,
RoC's decision and why), and writing the page from `viewer_template.html`.

The page needs no server and no network: data, CSS, script and plots (PNG data URIs) are
inline; it opens from disk in any browser. Everything in it that the model wrote is
untrusted: the data travels as JSON inside a `<script type="application/json">` element with
`<`, `>`, `&` escaped, and the page's script puts text into the DOM only with `textContent`,
never as HTML.

RoC's decision, per rollout of an RL wave (`Group.kept`, `Group.dropped_reason` and the
penalties of `asyncrl.algo.roc`, recomputed from the record with the run's
`roc.no_tool_call_penalty`): `kept` (with its advantage), `dropped: group <reason>` (the whole
group left the update: equal rewards, stale), `dropped: unusable` (aborted or failed), or
`dropped: RoC cut` (a positive not drawn, with its `p_total`; a negative not sampled). Eval
rollouts are not trained: their decision is `-`.

Per-turn text is decoded from the token spans with the run's tokenizer (`RUN_DIR/model-init`,
`RUN_DIR/final`, or the config's tokenizer or model path); without one, the response is shown
as one block. Does not own: the metrics report (`asyncrl.observe.report`) or what a run saves.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.log import get_logger
from asyncrl.records import Group, Rollout

log = get_logger(__name__)

MAX_ROLLOUTS_PER_SECTION = 512
"""A section (one eval, one RL wave) shows at most this many rollouts (the page says so)."""

Decoder = Callable[[list[int]], str]


# ------------------------------------------------------------------------------ reading
def _tokenizer_decoder(run_dir: Path) -> Decoder | None:
    """Decode with the run's `tokenizer.json` (the fast tokenizer alone; no transformers)."""
    dirs = [run_dir / "model-init", run_dir / "final"]
    try:
        cfg = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        dirs += [Path(p) for p in (cfg.get("tokenizer", {}).get("path"),
                                   cfg.get("model", {}).get("path")) if p]
    except (OSError, ValueError, AttributeError):
        pass
    for d in dirs:
        f = d / "tokenizer.json"
        if f.is_file():
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(f))
            except Exception as e:  # a broken tokenizer file: show whole responses instead
                log.warning("viewer_tokenizer_unreadable", path=str(f), error=repr(e))
                continue
            return lambda ids: tok.decode(ids, skip_special_tokens=False)
    return None


def _no_tool_call_penalty(run_dir: Path) -> float:
    try:
        cfg = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        return float(cfg["roc"]["no_tool_call_penalty"])
    except (OSError, ValueError, KeyError, TypeError):
        from asyncrl.config import RocSection

        return RocSection().no_tool_call_penalty


def _read_groups(path: Path) -> list[Group]:
    dec = msgspec.json.Decoder(Group)
    out: list[Group] = []
    bad = 0
    with path.open("rb") as fp:
        for line in fp:
            if not line.strip():
                continue
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError:
                bad += 1
    if bad:
        log.warning("viewer_records_skipped", path=str(path), skipped=bad)
    return out


# --------------------------------------------------------------------------- one rollout
def roc_decision(group: Group, index: int, trained: bool, no_tool_call_penalty: float
                 ) -> tuple[str, str]:
    """`(decision, why)` for rollout `index` of `group` (see the module doc)."""
    from asyncrl.algo.roc import UNUSABLE, p_err, p_format

    if not trained:
        return "-", "eval rollouts are not trained"
    ro = group.rollouts[index]
    pt = p_err(ro, no_tool_call_penalty) + p_format(ro)
    if group.dropped_reason:
        return "dropped", f"group {group.dropped_reason}: the whole group left the update"
    if ro.status in UNUSABLE:
        return "dropped", f"unusable: rollout {ro.status.value}"
    if index in group.kept:
        adv = group.advantages[group.kept.index(index)] if len(group.advantages) == len(
            group.kept) else None
        return "kept", (f"advantage {adv:+.3f}, p_total {pt:.2f}" if adv is not None
                        else f"p_total {pt:.2f}")
    if not group.kept:
        return "-", "RoC did not run on this group"
    if ro.is_correct:
        return "dropped", f"RoC cut: positive not drawn (p_total {pt:.2f})"
    return "dropped", "RoC cut: negative not sampled"


def _turns(ro: Rollout, decode: Decoder | None) -> list[dict[str, Any]]:
    if decode is None or not ro.turns:
        return [{"role": "assistant", "text": ro.response_text, "call": None}]
    return [{"role": t.role, "text": decode(ro.response_ids[t.start:t.end]),
             "call": t.tool_call} for t in ro.turns]


def rollout_view(group: Group, index: int, *, trained: bool, decode: Decoder | None,
                 no_tool_call_penalty: float) -> dict[str, Any]:
    """What the page shows of one rollout (plain JSON data)."""
    ro = group.rollouts[index]
    decision, why = roc_decision(group, index, trained, no_tool_call_penalty)
    calls = [{"name": c.name, "code": str(c.arguments.get("code", "")) if c.arguments else "",
              "stdin": str(c.arguments.get("input", "") or "") if c.arguments else "",
              "raw": c.raw, "status": c.status.value, "output": c.output, "error": c.error,
              "duration_s": round(c.duration_s, 4)} for c in ro.tool_calls]
    return {
        "id": ro.rollout_id, "problem_id": group.problem.id, "question": group.problem.question,
        "prompt": decode(ro.prompt_ids) if decode is not None else "",
        "truth": group.problem.answer, "answer": ro.answer, "reward": ro.reward,
        "correct": ro.is_correct, "tool_error": any(c.failed for c in ro.tool_calls),
        "status": ro.status.value, "stop_reason": ro.stop_reason.value, "error": ro.error,
        "policy_version": ro.policy_version, "tokens": len(ro.response_ids),
        "turns": _turns(ro, decode), "calls": calls, "roc": decision, "roc_why": why,
        "reward_detail": dict(ro.reward_detail), "reward_errors": list(ro.reward_errors),
    }


# ------------------------------------------------------------------------------ sections
def _section(title: str, kind: str, step: int, groups: Sequence[Group], *,
             decode: Decoder | None, penalty: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    total = sum(len(g.rollouts) for g in groups)
    for g in groups:
        for i in range(len(g.rollouts)):
            if len(rows) >= MAX_ROLLOUTS_PER_SECTION:
                break
            rows.append(rollout_view(g, i, trained=kind == "rl", decode=decode,
                                     no_tool_call_penalty=penalty))
    return {"title": title, "kind": kind, "step": step, "rollouts": rows, "total": total,
            "figures": eval_figures(groups) if kind == "eval" else []}


def eval_figures(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """An eval section's figures, for all problems and per level: problems, samples per
    problem (k), avg@k, maj@k, pass@k and the tool-error ratio of the correct answers
    (`asyncrl.observe.evaluation.summarize`; k = the fewest samples any problem has); maj is
    None (shown n/a) when no sample has an answer."""
    from asyncrl.observe.evaluation import summarize

    groups = [g for g in groups if g.rollouts]
    if not groups:
        return []
    k = min(len(g.rollouts) for g in groups)
    levels: dict[str, list[Group]] = {"all": groups}
    for g in groups:
        if g.problem.difficulty is not None:
            levels.setdefault(f"L{int(g.problem.difficulty)}", []).append(g)
    out = []
    for name, gs in levels.items():
        m = summarize(gs, k)
        out.append({"level": name, "problems": len(gs), "k": k,
                    "avg": round(m[f"avg@{k}"], 4),
                    "maj": round(m[f"maj@{k}"], 4) if f"maj@{k}" in m else None,
                    "pass": round(m[f"pass@{k}"], 4),
                    "tool_errors_correct": round(m["tool_error_ratio_correct"], 4)})
    return out


def _step_of(name: str) -> int:
    digits = "".join(ch for ch in name.split("-")[0] if ch.isdigit())
    return int(digits) if digits else 0


def load_sections(run_dir: Path) -> list[dict[str, Any]]:
    """One section per eval file and per saved RL wave, in run order (an eval after its step)."""
    decode = _tokenizer_decoder(run_dir)
    penalty = _no_tool_call_penalty(run_dir)
    sections = []
    for f in sorted((run_dir / "eval").glob("*.jsonl")):
        step = _step_of(f.stem)
        label = f.stem.split("-", 1)[1] if "-" in f.stem else f.stem
        sections.append(((step, 1), _section(f"eval {label} (step {step})", "eval", step,
                                             _read_groups(f), decode=decode, penalty=penalty)))
    for f in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        step = _step_of(f.stem)
        sections.append(((step, 0), _section(f"RL step {step}", "rl", step, _read_groups(f),
                                             decode=decode, penalty=penalty)))
    return [s for _, s in sorted(sections, key=lambda x: x[0])]


# -------------------------------------------------------------------------------- page
def _json_for_script(data: Any) -> str:
    """JSON safe inside a `<script>` element: no `</script>`, no HTML comment, no entity."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, default=str)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_page(title: str, sections: list[dict[str, Any]], plots: Sequence[Path]) -> str:
    """Pure: the page's HTML from the template, `sections` (`load_sections`) and PNG files."""
    template = resources.files("asyncrl.observe").joinpath("viewer_template.html").read_text("utf-8")
    imgs = "\n".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"><figcaption>'
        f'{html.escape(p.stem)}</figcaption></figure>' for p in plots)
    fill = {"TITLE": html.escape(title),
            "PLOTS": imgs or "<p>(no plots: the run has no metrics yet)</p>",
            "DATA": _json_for_script({"run": title, "sections": sections})}
    # one pass, so a value that happens to contain a placeholder is not filled again
    return re.sub(r"\{\{(TITLE|PLOTS|DATA)\}\}", lambda m: fill[m.group(1)], template)


def write_viewer(run_dir: Path, plots: Sequence[Path] = ()) -> Path:
    """Write `RUN_DIR/report/viewer.html`; returns its path."""
    run_dir = Path(run_dir)
    sections = load_sections(run_dir)
    out = run_dir / "report" / "viewer.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(run_dir.resolve().name, sections, plots), encoding="utf-8")
    log.info("viewer_written", path=str(out), sections=len(sections),
             rollouts=sum(len(s["rollouts"]) for s in sections))
    return out


