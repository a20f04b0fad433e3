"""A trained model as the rollout loop needs it: weights, tokenizer, prompt, format and budgets.

Owns: `load_policy` (a model directory, or a run directory: `config.json` + `final/`),
`Policy` (the model with the curriculum's system prompt, chat template, tool-call format and
sampling settings, and `Policy.engine()`, an in-process engine whose KV capacity is checked
against the budget when it is built), `stop_ids` (the end-of-sequence ids a tokenizer has) and
`check_budget` (the one budget rule, with the error that names both numbers). Does not own:
running rollouts (`asyncrl.api`, `asyncrl.rollout`) or the engine itself (`asyncrl.engine`).

Why a run directory and not just `final/`: a trained model only answers well under the prompt
it was trained with, and that prompt (system text, tool-call syntax, chat template) lives in
the run's resolved config, not in the HF directory.

Imports no torch at module level (`import asyncrl.api` stays light); loading does.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl import formats, modeling, templates
from asyncrl.config import RunConfig, from_dict
from asyncrl.errors import BudgetError, ConfigError, ModelError
from asyncrl.rollout.agent import RolloutSettings
from asyncrl.rundir import read_prompt

if TYPE_CHECKING:
    from asyncrl.engine.local.engine import LocalEngine

__all__ = ["Policy", "check_budget", "load_policy", "stop_ids"]

DEFAULT_MAX_RESPONSE_TOKENS = 1024
"""Response budget of a policy loaded without a run config (a bare model directory)."""
DEFAULT_MAX_PROMPT_TOKENS = 512
"""Longest prompt `Policy.engine` reserves room for without a run config."""


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids: its EOS, its chat template's end-of-turn token and
    ChatML's `<|im_end|>` when it has them (`templates.end_of_sequence_ids`). Emitting any of
    them ends a rollout."""
    return templates.end_of_sequence_ids(tokenizer)


def with_stops(settings: RolloutSettings, tokenizer: Any) -> RolloutSettings:
    """`settings` with the tokenizer's end-of-sequence ids added to its stop ids: a rollout
    that cannot stop at EOS runs to its budget on every answer."""
    extra = tuple(i for i in stop_ids(tokenizer) if i not in settings.stop_token_ids)
    if not extra:
        return settings
    return msgspec.structs.replace(settings, stop_token_ids=settings.stop_token_ids + extra)


def check_budget(capacity: int, max_response_tokens: int, prompt_tokens: int,
                 engine: str) -> None:
    """Raise `BudgetError` when one rollout (prompt + response budget) cannot fit `engine`'s
    KV capacity: such a rollout could never be admitted whole."""
    need = prompt_tokens + max_response_tokens
    if need > capacity:
        raise BudgetError(
            f"a rollout needs up to {need} KV tokens (prompt {prompt_tokens} + "
            f"max_response_tokens {max_response_tokens}) but engine {engine!r} holds "
            f"{capacity}: lower max_response_tokens or raise the engine's kv_token_budget")


@dataclass(frozen=True)
class Policy:
    """A loaded model with everything its prompts depend on. Build it with `load_policy`."""

    model: Any
    """The torch module (eval mode)."""
    tokenizer: Any
    """The HF tokenizer saved with the model."""
    path: Path
    """The directory the weights came from (`RUN/final` for a run directory)."""
    system_prompt: str
    """The system text training rendered its prompts with (a run directory's `prompt.json`:
    `data.system_prompt`, or the task source's own text followed by the format's text and the
    tool list), else the curriculum's `data.system_prompt`; "" = the tool format's default
    text."""
    settings: RolloutSettings
    """Defaults for rollouts: the curriculum's tool format (bound to the chat template),
    `max_turns`, response budget (eval's, else the last stage's, else the rollout section's),
    training temperature, and the tokenizer's stop ids. Change with `settings_with`."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """The curriculum's `data.max_prompt_tokens`: the prompt room `engine()` reserves."""
    config: RunConfig | None = None
    """The run's resolved config (None for a bare model directory)."""

    @property
    def tool_format(self) -> formats.ToolFormat:
        return self.settings.tool_format

    def settings_with(self, **fields: Any) -> RolloutSettings:
        """`settings` with some fields changed (stop ids are kept): e.g.
        `policy.settings_with(temperature=0.0, max_response_tokens=300)`."""
        known = RolloutSettings.__struct_fields__
        for name in fields:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"RolloutSettings has no field {name!r}{hint}")
        return with_stops(msgspec.structs.replace(self.settings, **fields), self.tokenizer)

    def prompt(self, question: str, tool_schemas: list[dict[str, Any]] | None = None) -> str:
        """The exact prompt text the model sees for `question` with these tools."""
        return formats.render_prompt(question, self.tool_format, tool_schemas,
                                     self.system_prompt)

    def engine(self, *, kv_token_budget: int = 32768, max_running: int = 32,
               name: str = "local-0") -> LocalEngine:
        """An in-process engine on this model (open it with `async with`). Raises
        `BudgetError` when `max_prompt_tokens + settings.max_response_tokens` exceeds
        `kv_token_budget`."""
        check_budget(kv_token_budget, self.settings.max_response_tokens, self.max_prompt_tokens,
                     name)
        from asyncrl.engine.local.engine import LocalEngine

        return LocalEngine(self.model, self.tokenizer, kv_token_budget=kv_token_budget,
                           max_running=max_running, name=name)


def rollout_budgets(cfg: RunConfig) -> dict[str, int]:
    """The response budget of every place the run samples rollouts, by where it is set: each
    non-SFT stage's and, when the run evaluates, the evaluation's (`eval.max_response_tokens`,
    else the stage's). SFT stages sample nothing themselves; their evaluations are counted."""
    from asyncrl.stages import stage_budget

    out: dict[str, int] = {}
    for i, st in enumerate(cfg.stages):
        budget = stage_budget(cfg.rollout, st)
        if st.kind != "sft":
            key = (f"stages[{i}].max_response_tokens" if st.max_response_tokens
                   else "rollout.max_response_tokens")
            out[key] = max(out.get(key, 0), budget)
        if cfg.data.eval:
            key = ("eval.max_response_tokens" if cfg.eval.max_response_tokens else
                   f"stages[{i}].max_response_tokens" if st.max_response_tokens else
                   "rollout.max_response_tokens")
            out[key] = max(out.get(key, 0), cfg.eval.max_response_tokens or budget)
    return out


def check_kv_budget(cfg: RunConfig) -> None:
    """One rollout, a prompt of `data.max_prompt_tokens` plus the largest response budget,
    must fit the local engine's `kv_token_budget`: a request that cannot is refused by the
    engine, and a run whose every rollout is refused learns nothing."""
    capacity = getattr(cfg.engine, "kv_token_budget", None)
    budgets = rollout_budgets(cfg)
    if capacity is None or not budgets:
        return
    where, budget = max(budgets.items(), key=lambda kv: kv[1])
    try:
        check_budget(capacity, budget, cfg.data.max_prompt_tokens, f"{cfg.engine.kind}")
    except BudgetError as e:
        raise ConfigError("engine.kv_token_budget",
                          f"{e} (the response budget is {where}; the prompt's is "
                          "data.max_prompt_tokens)") from None


def _run_config(path: Path) -> RunConfig | None:
    """The run's resolved config when `path` is a run directory, else None."""
    cfg_file = path / "config.json"
    if not (path / "final").exists():
        if cfg_file.exists() and "stages" in json.loads(cfg_file.read_text()):
            raise ModelError(f"{path} is a run directory without a trained model (no final/): "
                             "the run has not finished; pass a checkpoint's model directory")
        return None
    if not cfg_file.exists():
        raise ModelError(f"{path} has final/ but no config.json: not a run directory")
    try:
        return from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_file} is not JSON: {e}") from None


def _settings(cfg: RunConfig | None, fmt: formats.ToolFormat, tokenizer: Any) -> RolloutSettings:
    if cfg is None:
        base = RolloutSettings(max_response_tokens=DEFAULT_MAX_RESPONSE_TOKENS, tool_format=fmt)
        return with_stops(base, tokenizer)
    r = cfg.rollout
    stage_budgets = [s.max_response_tokens for s in cfg.stages if s.max_response_tokens]
    budget = cfg.eval.max_response_tokens or (stage_budgets or [r.max_response_tokens])[-1]
    base = RolloutSettings(max_response_tokens=budget, max_turns=r.max_turns,
                           temperature=r.temperature, top_p=r.top_p, tool_format=fmt,
                           tool_output_max_chars=r.tool_output_max_chars)
    return with_stops(base, tokenizer)


def _lora_run_model(run: Path, cfg: RunConfig, dtype: str) -> tuple[Any, Path]:
    """The model of a LoRA run (`final/` is a PEFT adapter directory): `final/merged/` when
    the run wrote it (`merge_on_export`), else the adapter merged over its base: `final/base/`
    (the base this run trained), `model.path`, or the run's `model-init/` (a built model)."""
    final = run / "final"
    if (final / "merged" / "config.json").exists():
        return modeling.load_model(final / "merged", dtype), final / "merged"
    bases = [final / "base", *([Path(cfg.model.path)] if cfg.model.path else []),
             run / "model-init"]
    base = next((b for b in bases if (b / "config.json").exists()), None)
    if base is None:
        raise ModelError(f"{final} is a LoRA adapter, and no base model to merge it over was "
                         f"found (tried {', '.join(str(b) for b in bases)}): train with "
                         "trainer.lora.merge_on_export = true, or load a model directory")
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelError(f"{final} is a LoRA adapter: loading it needs peft "
                         "(pip install peft), or a run trained with merge_on_export") from None
    model = PeftModel.from_pretrained(modeling.load_model(base, dtype), str(final))
    return model.merge_and_unload(), final


def load_policy(path: str | Path, *, dtype: str = "float32") -> Policy:
    """Load a model directory (HF: `config.json`, weights, tokenizer) or a run directory
    (`config.json` + `final/`, as `asyncrl train` writes it; the curriculum's prompt, template,
    tool format and budgets come with it). Raises `ModelError` naming the path when it is
    neither."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{p} is not a model or run directory (no such file or directory)")
    if not p.is_dir():
        raise ModelError(f"{p} is not a model or run directory (it is a file)")
    cfg = _run_config(p)
    model_dir = p / "final" if cfg is not None else p
    if cfg is not None and (model_dir / "adapter_config.json").exists():
        model, model_dir = _lora_run_model(p, cfg, dtype)
        tokenizer = modeling.load_tokenizer(p / "final")  # saved beside the adapter
    else:
        if not (model_dir / "config.json").exists():
            raise ModelError(f"{model_dir} is not a model directory (no config.json in it)")
        tokenizer = modeling.load_tokenizer(model_dir)
        model = modeling.load_model(model_dir, dtype)
    model = model.eval()
    name = cfg.rollout.tool_format if cfg is not None else "hermes"
    mode = cfg.data.chat_template if cfg is not None else "auto"
    fmt = templates.bind_format(formats.get_format(name), tokenizer, mode)
    saved = read_prompt(p) if cfg is not None else None
    system = (saved["system_prompt"] if saved is not None  # what training rendered
              else cfg.data.system_prompt if cfg is not None else "")
    return Policy(model=model, tokenizer=tokenizer, path=model_dir, system_prompt=system,
                  settings=_settings(cfg, fmt, tokenizer),
                  max_prompt_tokens=(cfg.data.max_prompt_tokens if cfg is not None
                                     else DEFAULT_MAX_PROMPT_TOKENS),
                  config=cfg)
