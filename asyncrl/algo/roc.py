"""Resample-on-Correct: per-rollout penalties and the 2G -> G selection of one group.

Owns: the penalties RoC reads (`p_err`, `p_format`), the selection rules chosen by
`roc.kind` and `roc.positive`, the equal-reward rejection, and `apply_roc`, which writes the
selection and the advantages into `Group.kept` / `Group.advantages`. Does not own: rewards
(`asyncrl.tasks.rewards.math`), the loss, or when groups are batched (the train loop).

Everything is a pure function of its inputs and a seeded `random.Random`: the same groups,
config and seed give the same selection.

Penalties (the released rStar2-Agent code, on our records instead of re-parsed text):
- `p_err` = failed tool calls / tool calls, where any status other than `ok` counts as failed
  (error, timeout, killed, sandbox failure, malformed). A rollout with no tool call gets
  `roc.no_tool_call_penalty` (released code: 0.5).
- `p_format` = 1.0 when the answer markup is missing or malformed: no complete
  `<answer>…</answer>` block, unbalanced `<answer>`/`</answer>` tags, or no `\\boxed{}` inside
  the last block. Otherwise `min((blocks - 1) / assistant_turns, 1.0)`: one answer block is
  free, and each repeated block costs `1 / assistant_turns` (assistant turns from
  `Rollout.turns`, at least 1), as in the released code.
- `p_total = p_err + p_format`, in [0, 2].

Aborted and failed rollouts (infrastructure, not the policy, ended them) are never kept; the
rules below run on the others. Selection of `roc.kind = "roc"` for a group of n rollouts, P
positives (`Rollout.is_correct`: the reward's verdict, else full credit) and N negatives, cut
to G:
1. n <= G: keep everything (nothing to cut; a short group is never padded).
2. `k_pos = round_half_up(P * G / n)`, `k_neg = G - k_pos` (the ratio of the 2G set, within
   rounding; the released code rounds both and can miss G by one, which we avoid).
3. Floors: if `k_pos < min(min_pos, P)` raise `k_pos` to it; then if `k_neg < min(min_neg, N)`
   raise `k_neg` to it; the other side takes the rest. Requires `min_pos + min_neg <= G`.
4. Negatives: `k_neg` drawn uniformly without replacement (diverse failures are the signal).
5. Positives, `roc.positive`:
   - `"lowest"` (released code): the `k_pos` positives with the lowest `p_total`, ties by index.
   - `"weighted"` (paper): `k_pos` sequential draws without replacement, each picking a
     remaining positive i with probability `w_i / sum(w_remaining)`, where
     `w_i = 1 / (p_total_i + WEIGHT_FLOOR)` and `WEIGHT_FLOOR = 0.1`. This is "inversely
     proportional to p_total" with a floor so that a clean rollout (p_total 0) weighs 10, one
     without tool call (0.5) 1.67, one all-failed-and-unformatted (2.0) 0.48.
`"grpo_first"` keeps the first G rollouts (no RoC); `"grpo_all"` keeps all of them. Both are
ablations; penalties are still computed for the metrics.

With `roc.reject_equal_reward`, a group whose *kept* rewards are all equal carries no GRPO
signal: `apply_roc` marks it `dropped_reason = "equal_reward"` and leaves it out of the result.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import msgspec

from asyncrl.config import RocSection
from asyncrl.errors import ConfigError
from asyncrl.formats import answer_blocks, last_boxed
from asyncrl.records import Group, Rollout, RolloutStatus

from .advantages import group_advantages

WEIGHT_FLOOR = 0.1
"""Added to `p_total` before inverting it in the weighted positive rule (see the module doc)."""

UNUSABLE = frozenset({RolloutStatus.ABORTED, RolloutStatus.FAILED})
"""Rollout statuses RoC never keeps (cut short by the orchestrator or the infrastructure)."""


class RocOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """RoC's decision for one group: kept indices and every rollout's penalties."""

    kept: list[int]
    """Indices into `Group.rollouts`, ascending."""
    p_err: list[float]
    """Tool-error penalty per rollout (parallel to `Group.rollouts`)."""
    p_format: list[float]
    """Format penalty per rollout."""
    positive: list[bool]
    """`Rollout.is_correct`, per rollout."""

    @property
    def p_total(self) -> list[float]:
        return [e + f for e, f in zip(self.p_err, self.p_format, strict=True)]

    @property
    def dropped(self) -> list[int]:
        keep = set(self.kept)
        return [i for i in range(len(self.positive)) if i not in keep]

    @property
    def kept_pos(self) -> int:
        return sum(self.positive[i] for i in self.kept)

    @property
    def kept_neg(self) -> int:
        return len(self.kept) - self.kept_pos


# ------------------------------------------------------------------------------ penalties
def p_err(rollout: Rollout, no_tool_call_penalty: float) -> float:
    """Failed tool calls / tool calls; `no_tool_call_penalty` when there were none."""
    ratio = rollout.tool_error_ratio
    return no_tool_call_penalty if ratio is None else ratio


def p_format(rollout: Rollout) -> float:
    """1.0 for missing/malformed answer markup, else min((blocks - 1) / assistant turns, 1)."""
    text = rollout.response_text
    blocks = answer_blocks(text)
    if blocks == 0 or text.count("<answer>") != blocks or text.count("</answer>") != blocks:
        return 1.0
    last = text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]
    if last_boxed(last) is None:
        return 1.0
    turns = max(1, sum(t.role == "assistant" for t in rollout.turns))
    return min((blocks - 1) / turns, 1.0)


# ------------------------------------------------------------------------- counting rule
def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def split_counts(num_pos: int, num_neg: int, group_size: int, min_pos: int,
                 min_neg: int) -> tuple[int, int]:
    """How many positives and negatives RoC keeps (steps 1–3 of the module doc).

    Returns `(k_pos, k_neg)` with `k_pos <= num_pos`, `k_neg <= num_neg` and
    `k_pos + k_neg == min(group_size, num_pos + num_neg)`.
    """
    n = num_pos + num_neg
    if n <= group_size:
        return num_pos, num_neg
    if min_pos + min_neg > group_size:
        raise ConfigError("roc.min_pos", f"min_pos + min_neg = {min_pos + min_neg} exceeds "
                                         f"rollout.group_size = {group_size}")
    k_pos = _round_half_up(num_pos * group_size / n)
    floor_pos, floor_neg = min(min_pos, num_pos), min(min_neg, num_neg)
    if k_pos < floor_pos:
        k_pos = floor_pos
    if group_size - k_pos < floor_neg:
        k_pos = group_size - floor_neg
    # A no-op by construction (round(P*G/n) lies in [G - N, P] because G < n, and each floor
    # stays inside it); kept so that a future edit cannot return more than a side holds.
    k_pos = max(group_size - num_neg, min(k_pos, num_pos))
    return k_pos, group_size - k_pos


def check_config(cfg: RocSection, group_size: int) -> None:
    """Raise `ConfigError` when the floors cannot fit in G (call once at startup)."""
    if cfg.kind == "roc" and cfg.min_pos + cfg.min_neg > group_size:
        raise ConfigError("roc.min_pos", f"min_pos + min_neg = {cfg.min_pos + cfg.min_neg} "
                                         f"exceeds rollout.group_size = {group_size}")


# ------------------------------------------------------------------------ positive rules
def _lowest(candidates: Sequence[int], p_total: Sequence[float], k: int,
            rng: random.Random) -> list[int]:
    return sorted(candidates, key=lambda i: (p_total[i], i))[:k]


def _weighted(candidates: Sequence[int], p_total: Sequence[float], k: int,
              rng: random.Random) -> list[int]:
    pool = list(candidates)
    weights = [1.0 / (p_total[i] + WEIGHT_FLOOR) for i in pool]
    chosen: list[int] = []
    for _ in range(min(k, len(pool))):
        u = rng.random() * sum(weights)
        j, acc = len(pool) - 1, 0.0
        for idx, w in enumerate(weights):
            acc += w
            if u < acc:
                j = idx
                break
        chosen.append(pool.pop(j))
        weights.pop(j)
    return chosen


PositiveRule = Callable[[Sequence[int], Sequence[float], int, random.Random], list[int]]
POSITIVE_RULES: dict[str, PositiveRule] = {"weighted": _weighted, "lowest": _lowest}
"""`roc.positive` -> rule picking k of the candidate positives given every rollout's p_total."""


# ------------------------------------------------------------------------ selection kinds
def _select_roc(positive: list[bool], p_total: list[float], cfg: RocSection, group_size: int,
                rng: random.Random) -> list[int]:
    pos = [i for i, p in enumerate(positive) if p]
    neg = [i for i, p in enumerate(positive) if not p]
    k_pos, k_neg = split_counts(len(pos), len(neg), group_size, cfg.min_pos, cfg.min_neg)
    kept_neg = rng.sample(neg, k_neg)
    kept_pos = POSITIVE_RULES[cfg.positive](pos, p_total, k_pos, rng)
    return sorted(kept_pos + kept_neg)


def _select_first(positive: list[bool], p_total: list[float], cfg: RocSection,
                  group_size: int, rng: random.Random) -> list[int]:
    return list(range(min(group_size, len(positive))))


def _select_all(positive: list[bool], p_total: list[float], cfg: RocSection, group_size: int,
                rng: random.Random) -> list[int]:
    return list(range(len(positive)))


SelectRule = Callable[[list[bool], list[float], RocSection, int, random.Random], list[int]]
SELECT_KINDS: dict[str, SelectRule] = {
    "roc": _select_roc,
    "grpo_first": _select_first,
    "grpo_all": _select_all,
}
"""`roc.kind` -> selection rule."""


def select(group: Group, cfg: RocSection, group_size: int, rng: random.Random) -> RocOutcome:
    """RoC's selection for one group. Pure: the group is not modified (see `apply_roc`).

    `group_size` is G (`rollout.group_size`); the group normally holds 2G rollouts but may hold
    fewer (aborted rollouts), in which case the same rule cuts it to G, or keeps it whole when
    it has G or fewer. Aborted and failed rollouts (`UNUSABLE`) are never kept: the policy
    did not produce their ending, so they are no evidence either way; truncated ones are kept
    like any other (the report found that filtering them made responses longer).
    """
    errs = [p_err(r, cfg.no_tool_call_penalty) for r in group.rollouts]
    fmts = [p_format(r) for r in group.rollouts]
    positive = [r.is_correct for r in group.rollouts]
    usable = [i for i, r in enumerate(group.rollouts) if r.status not in UNUSABLE]
    kept = SELECT_KINDS[cfg.kind]([positive[i] for i in usable],
                                  [errs[i] + fmts[i] for i in usable], cfg, group_size, rng)
    return RocOutcome(kept=[usable[j] for j in kept], p_err=errs, p_format=fmts,
                      positive=positive)


def is_equal_reward(group: Group, kept: Sequence[int]) -> bool:
    """True when the kept rollouts all have the same reward (no GRPO signal)."""
    return len({group.rollouts[i].reward for i in kept}) <= 1


def may_carry_signal(group: Group, cfg: RocSection, group_size: int) -> bool:
    """False when no selection of `roc.kind` could keep two different rewards, so that
    `apply_roc` drops the group as `equal_reward` whatever it draws: every usable rollout got
    one reward (for `grpo_first`, the first G of them), or RoC keeps one side only (its floors
    at 0) and that side got one reward. `rollout.refill_equal_reward` draws another problem
    in its place."""
    usable = [r for r in group.rollouts if r.status not in UNUSABLE]
    if cfg.kind == "grpo_first":
        usable = usable[:group_size]
    elif cfg.kind == "roc":
        pos = [r for r in usable if r.is_correct]
        neg = [r for r in usable if not r.is_correct]
        k_pos, k_neg = split_counts(len(pos), len(neg), group_size, cfg.min_pos, cfg.min_neg)
        usable = (pos if k_pos else []) + (neg if k_neg else [])
    return len({r.reward for r in usable}) > 1


# ------------------------------------------------------------------------------ batch-level
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def apply_roc(groups: Sequence[Group], cfg: RocSection, group_size: int,
              rng: random.Random | int, adv_eps: float = 1e-6,
              ) -> tuple[list[Group], dict[str, float]]:
    """Run RoC on every group, fill `kept` and `advantages`, drop equal-reward groups.

    `rng` is a `random.Random` (consumed in group order) or an int seed. Every group gets
    `kept` and `advantages` (group-normalised on the kept set, see `advantages`); a group
    rejected for equal rewards also gets `dropped_reason = "equal_reward"` and is not returned.
    A group whose `dropped_reason` was already set by the caller (stale, failed) is left as it
    is and not returned.

    Metrics (`roc/…`): group counts (`groups`, `groups_trained`, `groups_equal_reward`,
    `groups_all_correct`, `groups_all_wrong` — the last two on the whole 2G set), rollout counts
    (`rollouts_in`, `rollouts_unusable` = aborted or failed, `rollouts_kept` = going into the
    update, `kept_pos`, `kept_neg`,
    `dropped_pos`, `dropped_neg` = RoC's own cut, equal-reward groups included), mean
    penalties of RoC-kept vs RoC-dropped positives (`p_err_kept_pos`, `p_err_dropped_pos`,
    `p_format_…`, `p_total_…`; absent when there is no such rollout), and over every rollout
    `tool_error_ratio` (failed / all calls), `no_tool_call_frac`, `format_bad_frac`
    (p_format = 1).
    """
    if isinstance(rng, int):
        rng = random.Random(rng)
    check_config(cfg, group_size)
    out: list[Group] = []
    tally = _RocTally()
    for g in groups:
        if g.dropped_reason:
            continue
        oc = select(g, cfg, group_size, rng)
        g.kept = oc.kept
        g.advantages = group_advantages([g.rollouts[i].reward for i in oc.kept], adv_eps)
        tally.add_group(g, oc)
        if cfg.reject_equal_reward and is_equal_reward(g, oc.kept):
            g.dropped_reason = "equal_reward"
            tally.m["groups_equal_reward"] += 1
            continue
        tally.m["groups_trained"] += 1
        tally.m["rollouts_kept"] += len(oc.kept)
        out.append(g)
    return out, tally.metrics()


class _RocTally:
    """`apply_roc`'s metrics, counted group by group (see its docstring for their meaning)."""

    def __init__(self) -> None:
        self.m: dict[str, float] = dict.fromkeys(
            ("groups", "groups_trained", "groups_equal_reward", "groups_all_correct",
             "groups_all_wrong", "rollouts_in", "rollouts_unusable", "rollouts_kept",
             "kept_pos", "kept_neg", "dropped_pos", "dropped_neg"), 0.0)
        """Counts; `groups_trained`, `groups_equal_reward` and `rollouts_kept` are counted by
        `apply_roc`, which decides them."""
        self.pen: dict[str, list[float]] = {
            f"{p}_{s}": [] for p in ("p_err", "p_format", "p_total")
            for s in ("kept_pos", "dropped_pos")}
        self.calls = self.failed_calls = self.no_call = self.fmt_bad = 0

    def add_group(self, g: Group, oc: RocOutcome) -> None:
        """Count one selected group `g` (its selection `oc`), before any equal-reward drop."""
        m = self.m
        m["groups"] += 1
        m["rollouts_in"] += len(g.rollouts)
        m["rollouts_unusable"] += sum(r.status in UNUSABLE for r in g.rollouts)
        m["groups_all_correct"] += bool(oc.positive) and all(oc.positive)
        m["groups_all_wrong"] += not any(oc.positive)
        m["kept_pos"] += oc.kept_pos
        m["kept_neg"] += oc.kept_neg
        for i in oc.dropped:
            m["dropped_pos" if oc.positive[i] else "dropped_neg"] += 1
        kept = set(oc.kept)
        p_total = oc.p_total
        for i, is_pos in enumerate(oc.positive):
            if is_pos:
                side = "kept_pos" if i in kept else "dropped_pos"
                self.pen[f"p_err_{side}"].append(oc.p_err[i])
                self.pen[f"p_format_{side}"].append(oc.p_format[i])
                self.pen[f"p_total_{side}"].append(p_total[i])
        for r, f in zip(g.rollouts, oc.p_format, strict=True):
            self.calls += len(r.tool_calls)
            self.failed_calls += sum(c.failed for c in r.tool_calls)
            self.no_call += not r.tool_calls
            self.fmt_bad += f >= 1.0

    def metrics(self) -> dict[str, float]:
        """The `roc/…` metrics of every group counted so far."""
        metrics = {f"roc/{k}": v for k, v in self.m.items()}
        for k, xs in self.pen.items():
            mean = _mean(xs)
            if mean is not None:
                metrics[f"roc/{k}"] = mean
        n = self.m["rollouts_in"]
        metrics["roc/tool_error_ratio"] = self.failed_calls / self.calls if self.calls else 0.0
        if n:
            metrics["roc/no_tool_call_frac"] = self.no_call / n
            metrics["roc/format_bad_frac"] = self.fmt_bad / n
        return metrics
