"""A curriculum names its task source, reward and tools: built-ins by name, plugins by
`module:attr`; a wrong name is a config error naming the key, with "did you mean"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes.scripted_engine import ScriptedEngine
from micro_config import MICRO_MODEL, ROOT

from asyncrl import config
from asyncrl.api import RolloutSettings, rollouts
from asyncrl.errors import ConfigError
from asyncrl.tasks.check import check_task
from asyncrl.tasks.source import load_source
from asyncrl.tasks.task import TaskContext
from asyncrl.tasks.wiring import build_reward, build_tools

PLUGIN = '''
from asyncrl.records import Problem, RewardResult

def make(options, seed):
    n = options.get("n", 3)
    rows = [Problem(id=f"p{i}", question=f"Spell {w}", answer=w, source="spell")
            for i, w in enumerate(["cat", "dog", "owl", "emu", "yak"][:n])]
    return rows[1:], rows[:1]

async def spelled(problem, rollout):
    return 1.0 if problem.answer in rollout.response_text else 0.0

def letters(word: str) -> str:
    """The letters of a word, dash-separated."""
    return "-".join(word)

def broken_tools(options, seed):
    from asyncrl.tasks.task import TaskSource

    def tools(ctx):
        raise AttributeError("'TaskConfig' object has no attribute 'tools'")
    train, eval_ = make(options, seed)
    return TaskSource(name="broken", train=train, eval=eval_, tools=tools)
'''


def _curriculum(tmp_path: Path, task: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(MICRO_MODEL + textwrap.dedent(f"""
        [data]
        train = "generator:myplug:make"
        eval = "generator:myplug:make"
        [data.generator_options]
        n = 4
        [task]
        {task}
        [[stages]]
        name = "rl"
        steps = 1
        """))
    return p


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "myplug.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("myplug", None)


def test_config_check_builds_the_plugin_source_and_names_its_reward(plugin_dir: Path) -> None:
    cfg = config.load(_curriculum(plugin_dir, 'reward = "myplug:spelled"\n'
                                  'tools = ["python", "myplug:letters"]'))
    lines = check_task(cfg)
    assert lines[0].startswith("task source generator:myplug:make: 3 train problems")
    assert "'Spell dog' -> 'dog'" in lines[0]
    assert lines[1].startswith("task source generator:myplug:make: 1 eval problems")
    assert "reward: myplug:spelled" in lines


@pytest.mark.parametrize(("task", "key", "hint"), [
    ('reward = "mathh"', "task.reward", "did you mean 'math'?"),
    ('reward = "myplug:speled"', "task.reward", "did you mean 'spelled'?"),
    ('tools = ["pyhton"]', "task.tools", "did you mean 'python'?"),
    ('reward = "nosuchmod:f"', "task.reward", "cannot import module 'nosuchmod'"),
])
def test_a_wrong_name_is_an_error_naming_the_key(plugin_dir: Path, task: str, key: str,
                                                  hint: str) -> None:
    cfg = config.load(_curriculum(plugin_dir, task))
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert e.value.key == key and hint in str(e.value)


def test_a_wrong_source_name_fails_config_check_with_a_hint(plugin_dir: Path) -> None:
    p = _curriculum(plugin_dir, "")
    p.write_text(p.read_text().replace("generator:myplug:make", "generator:tiny_mth", 1))
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "config", "check", str(p)],
                          cwd=plugin_dir, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "data.train: unknown task 'tiny_mth'; did you mean 'tiny_math'?" in proc.stderr


async def test_plugin_reward_and_tools_run_in_the_rollout_loop(plugin_dir: Path,
                                                             tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    src = load_source("myplug:make", {"n": 2}, 0)
    ctx = TaskContext(tokenizer=tok)
    reward = build_reward("myplug:spelled", src, ctx)
    (tool,) = build_tools(["myplug:letters"], src, ctx)
    assert tool.name == "letters"
    call = "<tool_call>" + json.dumps({"name": "letters", "arguments": {"word": "dog"}}) + \
        "</tool_call>"
    eng = ScriptedEngine([tok.encode(call), tok.encode("<answer>dog</answer><|im_end|>")], tok)
    (ro,) = [r async for r in rollouts(src.train[:1], engines=[eng], tokenizer=tok,
                                       tools=[tool], reward_fn=reward,
                                       settings=RolloutSettings(max_response_tokens=200))]
    assert [(c.name, c.output) for c in ro.tool_calls] == [("letters", "d-o-g")]
    assert (ro.reward, ro.reward_status) == (1.0, "ok")


def test_the_default_task_is_the_math_reward_and_the_python_tool() -> None:
    cfg = config.load(ROOT / "curricula" / "tiny.toml")
    assert (cfg.task.reward, cfg.task.tools) == ("auto", ["auto"])
    assert "reward: auto (math)" in check_task(cfg)


async def test_open_task_takes_the_names_a_curriculum_takes(plugin_dir: Path,
                                                            tiny_tokenizer) -> None:
    from asyncrl.api import open_task

    async with open_task("myplug:make", options={"n": 3}, split="train",
                         reward="myplug:spelled", tools=("python", "myplug:letters"),
                         tokenizer=tiny_tokenizer) as task:
        assert [p.answer for p in task.problems] == ["dog", "owl"]
        assert [t.name for t in task.tools] == ["python_code_with_standard_io", "letters"]
        out = await task.tools[0]({"code": "print(6 * 7)"})
        assert (out.status.value, out.stdout.strip()) == ("ok", "42")
        eng = ScriptedEngine([tiny_tokenizer.encode("owl<|im_end|>")], tiny_tokenizer)
        (ro,) = [r async for r in rollouts(task.problems[1:], engines=[eng],
                                           tokenizer=tiny_tokenizer, tools=task.tools,
                                           reward_fn=task.reward_fn,
                                           settings=RolloutSettings(max_response_tokens=50))]
        assert ro.reward == 1.0


def test_an_installed_entry_point_is_a_plugin_name(plugin_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # an installed distribution as pip leaves it: a dist-info with entry_points.txt on the path
    info = plugin_dir / "myplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[asyncrl.rewards]\nspelled = myplug:spelled\n\n"
                                           "[asyncrl.tasks]\nspelling = myplug:make\n")
    cfg = config.load(_curriculum(plugin_dir, 'reward = "spelled"'))
    cfg = config.from_dict({**config.to_dict(cfg), "data": {
        **config.to_dict(cfg)["data"], "train": "generator:spelling",
        "eval": "generator:spelling"}})
    lines = check_task(cfg)
    assert lines[0].startswith("task source generator:spelling: 3 train problems")
    assert "reward: spelled" in lines
    bad = config.from_dict({**config.to_dict(cfg), "task": {"reward": "speled"}})
    with pytest.raises(ConfigError, match="did you mean 'spelled'"):
        check_task(bad)


def test_a_run_loads_each_split_of_its_task_once(plugin_dir: Path) -> None:
    """`asyncrl train` on a plugin source: the source is built once for the whole run (both
    splits, the tokenizer corpus, reward and tools, training and evaluation all read what the
    runtime opened) and closed once when the run ends."""
    from micro_config import MICRO_RL_TAIL, metric_rows, micro_rollout, run_ok

    (plugin_dir / "counted.py").write_text(textwrap.dedent('''
        from asyncrl.tasks.task import TaskSource
        import myplug

        def _note(what):
            with open("calls.txt", "a") as f:
                f.write(what + "\\n")

        def make(options, seed):
            _note("load")
            train, held_out = myplug.make(options, seed)
            return TaskSource(name="counted", train=train, eval=held_out,
                              close=lambda: _note("close"))
        '''))
    cfg = plugin_dir / "count.toml"
    cfg.write_text(MICRO_MODEL + textwrap.dedent("""
        [data]
        train = "generator:counted:make"
        eval = "generator:counted:make"
        [data.generator_options]
        n = 5
        [task]
        reward = "myplug:spelled"
        tools = ["python"]
        """) + micro_rollout(roc={"min_pos": 0, "min_neg": 0}, samples_per_prompt=2,
                             max_turns=1, max_response_tokens=8) + MICRO_RL_TAIL)
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(plugin_dir / "run")], cwd=plugin_dir, python_path=f"{ROOT}:{plugin_dir}")
    assert (plugin_dir / "calls.txt").read_text().split() == ["load", "close"]
    (data,) = metric_rows(plugin_dir / "run", "data")
    assert (data["train"], data["eval"]) == (4, 1)
    assert [r["step"] for r in metric_rows(plugin_dir / "run", "rl_step")] == [1, 2]


def test_config_check_names_the_resolved_tools(plugin_dir: Path) -> None:
    """Issue 54 M2: the plan listed `tools: auto`, not what the model is offered."""
    cfg = config.load(_curriculum(plugin_dir, 'tools = ["python", "myplug:letters"]'))
    assert ("tools: python_code_with_standard_io, letters (task.tools = ['python', "
            "'myplug:letters'], format hermes)") in check_task(cfg)


def test_markdown_with_a_tool_other_than_python_is_refused(plugin_dir: Path) -> None:
    """Issue 54 H3: config check, the dry run and train passed it; the model trained on a
    prompt offering Python it did not have and never saw its tool. The rule is the one the
    embedding API applies (`ToolFormat.uncallable`)."""
    cfg = config.load(_curriculum(plugin_dir, 'tools = ["python", "myplug:letters"]'),
                      ["rollout.tool_format=markdown"])
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert e.value.key == "rollout.tool_format"
    assert "calls only python_code_with_standard_io; letters could never be called" in str(
        e.value) and 'rollout.tool_format = "hermes"' in str(e.value)
    ok = config.load(_curriculum(plugin_dir, 'tools = ["python"]'),
                     ["rollout.tool_format=markdown"])
    assert any(line.startswith("tools: python_code_with_standard_io") for line in
               check_task(ok))


def test_a_source_whose_tools_raise_is_a_config_error(plugin_dir: Path) -> None:
    """Issue 54 M1: config check said ok, then train died with a raw traceback."""
    p = _curriculum(plugin_dir, "")
    p.write_text(p.read_text().replace("generator:myplug:make", "generator:myplug:broken_tools"))
    with pytest.raises(ConfigError) as e:
        check_task(config.load(p))
    assert e.value.key == "task.tools"
    assert "task source 'broken': its tools() raised AttributeError" in str(e.value)


def test_train_refuses_markdown_with_a_plugin_tool_and_leaves_no_run_dir(plugin_dir: Path
                                                                          ) -> None:
    """Issue 54 H3 and M1: train refuses it too (the same rule, after the tools are built),
    and the failed start leaves no directory behind: the next start is not `c-2`."""
    from micro_config import RUN_ENV

    p = _curriculum(plugin_dir, 'tools = ["python", "myplug:letters"]')
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(p), "--set",
                           "rollout.tool_format=markdown", "--set", f"run.output_dir="
                           f"\"{plugin_dir / 'runs'}\"", "--set", "run.name=\"c\""],
                          cwd=plugin_dir, capture_output=True, text=True, timeout=300,
                          env={**RUN_ENV, "PYTHONPATH": f"{ROOT}:{plugin_dir}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: rollout.tool_format: the markdown tool format calls only" in proc.stderr
    assert f"removed {plugin_dir / 'runs' / 'c'}" in proc.stderr
    assert not (plugin_dir / "runs" / "c").exists()


def test_a_failed_start_directory_is_removed_only_when_it_holds_no_run(tmp_path: Path) -> None:
    from asyncrl.rundir import discard_failed_start

    rd = tmp_path / "r"
    rd.mkdir()
    (rd / "log.jsonl").write_text("{}\n")
    assert not discard_failed_start(rd, created=False) and rd.exists()  # not ours
    (rd / "metrics.jsonl").write_text("{}\n")
    assert not discard_failed_start(rd, created=True) and rd.exists()  # a run's
    (rd / "metrics.jsonl").unlink()
    assert discard_failed_start(rd, created=True) and not rd.exists()


def test_a_plugin_returning_dict_rows_is_a_config_error_naming_the_type() -> None:
    """Issue 54 M6: `AttributeError: 'dict' object has no attribute 'question'` from config
    check and train."""
    from asyncrl.tasks.source import adapt

    rows = [{"id": "a", "question": "q", "answer": "1"}]
    with pytest.raises(ConfigError) as e:
        adapt(lambda options, seed: (rows, rows), "myplug:make", {}, 0)
    assert e.value.key == "data.train"
    assert "train item 0 is a dict, not an asyncrl.Problem" in str(e.value)


def test_a_source_whose_package_is_missing_names_the_extra(monkeypatch) -> None:
    """`generator:reasoning_gym` without reasoning-gym installed (the README's real-model path
    in a fresh venv) was a raw ModuleNotFoundError traceback from deep in the family."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now fails
    with pytest.raises(ConfigError, match=r"generator:reasoning_gym needs 'reasoning_gym', "
                                          r"which is not installed: pip install "
                                          r"'asyncrl\[reasoning-gym\]'") as e:
        load_source("reasoning_gym", {"generators": ["chain_sum"], "train_size": 2,
                                      "eval_size": 1}, 0)
    assert e.value.key == "data.train"


def test_a_plugin_beside_the_curriculum_imports_from_another_directory(tmp_path: Path) -> None:
    """Issue 54 L2: "a module beside the curriculum works" held only when run from its
    directory; `asyncrl config check sub/c.toml` from the parent now finds `sub/myplug.py`."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "myplug.py").write_text(PLUGIN)
    p = _curriculum(sub, 'reward = "myplug:spelled"')
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "config", "check",
                           str(p.relative_to(tmp_path))], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "task source generator:myplug:make: 3 train problems" in proc.stderr


def test_config_check_calls_a_plugin_reward_once_and_names_one_that_always_raises(
        plugin_dir: Path) -> None:
    """Issue 54 M3: a reward that raised on every rollout (a gold column it expected was not
    there) passed config check and failed every rollout of the run; config check now calls it
    once, on the first training problem with its gold answer as the response."""
    lines = check_task(config.load(_curriculum(plugin_dir, 'reward = "myplug:spelled"')))
    assert "reward myplug:spelled: 1 for the first problem's gold answer (trial call)" in lines
    (plugin_dir / "badreward.py").write_text(
        "def score(problem, rollout):\n"
        "    raise KeyError(\"gold answer column 'solution' not found\")\n")
    with pytest.raises(ConfigError, match=r"reward 'badreward:score' raised on a trial call: "
                                          r"KeyError") as e:
        check_task(config.load(_curriculum(plugin_dir, 'reward = "badreward:score"')))
    assert e.value.key == "task.reward"
