"""Bounded staleness: the admission rule of the rollout producer and the staleness of a batch.

Owns: how many steps' rollouts may be under way (`waves_allowed`), the rule that keeps or
drops a finished group (`group_lag`, `split_stale`), and the version statistics of a batch
(`version_stats`). Pure Python over `records`; no torch, no event loop. Does not own: running
rollouts (`rollout.producer`) or the loss (`algo.offpolicy`).

Vocabulary. The rollouts of one RL step are a *wave*: step k trains on wave k, the problems a
synchronous run would train at step k. The *lag* of a token is the trainer's policy version
when the token is trained minus the version that sampled it; a group's lag is the largest
lag of its tokens (its oldest token). `max_staleness = N` bounds it:

- Admission: wave k may start once step k - N - 1 has finished (its update pushed to the
  engines). Every token of wave k is then sampled under a version that is at most N updates
  older than the one step k trains, since at most N updates (steps k - N .. k - 1) happen
  between its start and its use. N = 0 is the synchronous loop: wave k starts after step
  k - 1's update. Counting finished *steps*, not versions, matters: a step whose groups were
  all dropped makes no update, and the next wave must still start.
- Consumption is in wave order (step k waits for wave k, later waves keep generating). A
  group is therefore never older than N by construction, and slow problems are not starved
  (dropping late groups and taking early finishers instead biases a run toward short,
  easy problems; peers report exactly that). The keep/drop rule is still checked at
  consumption: a group whose lag exceeds N is dropped (`stale`) and counted; one within N
  is kept, and counted as stale-kept when its lag is above 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from asyncrl.records import Group, Rollout


def waves_allowed(steps_done: int, max_staleness: int, waves_total: int) -> int:
    """How many waves of a stage may have been started once `steps_done` of its steps have
    finished: `steps_done + max_staleness + 1`, at most `waves_total` (the stage's steps)."""
    if max_staleness < 0:
        raise ValueError("max_staleness must be >= 0")
    return max(0, min(waves_total, steps_done + max_staleness + 1))


def rollout_lag(rollout: Rollout, version: int) -> int:
    """Versions between `version` and the oldest token of `rollout` that is trained (model
    tokens; the whole response if it has none)."""
    vs = rollout.versions()
    trained = [v for v, m in zip(vs, rollout.loss_mask, strict=False) if m] or vs
    oldest = min(trained, default=rollout.policy_version)
    return max(0, version - oldest)


def group_lag(group: Group, version: int) -> int:
    """The largest lag of any rollout in `group` at trainer version `version`."""
    return max((rollout_lag(r, version) for r in group.rollouts), default=0)


def split_stale(groups: Iterable[Group], version: int, max_staleness: int
                ) -> tuple[list[Group], list[Group]]:
    """(kept, dropped): groups whose lag exceeds `max_staleness` are dropped and marked
    `dropped_reason = "stale"`; the others are kept unchanged."""
    kept, dropped = [], []
    for g in groups:
        if group_lag(g, version) > max_staleness:
            g.dropped_reason = "stale"
            dropped.append(g)
        else:
            kept.append(g)
    return kept, dropped


def version_stats(groups: Sequence[Group], version: int) -> dict[str, float]:
    """Staleness of the model tokens of `groups` (all sampled rollouts, before RoC) at trainer
    version `version`: `async/stale_token_frac` (tokens sampled under an older version),
    `async/version_lag_max`, `async/version_lag_mean` (over tokens), `async/mixed_version_rollouts`
    (rollouts whose tokens come from more than one version: updated mid-generation) and
    `async/groups_stale_kept` (groups with lag > 0, the caller having dropped those over N)."""
    tokens = stale = lag_sum = lag_max = mixed = stale_groups = 0
    for g in groups:
        g_lag = 0
        for r in g.rollouts:
            vs = r.versions()
            seen = set()
            for v, m in zip(vs, r.loss_mask, strict=False):
                if not m:
                    continue
                lag = max(0, version - v)
                tokens += 1
                stale += lag > 0
                lag_sum += lag
                lag_max = max(lag_max, lag)
                g_lag = max(g_lag, lag)
                seen.add(v)
            mixed += len(seen) > 1
        stale_groups += g_lag > 0
    return {
        "async/stale_token_frac": stale / tokens if tokens else 0.0,
        "async/version_lag_max": float(lag_max),
        "async/version_lag_mean": lag_sum / tokens if tokens else 0.0,
        "async/mixed_version_rollouts": float(mixed),
        "async/groups_stale_kept": float(stale_groups),
    }
