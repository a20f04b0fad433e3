"""The embedding API as a newcomer meets it: a run directory's prompt comes back, EOS is always a
stop, a budget that cannot fit is refused naming both numbers, a bad path names the path, a
failed rollout is returned with its reason and logged, rollouts stream one by one, and the
library writes nothing to stdout."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl import config, formats
from asyncrl.api import (
    BudgetError,
    ModelError,
    Problem,
    RewardResult,
    RolloutSettings,
    load_policy,
    rollout_groups,
    rollouts,
)
from asyncrl.errors import ConfigError
from asyncrl.modeling import load_model, save

ROOT = Path(__file__).resolve().parents[1]
TINY_TOML = ROOT / "curricula" / "tiny.toml"
ANSWER = "<answer>\\boxed{42}</answer>"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer, tiny_model_factory) -> Path:
    """What `asyncrl train curricula/tiny.toml` leaves: the resolved config and final/."""
    root = tmp_path_factory.mktemp("run")
    save(tiny_model_factory(0), tiny_tokenizer, root / "final")
    config.write_resolved(config.load(TINY_TOML), root)
    return root


@pytest.fixture
def host_logging():
    """Embedded logging (what a program importing asyncrl gets), whatever ran before."""
    from asyncrl.log import use_host_logging

    use_host_logging()


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", question=f"What is 6*7? ({i})", answer="42") for i in range(n)]


def test_a_run_directory_brings_its_curriculums_prompt_format_and_budget(run_dir) -> None:
    policy = load_policy(run_dir)
    cfg = config.load(TINY_TOML)
    assert policy.path == run_dir / "final"
    assert policy.system_prompt == cfg.data.system_prompt
    assert policy.tool_format.name == "markdown"
    s = policy.settings
    assert (s.max_turns, s.max_response_tokens, s.temperature) == (3, 200, 1.0)
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in s.stop_token_ids
    prompt = policy.prompt("What is 6*7?")
    assert prompt.startswith("<|im_start|>system\n" + cfg.data.system_prompt)
    assert prompt.endswith("What is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    assert policy.settings_with(temperature=0.0).stop_token_ids == s.stop_token_ids


def test_a_path_that_is_not_a_model_is_named(tmp_path) -> None:
    with pytest.raises(ModelError) as e:
        load_policy(tmp_path / "nope")
    assert str(e.value) == f"{tmp_path / 'nope'} is not a model or run directory (no such file or directory)"
    with pytest.raises(ModelError) as e:
        load_policy(tmp_path)
    assert str(e.value) == f"{tmp_path} is not a model directory (no config.json in it)"
    with pytest.raises(ModelError) as e:  # the library's loader, as the CLI uses it
        load_model(tmp_path / "nope")
    assert str(e.value) == f"{tmp_path / 'nope'} is not a model directory (no such file or directory)"


def test_a_budget_the_engine_cannot_hold_is_refused_when_the_engine_is_built(run_dir) -> None:
    policy = load_policy(run_dir)
    with pytest.raises(BudgetError) as e:
        policy.engine(kv_token_budget=400)
    assert str(e.value) == (
        "a rollout needs up to 456 KV tokens (prompt 256 + max_response_tokens 200) but engine "
        "'local-0' holds 400: lower max_response_tokens or raise the engine's kv_token_budget")


async def test_a_rollout_over_budget_raises_before_anything_runs(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine([tok.encode(ANSWER)], tok, capacity=1024, name="small")
    problems = _problems(1)
    prompt_len = len(tok.encode(formats.render_prompt(problems[0].question, formats.HERMES,
                                                      None, "")))
    with pytest.raises(BudgetError) as e:  # RolloutSettings() asks for 8,192 response tokens
        async for _ in rollouts(problems, engines=[eng], tokenizer=tok):
            pass
    assert str(e.value) == (
        f"a rollout needs up to {prompt_len + 8192} KV tokens (prompt {prompt_len} + "
        "max_response_tokens 8192) but engine 'small' holds 1024: lower max_response_tokens "
        "or raise the engine's kv_token_budget")
    assert eng.requests == []


async def test_settings_without_stop_ids_still_stop_at_eos(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine([tok.encode(ANSWER + "<|im_end|>" + " more" * 50)], tok)
    settings = RolloutSettings(max_response_tokens=200)  # no stop_token_ids given
    (ro,) = [r async for r in rollouts(_problems(1), engines=[eng], tokenizer=tok,
                                       settings=settings)]
    assert (ro.status.value, ro.stop_reason.value, ro.reward) == ("completed", "eos", 1.0)


async def test_rollouts_stream_one_by_one_and_groups_stay_whole(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine([tok.encode(ANSWER + "<|im_end|>")], tok)
    settings = RolloutSettings(max_response_tokens=64)
    seen = [r async for r in rollouts(_problems(3), engines=[eng], tokenizer=tok,
                                      samples_per_prompt=2, settings=settings)]
    assert sorted(r.prompt_id for r in seen) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert all(r.reward == 1.0 and r.reward_status == "ok" for r in seen)
    groups = [g async for g in rollout_groups(_problems(2), engines=[eng], tokenizer=tok,
                                              settings=settings, system_prompt="Be brief.")]
    assert sorted(len(g.rollouts) for g in groups) == [2, 2]
    assert tok.decode(eng.requests[-1].input_ids).startswith("<|im_start|>system\nBe brief.")


async def test_a_rollout_that_cannot_run_comes_back_failed_and_logged(tiny_tokenizer, caplog,
                                                                      host_logging) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine([tok.encode(ANSWER)], tok, error_after_tokens=2)

    async def reward(problem, rollout) -> RewardResult:
        return RewardResult(reward=0.0, status="ok")

    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        (ro,) = [r async for r in rollouts(_problems(1), engines=[eng], tokenizer=tok,
                                           reward_fn=reward,
                                           settings=RolloutSettings(max_response_tokens=64))]
    assert ro.status.value == "failed" and ro.error.startswith("engine: ")
    (rec,) = [r for r in caplog.records if "rollout_failed" in r.getMessage()]
    assert rec.levelname == "WARNING" and ro.rollout_id in rec.getMessage()


def test_library_logs_go_to_stderr_never_stdout() -> None:
    code = ("from asyncrl.log import get_logger; "
            "get_logger('asyncrl.x').warning('something_odd', n=3); "
            "get_logger('asyncrl.x').info('routine')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout == ""
    assert out.stderr == "event='something_odd' n=3\n"


def test_python_dash_m_asyncrl_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "asyncrl", "--version"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("asyncrl "), out


def test_an_unknown_config_key_suggests_the_close_one() -> None:
    base = {"model": {"init": {"model_type": "qwen3"}}, "data": {"train": "generator:tiny_math"},
            "stages": [{"name": "s", "steps": 1}]}
    with pytest.raises(ConfigError) as e:
        config.from_dict({**base, "rollout": {"max_respons_tokens": 96}})
    assert str(e.value) == ("rollout.max_respons_tokens: unknown key; did you mean "
                            "'rollout.max_response_tokens'?")
    with pytest.raises(ConfigError) as e:
        config.from_dict({**base, "stages": [{"name": "s", "stepz": 1}]})
    assert str(e.value) == "stages[0].stepz: unknown key; did you mean 'stages[0].steps'?"
    with pytest.raises(ConfigError) as e:
        config.from_dict({**base, "rollout": {"zzz": 1}})
    assert str(e.value) == "rollout.zzz: unknown key"


def test_a_bad_setting_names_the_field_and_the_close_one(run_dir) -> None:
    with pytest.raises(ValueError) as e:
        RolloutSettings(max_response_tokens=0)
    assert str(e.value) == "RolloutSettings.max_response_tokens must be >= 1, got 0"
    policy = load_policy(run_dir)
    with pytest.raises(TypeError) as t:
        policy.settings_with(max_tokens=64)
    assert str(t.value) == ("RolloutSettings has no field 'max_tokens'; did you mean "
                            "'max_turns'?")


def test_config_check_names_each_path_missing_on_this_machine(capsys) -> None:
    from asyncrl.cli.main import main as cli_main

    rstar2 = str(ROOT / "curricula" / "rstar2.toml")
    assert cli_main(["config", "check", rstar2]) == 0  # valid; the checkpoint is not here
    err = capsys.readouterr().err
    assert ("warning: model.path: no such directory: checkpoints/Qwen3-14B-Base (missing on "
            "this machine; a real run needs it)") in err
    assert cli_main(["config", "check", "--strict", rstar2]) == 2
    assert "error: model.path: no such directory" in capsys.readouterr().err


async def test_a_tool_the_format_cannot_call_is_refused(run_dir) -> None:
    from asyncrl.api import function_tool

    policy = load_policy(run_dir)  # the tiny curriculum's markdown format: ```python only

    def multiply(a: int, b: int) -> int:
        return a * b

    with pytest.raises(ValueError) as e:
        async for _ in rollouts(_problems(1), engines=[], policy=policy,
                                tools=[function_tool(multiply)]):
            pass
    assert str(e.value) == (
        "the markdown tool format calls only python_code_with_standard_io; multiply could "
        "never be called: use settings.tool_format = formats.HERMES for tools of your own")


@pytest.mark.parametrize("a,b", [
    ("18446744073709551615", "18446744073709551616"),   # past 2^53: floats would agree
    ("9007199254740993", "9007199254740992"),
    ("2,3", "23"), ("1,5", "15"),                          # not a thousands grouping
    ("1e400", "2e400"),                                    # both inf as floats
    ("1 2", "12"),
    ("0.1", "0.10000000000000001"),
])
def test_exact_match_keeps_different_numbers_apart(a, b):
    from asyncrl.api import normalize_answer

    assert normalize_answer(a) != normalize_answer(b)


@pytest.mark.parametrize("a,b", [
    ("3.0", "3"), ("1,000", "1000"), ("1e3", "1000"), ("0.5", "1/2"), ("\\frac{1}{2}", ".5"),
    ("$12$.", "12"), ("x + 1", "x+1"), ("-0", "0"), ("\\text{7}", "7"),
])
def test_exact_match_equates_one_number_in_two_notations(a, b):
    from asyncrl.api import normalize_answer

    assert normalize_answer(a) == normalize_answer(b)
