"""Trajectory viewer: RoC decisions and their reasons, per-turn text from the run's tokenizer,
model-written text that cannot escape into the page, and the page in a real headless Chromium
(loads without console errors, filters work, a known rollout's code appears)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncrl import modeling
from asyncrl.observe import report
from asyncrl.observe.viewer import load_sections, render_page, rollout_view
from asyncrl.records import (
    Group,
    Problem,
    Rollout,
    RolloutStatus,
    StopReason,
    ToolCall,
    ToolStatus,
    Turn,
    save_jsonl,
)

KNOWN_CODE = 'x = 17 * 3\nprint(x)  # </script><script>window.pwned = 1</script>'
HOSTILE = '<img src=x onerror="window.pwned = 2"> </script><!-- & \u2028 {{DATA}}'
ANSWER = "<answer>\\boxed{51}</answer>"
PROMPT = "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n"


def _rollout(tok: Any, rid: str, turns: list[tuple[str, str]], *, reward: float,
             calls: list[ToolCall] = (), status: RolloutStatus = RolloutStatus.COMPLETED
             ) -> Rollout:
    """A rollout whose response tokens are the turns' texts encoded with `tok`."""
    ids: list[int] = []
    spans: list[Turn] = []
    n_call = 0
    for role, text in turns:
        t = tok.encode(text, add_special_tokens=False)
        call = None
        if role == "tool" or (role == "assistant" and n_call < len(calls) and "```python" in text):
            call = n_call if role == "assistant" else n_call - 1
            n_call += role == "assistant"
        spans.append(Turn(role=role, start=len(ids), end=len(ids) + len(t), tool_call=call))
        ids += t
    text = "".join(x for _, x in turns)
    return Rollout(rollout_id=rid, prompt_id="p", group_id="g", policy_version=1,
                   prompt_ids=tok.encode(PROMPT, add_special_tokens=False), response_ids=ids,
                   loss_mask=[1] * len(ids),
                   logprobs=[0.0] * len(ids), turns=spans, tool_calls=list(calls),
                   response_text=text, answer="51" if reward else "50", reward=reward,
                   status=status, stop_reason=StopReason.NO_TOOL_CALL)


def _call(code: str, status: ToolStatus, output: str) -> ToolCall:
    return ToolCall(name="python", arguments={"code": code}, raw=f"```python\n{code}\n```",
                    status=status, output=output, stderr="" if status == "ok" else "boom")


def _make_run(run_dir: Path) -> dict[str, Any]:
    """A run directory with metrics, a tokenizer, one eval and one RL wave of known rollouts."""
    tok = modeling.train_tokenizer([KNOWN_CODE, HOSTILE, ANSWER, PROMPT] * 4, 300)
    tok.save_pretrained(run_dir / "model-init")
    ok = _call(KNOWN_CODE, ToolStatus.OK, "51")
    bad = _call("print(17 * '3')", ToolStatus.ERROR, "TypeError")
    problem = Problem(id="mul-17-3", question="What is 17 times 3? " + HOSTILE, answer="51")
    wave = Group(group_id="g1", problem=problem, rollouts=[
        _rollout(tok, "r-known", [("assistant", f"```python\n{KNOWN_CODE}\n```"),
                                  ("tool", "```output\n51\n```"), ("assistant", ANSWER)],
                 reward=1.0, calls=[ok]),
        _rollout(tok, "r-err", [("assistant", "```python\nprint(17 * '3')\n```"),
                                ("tool", "```output\nTypeError\n```"),
                                ("assistant", "<answer>\\boxed{50}</answer>")],
                 reward=0.0, calls=[bad]),
        _rollout(tok, "r-cut", [("assistant", HOSTILE + ANSWER + ANSWER)], reward=1.0),
        _rollout(tok, "r-neg", [("assistant", "<answer>\\boxed{50}</answer>")], reward=0.0),
        _rollout(tok, "r-failed", [("assistant", "")], reward=0.0,
                 status=RolloutStatus.FAILED),
    ], kept=[0, 1], advantages=[1.0, -1.0])
    flat = Group(group_id="g2", problem=Problem(id="flat", question="1+1?", answer="2"),
                 rollouts=[_rollout(tok, f"r-flat{i}", [("assistant", "2")], reward=0.0)
                           for i in range(2)], kept=[0, 1], advantages=[0.0, 0.0],
                 dropped_reason="equal_reward")
    ev = Group(group_id="e1", problem=problem, rollouts=[
        _rollout(tok, "r-eval", [("assistant", ANSWER)], reward=1.0)])
    save_jsonl(run_dir / "rollouts" / "step_000003.jsonl", [wave, flat])
    save_jsonl(run_dir / "eval" / "000003-step.jsonl", [ev])
    rows = [{"kind": "rl_step", "stage": "rl", "step": s, "time_s": s, "reward/mean": 0.1 * s}
            for s in (1, 2, 3)]
    rows.append({"kind": "eval", "stage": "rl", "step": 3, "time_s": 4, "label": "step",
                 "eval/accuracy": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.json").write_text(json.dumps({"roc": {"no_tool_call_penalty": 0.5}}))
    return {"wave": wave, "flat": flat}


def _by_id(sections: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for s in sections for r in s["rollouts"]}


def test_roc_decisions_say_why_and_turns_are_decoded(tmp_path: Path) -> None:
    _make_run(tmp_path)
    sections = load_sections(tmp_path)
    assert [s["title"] for s in sections] == ["RL step 3", "eval step (step 3)"]
    r = _by_id(sections)
    assert (r["r-known"]["roc"], r["r-known"]["roc_why"]) == ("kept", "advantage +1.000, "
                                                                     "p_total 0.00")
    assert r["r-err"]["roc"] == "kept" and r["r-err"]["tool_error"]
    assert r["r-cut"]["roc_why"].startswith("RoC cut: positive not drawn (p_total 1.50)")
    assert r["r-neg"]["roc_why"] == "RoC cut: negative not sampled"
    assert r["r-failed"]["roc_why"] == "unusable: rollout failed"
    assert r["r-flat0"]["roc_why"].startswith("group equal_reward")
    assert r["r-eval"]["roc"] == "-"
    known = r["r-known"]
    assert known["prompt"] == PROMPT  # decoded from the prompt's token ids
    assert [t["role"] for t in known["turns"]] == ["assistant", "tool", "assistant"]
    assert known["turns"][0]["text"] == f"```python\n{KNOWN_CODE}\n```"  # exact, from tokens
    assert known["turns"][0]["call"] == 0 and known["calls"][0]["code"] == KNOWN_CODE


def test_without_a_tokenizer_the_response_is_one_block(tmp_path: Path) -> None:
    groups = _make_run(tmp_path)
    shutil.rmtree(tmp_path / "model-init")
    view = rollout_view(groups["wave"], 0, trained=True, decode=None, no_tool_call_penalty=0.5)
    assert len(view["turns"]) == 1 and KNOWN_CODE in view["turns"][0]["text"]


def test_model_text_cannot_close_the_data_script(tmp_path: Path) -> None:
    _make_run(tmp_path)
    page = render_page("run <b>&", load_sections(tmp_path), [])
    data = page.split('<script type="application/json" id="run-data">', 1)[1]
    data = data.split("</script>", 1)[0]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data)["sections"][0]["rollouts"][0]["calls"][0]["code"] == KNOWN_CODE
    assert "<title>asyncrl run run &lt;b&gt;&amp;</title>" in page
    assert "{{DATA}}" not in page.split("<body>", 1)[1].split('id="run-data">', 1)[0]


def test_report_writes_the_viewer_with_plots(tmp_path: Path) -> None:
    _make_run(tmp_path)
    report.write_report(tmp_path)
    page = (tmp_path / "report" / "viewer.html").read_text()
    assert page.count('src="data:image/png;base64,') >= 2  # reward and eval accuracy plots
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing from the network


# ------------------------------------------------------------------------------ browser
def _chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                                      "(pip install -e '.[dev]')")
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium installed (apt-get install chromium; .ci/run does)")


@pytest.mark.timeout(180)
def test_viewer_in_headless_chromium(tmp_path: Path) -> None:
    exe = _chromium()
    from playwright.sync_api import sync_playwright

    _make_run(tmp_path)
    report.write_report(tmp_path)
    url = (tmp_path / "report" / "viewer.html").as_uri()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            page = browser.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(f"{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            page.on("request", lambda r: problems.append(f"request: {r.url}")
                    if not r.url.startswith(("file:", "data:")) else None)
            page.goto(url)
            rows = page.locator("tr.rollout")
            assert rows.count() == 7  # RL step 3: five + two rollouts
            assert page.locator("#plots img").count() >= 2
            assert all(page.evaluate("[...document.images].map(i => i.naturalWidth > 0)"))

            def shown() -> list[str]:
                return rows.evaluate_all("rs => rs.map(r => r.dataset.rolloutId)")

            page.click("#filters button[data-filter=correct]")
            assert shown() == ["r-known", "r-cut"]
            page.click("#filters button[data-filter=tool_error]")
            assert shown() == ["r-err"]
            page.click("#filters button[data-filter=wrong]")
            assert shown() == ["r-err", "r-neg", "r-failed", "r-flat0", "r-flat1"]
            page.click("#filters button[data-filter=all]")

            page.click('tr.rollout[data-rollout-id="r-known"]')
            detail = page.locator("tr.detail")
            assert detail.locator("pre.code").first.text_content() == KNOWN_CODE
            assert detail.locator("pre.turn-text").nth(1).text_content() == "```output\n51\n```"
            assert "RoC: kept" in (detail.text_content() or "")
            page.click('tr.rollout[data-rollout-id="r-cut"]')
            assert HOSTILE in (page.locator("tr.detail").last.text_content() or "")
            assert page.evaluate("window.pwned === undefined")  # no model text ran as code
            assert page.locator("tr.detail img").count() == 0

            assert page.locator("#figures").is_hidden()  # an RL wave has no eval figures
            page.select_option("#section", index=1)  # the eval
            assert shown() == ["r-eval"]
            figures = page.locator("#figures tr.figure").all_text_contents()
            assert figures == ["all1100.0%100.0%100.0%0.0%"]
            assert "avg@1" in (page.locator("#figures thead").text_content() or "")
            assert not problems, problems
        finally:
            browser.close()


def test_an_eval_section_carries_its_figures_per_level() -> None:
    def g(gid: str, level: float | None, rewards: list[float]) -> Group:
        return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="5",
                                                   difficulty=level),
                     rollouts=[Rollout(rollout_id=f"{gid}{i}", prompt_id="p", group_id=gid,
                                       policy_version=0, prompt_ids=[1], response_ids=[2],
                                       loss_mask=[1], logprobs=[0.0], answer="5" if r else "4",
                                       reward=r) for i, r in enumerate(rewards)])

    from asyncrl.observe.viewer import eval_figures

    figs = eval_figures([g("a", 1.0, [1, 0, 1, 0]), g("b", 2.0, [1, 1, 1, 0]),
                         g("c", None, [0, 0, 0, 0, 1])])
    assert [(f["level"], f["problems"], f["k"], f["avg"], f["maj"]) for f in figs] == [
        ("all", 3, 4, 0.4833, 0.6667), ("L1", 1, 4, 0.5, 1.0), ("L2", 1, 4, 0.75, 1.0)]
    assert eval_figures([]) == []
