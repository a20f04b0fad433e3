"""A split's problems made ready for rollouts: prompt-length filtering and the seeded data cursor.

Owns: dropping problems whose prompt (system text and tool schema included) is longer than
`data.max_prompt_tokens` (`filter_split`), the held-out cut an evaluation's `max_problems` takes
(`held_out_cut`), a stage's shares of the training problems by source (`source_mix`), and
`ProblemStream`, the seeded epoch iterator whose `state()` goes into
checkpoints so a resumed run sees the same order.

Does not own: where problems come from (`asyncrl.tasks.open`), the prompt layout
(`asyncrl.formats`), or which problems are hard for the current policy (the curriculum).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.errors import ConfigError, DataError
from asyncrl.formats import ToolFormat, render_prompt
from asyncrl.log import get_logger
from asyncrl.records import Problem
from asyncrl.tasks.files import LoadResult

log = get_logger(__name__)


# ---------------------------------------------------------------------------- prompts
def prompt_text(problem: Problem, fmt: ToolFormat, tools: list[dict[str, Any]] | None,
                system_prompt: str = "") -> str:
    """The prompt the engine sees for `problem`: the curriculum's template (DESIGN "Formats")."""
    return render_prompt(problem.question, fmt, tools, system_prompt)


def _token_counts(texts: Sequence[str], tokenizer: Any, chunk: int = 512) -> list[int]:
    counts: list[int] = []
    for i in range(0, len(texts), chunk):
        part = list(texts[i:i + chunk])
        if callable(tokenizer):  # HF tokenizers batch-encode in Rust
            ids = tokenizer(part, add_special_tokens=False)["input_ids"]
        else:
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in part]
        counts.extend(len(x) for x in ids)
    return counts


def filter_overlong(problems: Sequence[Problem], tokenizer: Any, fmt: ToolFormat,
                    tools: list[dict[str, Any]] | None, max_prompt_tokens: int,
                    system_prompt: str = "") -> tuple[list[Problem], int]:
    """Problems whose whole prompt (system text and tool schemas included) fits in
    `max_prompt_tokens`, and how many did not."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    texts = [prompt_text(p, fmt, tools, system_prompt) for p in problems]
    kept: list[Problem] = []
    over: list[str] = []
    for prob, n in zip(problems, _token_counts(texts, tokenizer), strict=True):
        if n <= max_prompt_tokens:
            kept.append(prob)
        else:
            over.append(prob.id)
    if over:
        log.warning("overlong_prompts_skipped", count=len(over), limit=max_prompt_tokens,
                    first_ids=over[:5])
    return kept, len(over)


def filter_split(res: LoadResult, source: str, split: str, tokenizer: Any, fmt: ToolFormat,
                 tools: list[dict[str, Any]] | None, max_prompt_tokens: int,
                 system_prompt: str = "") -> LoadResult:
    """A loaded split (`res`, of `source`) less the problems whose prompt is longer than
    `max_prompt_tokens`, counted as `overlong_prompt`; `DataError` when none is left.

    What the train loop calls on its task's splits with the model's tokenizer, the run's
    format and tools, `data.max_prompt_tokens` and the system text.
    """
    kept, n_over = filter_overlong(res.problems, tokenizer, fmt, tools, max_prompt_tokens,
                                   system_prompt)
    skipped = dict(res.skipped)
    if n_over:
        skipped["overlong_prompt"] = n_over
    if not kept:
        raise DataError(f"{source}: no usable {split} problems (skipped: {skipped or 'none'})")
    log.info("data_loaded", source=source, split=split, problems=len(kept), **skipped)
    return LoadResult(kept, dict(sorted(skipped.items())), res.errors)


# ----------------------------------------------------------------------------- stream
def fingerprint(problems: Sequence[Problem]) -> str:
    """A short digest of the problem ids in order: detects a changed dataset on resume."""
    h = hashlib.sha256()
    for p in problems:
        h.update(p.id.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def held_out_cut(problems: Sequence[Problem], n: int) -> list[Problem]:
    """`n` of the held-out `problems` (all when `n` is 0 or covers them), in their list order:
    the same ones for every run, seed and evaluation, so cut evaluations compare. Spread over
    the whole list, not its first `n`: a source lists its problems grouped (reasoning-gym by
    generator), and the first `n` would evaluate the first group only."""
    if not n or n >= len(problems):
        return list(problems)
    keep = sorted(random.Random("asyncrl.eval.cut").sample(range(len(problems)), n))
    return [problems[i] for i in keep]


def source_mix(problems: Sequence[Problem], weights: Mapping[str, float], *, seed: int,
               stage: int, key: str = "source_weights") -> list[Problem]:
    """Stage `stage`'s share of `problems` by source (`[[stages]] source_weights`): a key
    names a `Problem.source` or its last part, and a source no key names is left out. The
    shares are reached by leaving problems out, never by repeating one: the source scarcest
    for its weight is taken whole, each other source a random draw of its share (at least
    one problem), seeded by the run's `seed`, the stage and the source alone (the same draw
    on a resume, whatever the keys' order). In list order; all of `problems` when `weights`
    is empty. A key that names no source, or a source two keys name, is a `ConfigError` at
    `key`."""
    if not weights:
        return list(problems)
    by: dict[str, list[int]] = {k: [] for k in sorted(weights)}
    for i, p in enumerate(problems):
        names = [k for k in by if p.source == k or p.source.endswith("/" + k)]
        if len(names) > 1:
            raise ConfigError(key, f"{names} all name the source {p.source!r}")
        if names:
            by[names[0]].append(i)
    if missing := [k for k, v in by.items() if not v]:
        have = sorted({p.source for p in problems})
        raise ConfigError(key, f"{missing} name no source of the training problems; they "
                               f"have {have}")
    scale = min(len(v) / weights[k] for k, v in by.items())
    keep: list[int] = []
    for k, v in by.items():
        rng = random.Random(f"asyncrl.source_mix:{seed}:{stage}:{k}")
        keep += rng.sample(v, min(len(v), max(1, round(scale * weights[k]))))
    return [problems[i] for i in sorted(keep)]


def source_counts(problems: Sequence[Problem]) -> dict[str, int]:
    """Problems per source, sources sorted."""
    return dict(sorted(Counter(p.source for p in problems).items()))


class ProblemStream:
    """Endless, seeded epochs over a fixed list of problems; resumable from `state()`.

    Epoch `e` visits every problem once, in an order that depends only on (`seed`, `e`) (or in
    file order when `shuffle` is off). A batch that crosses an epoch end continues into the next
    epoch, so a batch larger than the dataset may hold a problem twice. The cursor is
    (`epoch`, `position`): the same state gives the same batches after a restart.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, shuffle: bool = True,
                 epoch: int = 0, position: int = 0, salt: str = "asyncrl.data") -> None:
        if not problems:
            raise DataError("cannot stream an empty problem list")
        if epoch < 0 or not 0 <= position <= len(problems):
            raise ValueError(f"bad cursor epoch={epoch} position={position} "
                             f"for {len(problems)} problems")
        self._problems = list(problems)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = epoch
        self.position = position
        self.salt = salt
        """Names the order: streams of other salts over the same problems and seed visit
        them in other orders (the cold start's, `asyncrl.sft`, is not RL's)."""
        self._order = self._epoch_order(epoch)

    def __len__(self) -> int:
        return len(self._problems)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._problems)))
        if self.shuffle:
            # A str seed is hashed with SHA-512 by `random`: stable across processes and versions.
            # (the seed text names the module's old place: kept, so orders stay the same)
            random.Random(f"{self.salt}:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Problem]:
        """The next `n` problems, moving the cursor (and the epoch at its end)."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out: list[Problem] = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self._problems[i]
                       for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state(self) -> dict[str, Any]:
        """The cursor, for checkpoints (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_problems": len(self._problems),
                "fingerprint": fingerprint(self._problems)}

    @classmethod
    def from_state(cls, problems: Sequence[Problem], state: dict[str, Any]) -> ProblemStream:
        """Resume over the same problems; raises `DataError` if they changed since the state."""
        try:
            epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"bad data cursor in checkpoint: {state!r} ({e})") from e
        expected = state.get("fingerprint")
        if expected is not None and expected != fingerprint(problems):
            raise DataError(
                f"the problems differ from the checkpoint's ({len(problems)} now, "
                f"{state.get('num_problems')} then): resume with the same data files, or start "
                "a new data cursor")
        return cls(problems, seed, bool(state.get("shuffle", True)), epoch, position)
