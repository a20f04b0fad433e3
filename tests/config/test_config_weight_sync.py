"""`engine.weight_sync = "distributed"`: SGLang's process-group sync, refused by name at config
check for the engines that cannot run it (local, vLLM) and for LoRA (adapters load from a
directory), with the valid choices in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import config
from asyncrl.cli.main import main as cli_main
from asyncrl.errors import ConfigError

BASE = ('[model.init]\nmodel_type = "qwen3"\n[data]\ntrain = "generator:tiny_math"\n'
        '[[stages]]\nname = "s1"\nsteps = 3\n')


def check(tmp_path: Path, engine: str, capsys: pytest.CaptureFixture[str],
          extra: str = "") -> tuple[int, str]:
    path = tmp_path / "run.toml"
    path.write_text(BASE + "[engine]\n" + engine + extra)
    rc = cli_main(["config", "check", str(path)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("engine", "words"), [
    ('kind = "local"\n', ['"tensor"', '"disk"', "SGLang"]),
    ('kind = "vllm"\n', ['weight_sync = "disk"', "vLLM"]),
])
def test_config_check_refuses_distributed_for_local_and_vllm(tmp_path, capsys, engine, words):
    rc, err = check(tmp_path, engine + 'weight_sync = "distributed"\n', capsys)
    assert rc == 2 and "engine.weight_sync" in err and "'distributed'" in err
    assert all(w in err for w in words), err


def test_sglang_takes_distributed_with_its_address_port_and_bucket(tmp_path, capsys):
    rc, _ = check(tmp_path, 'kind = "sglang"\nurls = ["http://10.0.0.2:30000"]\n'
                  'weight_sync = "distributed"\nweight_group_address = "10.0.0.1"\n'
                  'weight_group_port = 29600\nweight_bucket_mb = 64\n', capsys)
    assert rc == 0
    cfg = config.from_dict({"model": {"init": {"model_type": "qwen3"}},
                            "data": {"train": "generator:tiny_math"},
                            "engine": {"kind": "sglang", "weight_sync": "distributed",
                                       "router_url": "http://r:1"},
                            "stages": [{"name": "s1", "steps": 1}]})
    assert cfg.engine.weight_sync == "distributed"  # behind a router too: each worker joins
    rc, err = check(tmp_path, 'kind = "sglang"\nweight_sync = "broadcast"\n', capsys)
    assert rc == 2 and '"disk", "tensor" or "distributed"' in err


def test_lora_with_distributed_is_refused_naming_disk(tmp_path, capsys):
    rc, err = check(tmp_path, 'kind = "sglang"\nurls = ["http://h:1"]\n'
                    'weight_sync = "distributed"\n', capsys, "[trainer.lora]\nrank = 8\n")
    assert rc == 2 and "'distributed' cannot carry them" in err
    assert 'weight_sync = "disk"' in err
    with pytest.raises(ConfigError, match=r"engine\.weight_sync"):
        config.from_dict({"model": {"init": {"model_type": "qwen3"}},
                          "data": {"train": "generator:tiny_math"},
                          "engine": {"kind": "sglang", "urls": ["http://h:1"],
                                     "weight_sync": "distributed"},
                          "trainer": {"lora": {}}, "stages": [{"name": "s1", "steps": 1}]})
