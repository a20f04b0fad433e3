"""`open_runtime` builds the model on a worker thread while the sandbox starts, reports a
config error of either side, and freezes what it built for the garbage collector until it
closes."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
from micro_config import MICRO_DATA, MICRO_ENGINE, MICRO_MODEL, micro_rollout

from asyncrl import config, runtime
from asyncrl.errors import ConfigError

HEAD = """
[run]
name = "runtime"
seed = 1
""" + MICRO_MODEL + MICRO_DATA + micro_rollout()
STAGES = """[[stages]]
name = "rl"
steps = 1
"""


def _cfg(tmp_path: Path, engine_and_sandbox: str = MICRO_ENGINE) -> config.RunConfig:
    path = tmp_path / "micro.toml"
    path.write_text(HEAD + engine_and_sandbox + STAGES)
    return config.load(path)


@pytest.mark.timeout(120)
async def test_the_model_is_built_on_a_worker_thread_while_the_sandbox_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build waits (in its thread) until a sandbox pool has begun to start: on the event
    loop's thread it would wait out its 60 s: the pool's start runs on the loop."""
    import torch

    from sandbox import SandboxPool

    pool_starting = threading.Event()
    real_start, real_build = SandboxPool.start, runtime.build_tokenizer_and_model
    seen: dict[str, object] = {}

    async def start(self: SandboxPool) -> None:
        pool_starting.set()
        await real_start(self)

    def build(*a, **k):
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["torch_threads"] = torch.get_num_threads()
        seen["overlapped"] = pool_starting.wait(60)
        return real_build(*a, **k)

    monkeypatch.setattr(SandboxPool, "start", start)
    monkeypatch.setattr(runtime, "build_tokenizer_and_model", build)
    threads = torch.get_num_threads()
    assert gc.get_freeze_count() == 0
    async with runtime.open_runtime(_cfg(tmp_path), tmp_path / "run") as rt:
        assert rt.trainer is not None and rt.engines
        # what was built is frozen while the runtime is open
        assert gc.get_freeze_count() > 0
    assert seen == {"thread": True, "torch_threads": 1, "overlapped": True}
    assert torch.get_num_threads() == threads  # the loop's thread keeps its count
    assert gc.get_freeze_count() == 0  # thawed on the way out


@pytest.mark.timeout(120)
async def test_a_config_error_of_the_model_comes_first_and_the_sandbox_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import SandboxPool

    closed = []
    real_close = SandboxPool.aclose

    async def aclose(self: SandboxPool) -> None:
        closed.append(self)
        await real_close(self)

    def build(*a, **k):
        raise ConfigError("tokenizer.path", "no tokenizer there")

    monkeypatch.setattr(SandboxPool, "aclose", aclose)
    monkeypatch.setattr(runtime, "build_tokenizer_and_model", build)
    with pytest.raises(ConfigError, match=r"tokenizer\.path"):
        async with runtime.open_runtime(_cfg(tmp_path), tmp_path / "run"):
            pass
    assert len(closed) == 2  # the tools' pool and the reward checker's, both started


@pytest.mark.timeout(120)
async def test_a_sandbox_that_cannot_start_waits_for_the_build_and_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_build = runtime.build_tokenizer_and_model
    built = []

    def build(*a, **k):
        out = real_build(*a, **k)
        built.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(runtime, "build_tokenizer_and_model", build)
    cfg = _cfg(tmp_path, f"""[engine]
kv_token_budget = 8192
[sandbox]
kind = "remote"
urls = ["http://127.0.0.1:9"]
token_file = "{tmp_path / 'missing'}"
""")
    with pytest.raises(ConfigError, match=r"sandbox\.token_file"):
        async with runtime.open_runtime(cfg, tmp_path / "run"):
            pass
    assert len(built) == 1  # the build had finished when the error was raised
