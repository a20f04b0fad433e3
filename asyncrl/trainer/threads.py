"""How many torch threads a CPU trainer step uses, chosen by timing the steps themselves.

Owns: `ThreadTuner`, a pure state machine over step times (no torch, no clock). Does not own
the steps, or setting the count (the trainer does both: `asyncrl.trainer.torch_trainer`).

Why: torch's CPU build runs its intra-op threads as an OpenMP team, and libgomp's threads
spin between parallel regions. On an idle machine that is the fast choice (the tiny SFT step:
~340 ms on 2 threads, ~550 ms on 1). When anything else wants the CPU (a browser, another
run, other users of a shared machine), a spinning thread keeps a core from the other program
while its partner is descheduled, and each barrier waits out a time slice: the same step took
3.5 s beside one busy process and ~50 s on a machine at load 10, where one thread took 0.6 s
and 3.5 s. No fixed setting is fastest in both cases, and the load average lags and counts
the run's own threads, so the tuner measures instead. It keeps the count that made the recent
steps fastest: every so often one step runs with a neighbouring count (half or double), and the
count moves when that step was clearly faster. On an idle machine the probes lose and grow
rarer (one step in 128 at most), so the cost there is about 0.5%. A step much slower or faster than
the count's recent median (the machine's load changed) probes again at once.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class ThreadTuner:
    """The thread count for each of a series of similar steps.

    Call `threads()` before a step and `record(threads, seconds)` after it. `most` is the
    count to start from and the largest tried (torch's default: the cores torch sees).
    """

    most: int
    first_probe: int = 2
    """Steps at the starting count before the first probe (the first one, a warm-up, is not
    timed)."""
    longest_interval: int = 128
    """Steps between probes at most, after a run of lost probes. At one thread a busy
    machine hardly changes the step time, so only a probe notices that it is idle again."""
    margin: float = 0.15
    """A probe must be this much faster than the current count's median to win."""
    jump: float = 1.5
    """A step this many times slower (or faster) than the current count's median is a change
    of load: the next step probes."""
    current: int = 0
    _interval: int = 0
    _until_probe: int = 0
    _recent: list[float] = field(default_factory=list)
    _warm: set[int] = field(default_factory=set)
    _down_next: bool = True

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"most must be >= 1, got {self.most}")
        self.current = self.current or self.most
        self._interval = self.first_probe
        self._until_probe = self.first_probe

    def _neighbour(self) -> int | None:
        down, up = max(1, self.current // 2), min(self.most, self.current * 2)
        options = [c for c in ((down, up) if self._down_next else (up, down))
                   if c != self.current]
        return options[0] if options else None

    def threads(self) -> int:
        """The count for the next step: the current one, or a neighbour when a probe is due."""
        if self._until_probe <= 0 and len(self._recent) >= 2:
            return self._neighbour() or self.current
        return self.current

    def record(self, threads: int, seconds: float) -> None:
        """The step just run, with `threads` threads, took `seconds` (or any cost in proportion
        to its time: the trainer gives seconds per token, so steps of unequal size compare)."""
        if threads not in self._warm:  # a count's first step allocates its pool: not timed
            self._warm.add(threads)
            return
        if threads == self.current:
            med = statistics.median(self._recent) if len(self._recent) >= 2 else None
            if med is not None and not med / self.jump <= seconds <= med * self.jump:
                # the load changed: the old times say nothing now; one more step at this
                # count, then a probe of another
                self._recent, self._until_probe = [seconds], 0
                self._interval = self.first_probe
                return
            self._recent = [*self._recent, seconds][-5:]
            self._until_probe -= 1
            return
        med = statistics.median(self._recent) if self._recent else seconds
        self._down_next = not self._down_next
        if seconds < med * (1 - self.margin):  # the probe won: move there
            self.current, self._recent = threads, [seconds]
            self._interval = self.first_probe
        else:
            self._interval = min(self._interval * 2, self.longest_interval)
        self._until_probe = self._interval
