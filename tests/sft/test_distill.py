"""A distill stage: a cold start for a task source that has a reward and no solutions. It
samples rollouts, keeps those the reward accepts (deduplicated by the model's tokens, capped
per problem), counts what it rejected and why, and trains on the kept rollouts token for token.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from fakes.scripted_engine import ScriptedEngine
from micro_config import MICRO_ENGINE, MICRO_MODEL, metric_rows, micro_rollout

from asyncrl import config
from asyncrl.api import RolloutSettings, rollouts
from asyncrl.errors import ConfigError, DataError
from asyncrl.records import Group, Problem, Rollout, RolloutStatus, Turn, read_jsonl
from asyncrl.rollout.eventloop import run as run_loop
from asyncrl.sft.distill import (
    Pool,
    Verdict,
    response_key,
    round_ends,
    round_problems,
    transcript,
)
from asyncrl.tasks.source import load_source
from asyncrl.tasks.task import TaskContext
from asyncrl.tasks.wiring import build_reward, build_tools

# A task source with only a reward: problems and a check, no solution programs. The reward
# accepts about half of what an untrained model writes (a hash of the text), so that a micro
# run keeps some rollouts and rejects others.
PLUGIN = '''
import zlib
from asyncrl.records import Problem

def make(options, seed):
    rows = [Problem(id=f"p{i}", question=f"Spell {w}", answer=w, source="spell")
            for i, w in enumerate(["cat", "dog", "owl", "emu", "yak", "elk"])]
    return rows[1:], rows[:1]

async def lucky(problem, rollout):
    return float(zlib.crc32(rollout.response_text.encode()) % 2 == 0)

async def never(problem, rollout):
    return 0.0

def letters(word: str) -> str:
    """The letters of a word, dash-separated."""
    return "-".join(word)
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "distplug.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("distplug", None)


def _toml(reward: str, distill: str, steps: int = 4, model: str = MICRO_MODEL) -> str:
    return model + textwrap.dedent(f"""
        [run]
        name = "distill"
        seed = 3
        [data]
        train = "generator:distplug:make"
        max_prompt_tokens = 400
        [task]
        reward = "distplug:{reward}"
        """) + micro_rollout(max_response_tokens=64, seed_requests=True) + MICRO_ENGINE + textwrap.dedent(f"""
        [[stages]]
        name = "cold"
        kind = "distill"
        steps = {steps}
        batch_size = 4
        lr = 1e-3
        [stages.distill]
        {distill}
        [checkpoint]
        keep_last = 1
        [logging]
        console = "none"
        progress = false
        """)


def _train(plugin_dir: Path, text: str, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[Path, list[list[tuple[list[int], list[int]]]]]:
    """`asyncrl train` in process (what the command runs); the batches every SFT step got."""
    from asyncrl.train import train_async
    from asyncrl.trainer.torch_trainer import TorchTrainer

    batches: list[list[tuple[list[int], list[int]]]] = []
    real = TorchTrainer.sft_step

    def recorded(self, examples):
        batches.append([(list(i), list(m)) for i, m in examples])
        return real(self, examples)

    monkeypatch.setattr(TorchTrainer, "sft_step", recorded)
    p = plugin_dir / "c.toml"
    p.write_text(text)
    rd = plugin_dir / "run"
    run_loop(train_async(config.load(p), run_dir=str(rd)))
    return rd, batches


@pytest.mark.timeout(300)
def test_a_source_with_only_a_reward_cold_starts_on_its_accepted_rollouts(
        plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd, batches = _train(plugin_dir, _toml("lucky", """
        rounds = 2
        samples_per_problem = 8
        max_per_problem = 2
        """), monkeypatch)
    rows = metric_rows(rd, "distill_round")
    assert [r["round"] for r in rows] == [1, 2]
    kept_total = 0
    for r in rows:  # every sampled rollout is kept or rejected for one reason
        assert r["sampled"] == 8 * r["problems"]
        assert r["kept"] + r["rejected"] == r["sampled"]
        assert r["rejected"] == sum(r[f"rejected_{v}"] for v in
                                    ("wrong", "unfinished", "duplicate", "over_cap"))
        kept_total += r["kept"]
    assert rows[0]["problems"] == 5 and rows[0]["kept"] > 0 and rows[0]["rejected_wrong"] > 0
    assert rows[-1]["pool"] == kept_total

    # the round files hold every sampled group, its kept rollouts marked
    groups = [g for i in (0, 1) for g in read_jsonl(rd / "distill" / "cold" /
                                                   f"round_{i:02d}.jsonl", Group)]
    kept = [g.rollouts[i] for g in groups for i in g.kept]
    assert len(kept) == kept_total
    assert all(r.is_correct for r in kept)
    per_problem: dict[str, list[tuple[int, ...]]] = {}
    for g in groups:
        per_problem.setdefault(g.problem.id, []).extend(
            tuple(t for t, m in zip(g.rollouts[i].response_ids, g.rollouts[i].loss_mask,
                                    strict=True) if m) for i in g.kept)
    assert all(len(v) <= 2 and len(set(v)) == len(v) for v in per_problem.values())
    # round 2 samples only the problems below the cap
    assert rows[1]["problems"] == 5 - sum(len(g.kept) == 2 for g in groups[:5])

    # what was trained: exactly the kept rollouts' own tokens, the model's trained and the
    # prompt and tool outputs not
    want = {(tuple(r.prompt_ids + r.response_ids),
             tuple([0] * len(r.prompt_ids) + r.loss_mask)) for r in kept}
    trained = {(tuple(i), tuple(m)) for b in batches for i, m in b}
    assert trained == want
    for r in kept:
        for t in r.turns:
            assert set(r.loss_mask[t.start:t.end]) <= ({1} if t.role == "assistant" else {0})
    sft = metric_rows(rd, "sft_step")
    assert sft[-1]["sft_step"] == 4 and len(batches) == 4 and all(len(b) == 4 for b in batches)
    assert (rd / "final" / "config.json").exists()


@pytest.mark.timeout(300)
def test_a_teacher_samples_through_its_own_engine_and_the_policy_learns_its_successes(
        plugin_dir: Path, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer,
        tiny_model_factory) -> None:
    """`[stages.distill.teacher]`: another model (here another architecture) with the
    policy's tokenizer, on a local engine of its own; the rollouts are its, the policy is
    never synced between rounds, and the kept rollouts are what the policy trains on."""
    from asyncrl import modeling

    tiny_tokenizer.save_pretrained(plugin_dir / "tok")
    modeling.save(tiny_model_factory(5), tiny_tokenizer, plugin_dir / "teacher")
    model = MICRO_MODEL.replace('train_on = "task_corpus"\nvocab_size = 400',
                                f'path = "{plugin_dir / "tok"}"')
    rd, batches = _train(plugin_dir, _toml("lucky", f"""
        rounds = 2
        samples_per_problem = 8
        [stages.distill.teacher]
        path = "{plugin_dir / "teacher"}"
        [stages.distill.teacher.engine]
        kv_token_budget = 8192
        """, model=model), monkeypatch)
    rows = metric_rows(rd, "distill_round")
    assert [r["round"] for r in rows] == [1, 2] and rows[0]["kept"] > 0
    groups = [g for i in (0, 1) for g in read_jsonl(rd / "distill" / "cold" /
                                                   f"round_{i:02d}.jsonl", Group)]
    rolls = [r for g in groups for r in g.rollouts]
    assert {r.engine for r in rolls} == {"teacher-0"}
    assert {r.policy_version for r in rolls} == {0}  # no policy sync between the rounds
    kept = [g.rollouts[i] for g in groups for i in g.kept]
    assert {(tuple(i), tuple(m)) for b in batches for i, m in b} == {
        (tuple(r.prompt_ids + r.response_ids), tuple([0] * len(r.prompt_ids) + r.loss_mask))
        for r in kept}


async def test_a_teacher_with_another_vocabulary_is_refused_naming_its_key(
        tmp_path: Path, tiny_tokenizer) -> None:
    from asyncrl.config import TeacherSection
    from asyncrl.modeling import train_tokenizer
    from asyncrl.sft.distill import open_teacher

    train_tokenizer(["other words entirely"] * 5, vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        async with open_teacher(TeacherSection(path=str(tmp_path)),
                                "stages[0].distill.teacher", tiny_tokenizer, "float32",
                                tmp_path):
            pass
    assert e.value.key == "stages[0].distill.teacher.path"
    assert "vocabulary" in e.value.message


async def test_a_distill_stage_that_keeps_nothing_is_an_error_that_says_so(
        tmp_path: Path) -> None:
    """Every round sampled and counted, then a `DataError` naming what to change; no step is
    trained (the trainer is never reached)."""
    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.sft.distill import run_distill
    from asyncrl.sft.stage import SFTSetup
    from asyncrl.stages import TrainState

    probs = [Problem(id=f"p{i}", question="q", answer="a") for i in range(3)]
    asked: list[tuple[int, int, int]] = []

    async def sample(problems: list[Problem], n: int, r: int) -> list[Group]:
        asked.append((len(problems), n, r))
        return [Group(group_id=p.id, problem=p, rollouts=[
            _ro(f"{p.id}{k}", [k + 1], reward=0.0) for k in range(n)]) for p in problems]

    stage = config.from_dict({**BASE, "stages": [{
        "name": "cold", "kind": "distill", "steps": 4,
        "distill": {"rounds": 2, "samples_per_problem": 2}}]}).stages[0]
    setup = SFTSetup(trainer=None, tokenizer=None, fmt=None, tools=None, system_prompt="",
                     seed=0, lr=1e-3, tool_output_max_chars=256, checkpoint_every=0)
    state = TrainState()
    with MetricsWriter(tmp_path) as metrics, pytest.raises(
            DataError, match="no sampled rollout was accepted by the task's reward in 2 "
                             "round"):
        await run_distill(stage, setup, state, metrics, probs, sample, None,
                          tmp_path / "distill", _never)
    assert asked == [(3, 2, 0), (3, 2, 1)]
    rows = metric_rows(tmp_path, "distill_round")
    assert [(r["kept"], r["rejected_wrong"]) for r in rows] == [(0, 6), (0, 6)]
    assert state.stage_step == 2  # the first round's steps lapsed; the second's never ran


@pytest.mark.parametrize("stop_after", [2, 3])
async def test_a_stopped_distill_stage_resumes_on_the_same_batches_without_resampling(
        tmp_path: Path, tiny_model_factory, stop_after: int) -> None:
    """Stopped mid-round (after step 2 of 3) or between rounds (after step 3, before round 2
    is sampled), a stage resumed from its state and round files trains the batches an
    uninterrupted one would, and samples only the rounds it had not."""
    from asyncrl.config import AlgorithmSection, TorchTrainerConfig
    from asyncrl.errors import RunStopped
    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.sft.distill import run_distill
    from asyncrl.sft.stage import SFTSetup
    from asyncrl.stages import TrainState
    from asyncrl.stopping import StopRequest
    from asyncrl.trainer import TRAINER_KINDS

    probs = [Problem(id=f"p{i}", question="q", answer="a") for i in range(4)]
    stage = config.from_dict({**BASE, "stages": [{
        "name": "cold", "kind": "distill", "steps": 6, "batch_size": 2,
        "distill": {"rounds": 2, "samples_per_problem": 3, "max_per_problem": 3}}]}).stages[0]

    def attempt(out: Path, state: TrainState, stop: StopRequest | None):
        rounds: list[int] = []
        batches: list = []
        trainer = TRAINER_KINDS["torch"](tiny_model_factory(0), TorchTrainerConfig(),
                                         AlgorithmSection(lr=1e-3), pad_token_id=0)
        real = trainer.sft_step

        def step(examples):
            batches.append(examples)
            return real(examples)
        trainer.sft_step = step

        async def sample(problems: list[Problem], n: int, r: int) -> list[Group]:
            rounds.append(r)
            return [Group(group_id=f"{p.id}:{r}", problem=p, rollouts=[
                _ro(f"{p.id}:{r}:{k}", [10 + int(p.id[1:]), 20 + (k + r) % 3],
                    reward=float(k != 1)) for k in range(n)]) for p in problems]

        def on_step(_loss):
            if stop is not None and state.stage_step == stop_after:
                stop.request()

        async def go() -> None:
            setup = SFTSetup(trainer=trainer, tokenizer=None, fmt=None, tools=None,
                             system_prompt="", seed=0, lr=1e-3, tool_output_max_chars=256,
                             checkpoint_every=0)
            with MetricsWriter(out) as metrics:
                await run_distill(stage, setup, state, metrics, probs, sample, _no_sync,
                                  out / "distill", _no_checkpoint, on_step=on_step, stop=stop)
        return go, rounds, batches

    go, _, full = attempt(tmp_path / "full", TrainState(), None)
    await go()
    state = TrainState()
    go, first_rounds, before = attempt(tmp_path / "part", state, StopRequest())
    with pytest.raises(RunStopped):
        await go()
    assert state.stage_step == stop_after and first_rounds == [0]
    go, resumed_rounds, after = attempt(tmp_path / "part", state, None)
    await go()
    assert resumed_rounds == [1]
    assert before + after == full and len(full) == 6


async def _no_sync() -> float:
    return 0.0


async def _no_checkpoint() -> None:
    pass


async def _never() -> None:
    raise AssertionError("nothing was trained, so nothing is checkpointed")


# ----------------------------------------------------------------------------- selection
def _ro(rid: str, model: list[int], tool: list[int] = (), *, reward: float = 1.0,
        status: RolloutStatus = RolloutStatus.COMPLETED) -> Rollout:
    """A rollout whose response is `model` tokens, then (if any) `tool` output tokens and the
    `model` tokens again."""
    ids, mask, turns = list(model), [1] * len(model), [Turn(role="assistant", start=0,
                                                            end=len(model))]
    if tool:
        for role, part, m in (("tool", tool, 0), ("assistant", model, 1)):
            turns.append(Turn(role=role, start=len(ids), end=len(ids) + len(part)))
            ids += part
            mask += [m] * len(part)
    return Rollout(rollout_id=rid, prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[7, 8], response_ids=ids, loss_mask=mask,
                   logprobs=[0.0] * len(ids), turns=turns, reward=reward, status=status)


def test_the_pool_keeps_accepted_new_rollouts_up_to_the_cap_and_says_why_it_refuses() -> None:
    pool = Pool(cap=2)
    assert pool.offer("a", _ro("1", [1, 2], reward=0.0)) is Verdict.WRONG
    assert pool.offer("a", _ro("2", [1, 2], status=RolloutStatus.TRUNCATED)) is Verdict.UNFINISHED
    assert pool.offer("a", _ro("3", [1, 2], [50, 51])) is Verdict.KEPT
    # the same model tokens with another tool output (a different time line) is a duplicate
    assert pool.offer("a", _ro("4", [1, 2], [50, 52])) is Verdict.DUPLICATE
    assert pool.offer("a", _ro("5", [1, 2])) is Verdict.KEPT  # no tool turn: another answer
    assert pool.offer("a", _ro("6", [3])) is Verdict.OVER_CAP
    assert pool.offer("a", _ro("7", [3], reward=0.0)) is Verdict.WRONG  # wrong before capped
    assert pool.offer("b", _ro("8", [1, 2], [50, 51])) is Verdict.KEPT  # caps are per problem
    assert [r.rollout_id for r in pool.kept] == ["3", "5", "8"]
    assert pool.full("a") and not pool.full("b")


def test_select_counts_every_verdict_marks_kept_rollouts_and_restores_the_same_pool() -> None:
    prob = Problem(id="a", question="q", answer="x")
    g = Group(group_id="g", problem=prob, rollouts=[
        _ro("1", [1]), _ro("2", [1]), _ro("3", [2], reward=0.0), _ro("4", [3]), _ro("5", [4])])
    pool = Pool(cap=2)
    counts = pool.select([g])
    assert counts == {Verdict.KEPT: 2, Verdict.WRONG: 1, Verdict.UNFINISHED: 0,
                      Verdict.DUPLICATE: 1, Verdict.OVER_CAP: 1}
    assert g.kept == [0, 3]
    again = Pool(cap=2)
    again.restore([g])
    assert [r.rollout_id for r in again.kept] == ["1", "4"]
    assert again.offer("a", _ro("6", [5])) is Verdict.OVER_CAP


def test_rounds_split_the_steps_and_skip_problems_at_the_cap() -> None:
    assert round_ends(10, 3) == [4, 7, 10]
    assert round_ends(2, 2) == [1, 2]
    probs = [Problem(id=f"p{i}", question="q", answer="a") for i in range(5)]
    pool = Pool(cap=1)
    pool.offer("p1", _ro("1", [1]))
    assert [p.id for p in round_problems(probs, pool, 0, 0, 1)] == ["p0", "p2", "p3", "p4"]
    some = round_problems(probs, pool, 2, 0, 1)
    assert len(some) == 2 and "p1" not in {p.id for p in some}
    assert some == round_problems(probs, pool, 2, 0, 1)  # seeded


def test_response_key_is_the_model_tokens_turn_by_turn() -> None:
    assert response_key(_ro("1", [1, 2], [9, 9, 9])) == (1, 2, -1, 1, 2)
    assert response_key(_ro("1", [1, 2])) == (1, 2)


async def test_a_transcript_is_the_rollouts_own_tokens_with_tool_output_masked(
        plugin_dir: Path, tiny_tokenizer) -> None:
    """A real rollout through the agent loop (a scripted model, the source's own tool): its
    transcript is its prompt and response ids, the tool output not trained."""
    tok = tiny_tokenizer
    src = load_source("distplug:make", {}, 0)
    ctx = TaskContext(tokenizer=tok)
    (tool,) = build_tools(["distplug:letters"], src, ctx)
    call = "<tool_call>" + json.dumps({"name": "letters", "arguments": {"word": "dog"}}) + \
        "</tool_call>"
    eng = ScriptedEngine([tok.encode(call), tok.encode("<answer>dog</answer><|im_end|>")], tok)
    (ro,) = [r async for r in rollouts(src.train[:1], engines=[eng], tokenizer=tok,
                                       tools=[tool], reward_fn=build_reward("distplug:lucky",
                                                                            src, ctx),
                                       settings=RolloutSettings(max_response_tokens=200))]
    assert [t.role for t in ro.turns] == ["assistant", "tool", "assistant"]
    ids, mask = transcript(ro)
    p = len(ro.prompt_ids)
    assert ids == ro.prompt_ids + ro.response_ids and mask[:p] == [0] * p
    tool_turn = ro.turns[1]
    assert set(mask[p + tool_turn.start:p + tool_turn.end]) == {0}
    assert "d-o-g" in tok.decode(ids[p + tool_turn.start:p + tool_turn.end])
    assert sum(mask) == (ro.turns[0].end - ro.turns[0].start) + (ro.turns[2].end -
                                                                 ro.turns[2].start)


# ------------------------------------------------------------------------------- config
BASE = {"model": {"init": {"model_type": "qwen3"}}, "data": {"train": "generator:tiny_math"}}


@pytest.mark.parametrize(("stage", "key"), [
    ({"kind": "distill", "steps": 1, "distill": {"rounds": 2}}, "stages[0].steps"),
    ({"kind": "sft", "steps": 1, "distill": {}}, "stages[0].distill"),
    ({"kind": "distill", "steps": 1, "distill": {"samples_per_problem": 0}},
     "stages[0].distill.samples_per_problem"),
    ({"kind": "distill", "steps": 1, "distill": {"cap": 2}}, "stages[0].distill.cap"),
    ({"kind": "distill", "steps": 1, "data_filter": "hard"}, "stages[0].data_filter"),
    ({"kind": "distill", "steps": 1, "distill": {"teacher": {"path": ""}}},
     "stages[0].distill.teacher.path"),
    ({"kind": "distill", "steps": 1, "distill": {"teacher": {
        "path": "m", "engine": {"kind": "sglang", "kv_token_budget": 9}}}},
     "stages[0].distill.teacher.engine.kv_token_budget"),
])
def test_a_distill_config_mistake_names_its_key(stage: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.from_dict({**BASE, "stages": [{"name": "d", **stage}]})
    assert e.value.key == key


def test_a_launched_teacher_server_needs_ports_of_its_own() -> None:
    def cfg(port: int) -> config.RunConfig:
        return config.from_dict({**BASE, "engine": {"kind": "sglang"}, "stages": [{
            "name": "d", "kind": "distill", "steps": 1, "distill": {"teacher": {
                "path": "m", "engine": {"kind": "sglang", "base_port": port}}}}]})
    with pytest.raises(ConfigError) as e:
        cfg(30000)
    assert e.value.key == "stages[0].distill.teacher.engine.base_port"
    assert cfg(31000).stages[0].distill.teacher.engine.base_port == 31000


def test_a_teacher_engine_table_without_kind_is_a_local_engine() -> None:
    cfg = config.from_dict({**BASE, "stages": [{"name": "d", "kind": "distill", "steps": 1,
                                                "distill": {"teacher": {
                                                    "path": "m",
                                                    "engine": {"kv_token_budget": 99}}}}]})
    d = cfg.stages[0].distill
    assert d is not None and d.teacher is not None
    assert (d.teacher.engine.kind, d.teacher.engine.kv_token_budget) == ("local", 99)


def test_config_check_shows_the_distill_plan_and_names_a_missing_teacher(tmp_path: Path) -> None:
    from asyncrl.cli.plan import dry_run

    def cfg(teacher: str) -> config.RunConfig:
        return config.from_dict({**BASE, "data": {"train": "generator:tiny_math",
                                                  "generator_options": {"train_size": 4}},
                                 "stages": [{"name": "d", "kind": "distill", "steps": 2,
                                             "distill": {"rounds": 2, "teacher": {
                                                 "path": teacher}}}]})
    (tmp_path / "t").mkdir()
    (line,) = [x for x in dry_run(cfg(str(tmp_path / "t"))) if x.startswith("stage 0")]
    assert "distill 2 rounds x 8 samples, at most 2 kept per problem" in line
    assert f"teacher {tmp_path / 't'} (local engine)" in line
    with pytest.raises(ConfigError) as e:
        dry_run(cfg(str(tmp_path / "nowhere")))
    assert e.value.key == "stages[0].distill.teacher.path"
