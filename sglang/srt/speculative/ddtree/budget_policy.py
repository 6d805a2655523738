# SPDX-License-Identifier: Apache-2.0
"""Each DDTREE step's tree budget, chosen per batch size
(``--speculative-ddtree-budget-policy adaptive``).

A step of budget b yields, per request, its accept length tau(b), and costs the
step's time at this batch size, t(b). tau(b) is known exactly for every b up to the
budget the steps ran at (``metrics.DDTreeStepStats.accept_lengths``: the b-tree is
the first b nodes of the drafted tree, so one step counts for every smaller budget).
t(b) is measured here: the interval between consecutive decode steps (under the
overlap scheduler, the pipeline's step time), credited to the earlier step's bucket
and budget unless that step was the first at its width (it compiles kernels) or
another forward ran in between (``interrupted``).

Per bucket of batch sizes (powers of two) the policy first measures every candidate
budget, the full one first, then runs the one with the most tokens per second,
tau(b) / t(b), and keeps measuring the others: every ``PROBE_EVERY`` steps in a
bucket it runs the next other candidate for ``PROBE_STEPS`` steps. Until the
statistics have published tau it runs the full budget. Steps below the full budget
run outside the CUDA graphs (they are captured at the full width; upstream's graph
runner falls back to eager for another width), which is why a smaller budget pays
where a step is compute-bound: large batches, long trees on big targets; unless it is
one of ``--speculative-ddtree-graph-budgets``, the candidates then, whose verifies replay
graphs of their own width (``verify_graphs``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence

#: Step intervals that measure a budget before it is ranked.
MIN_SAMPLES = 4
#: Recent step intervals kept per budget (their median is t(b)).
KEPT_SAMPLES = 16
#: Steps of a bucket between re-measurements of another candidate.
PROBE_EVERY = 256
#: Steps per re-measurement (the first one is not counted).
PROBE_STEPS = MIN_SAMPLES + 1
#: Steps a candidate may take to be measured before the policy moves on (when prefills keep
#: interrupting the intervals); one that got no measurement is not ranked until a probe gets one.
EXPLORE_STEPS = 4 * PROBE_STEPS
#: An interval this many times the budget's median, or longer than ``MAX_STEP_S``,
#: spans something else (an idle server, a prefill the scheduler ran between steps).
OUTLIER = 8.0
MAX_STEP_S = 5.0

AcceptLengths = Callable[[Sequence[int]], Dict[int, Optional[float]]]


def bucket_of(batch_size: int) -> int:
    """Batch sizes share measurements in power-of-two buckets (1, 2, 4, ...)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


@dataclass
class _Bucket:
    samples: Dict[int, Deque[float]]
    explored: Dict[int, int] = field(default_factory=dict)  # steps run while measuring each candidate
    steps: int = 0
    probe: Optional[int] = None  # the budget being re-measured, and its steps left
    probe_left: int = 0
    next_probe: int = 0
    chosen: Optional[int] = None


@dataclass
class _Step:
    bucket: int
    budget: int
    started: float
    warm: bool  # its width had run before (no kernel compiles in it)


@dataclass
class AdaptiveBudget:
    full: int
    candidates: Sequence[int]
    accept_lengths: AcceptLengths
    clock: Callable[[], float] = time.perf_counter
    _buckets: Dict[int, _Bucket] = field(default_factory=dict)
    _last: Optional[_Step] = None
    _ran: set = field(default_factory=set)  # budgets that have run a step

    def __post_init__(self):
        self.candidates = tuple(sorted({int(b) for b in self.candidates}, reverse=True))
        if not self.candidates or self.candidates[0] != self.full or self.candidates[-1] < 1:
            raise ValueError(f"candidate budgets {self.candidates} must lie in [1, {self.full}] and include it")

    def choose(self, batch_size: int) -> int:
        """The budget of the decode step about to run on ``batch_size`` requests."""
        now = self.clock()
        self._credit(now)
        key = bucket_of(batch_size)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket({b: deque(maxlen=KEPT_SAMPLES) for b in self.candidates})
        budget = self._decide(bucket)
        self._last = _Step(key, budget, now, budget in self._ran)
        self._ran.add(budget)
        bucket.steps += 1
        return budget

    def interrupted(self) -> None:
        """A forward other than a decode step ran (prefill, idle): the next interval is
        not a step time."""
        self._last = None

    def step_times(self, batch_size: int) -> Dict[int, Optional[float]]:
        """The median measured step time (s) of each candidate in ``batch_size``'s bucket."""
        bucket = self._buckets.get(bucket_of(batch_size))
        return {b: (statistics.median(bucket.samples[b]) if bucket and bucket.samples[b] else None)
                for b in self.candidates}  # fmt: skip

    def _credit(self, now: float) -> None:
        last = self._last
        if last is None or not last.warm:
            return
        interval = now - last.started
        samples = self._buckets[last.bucket].samples[last.budget]
        if not 0.0 < interval <= MAX_STEP_S:
            return
        if len(samples) >= MIN_SAMPLES and interval > OUTLIER * statistics.median(samples):
            return
        samples.append(interval)

    def _decide(self, bucket: _Bucket) -> int:
        tau = self.accept_lengths(self.candidates)
        if tau.get(self.full) is None:
            return self.full  # no statistics yet: every smaller budget is counted from these steps
        # Measure each candidate whose accept length is known, the full budget first.
        for b in self.candidates:
            if tau.get(b) is not None and len(bucket.samples[b]) < MIN_SAMPLES:
                if bucket.explored.get(b, 0) < EXPLORE_STEPS:
                    bucket.explored[b] = bucket.explored.get(b, 0) + 1
                    return b
        if bucket.probe is not None:
            bucket.probe_left -= 1
            if bucket.probe_left > 0:
                return bucket.probe
            bucket.probe = None
        best = self._best(bucket, tau)
        others = [b for b in self.candidates if b != best and tau.get(b) is not None]
        if others and bucket.steps and bucket.steps % PROBE_EVERY == 0:
            bucket.probe = others[bucket.next_probe % len(others)]
            bucket.next_probe += 1
            bucket.probe_left = PROBE_STEPS
            return bucket.probe
        bucket.chosen = best
        return best

    def _rates(self, bucket: _Bucket, tau: Dict[int, Optional[float]]) -> Dict[int, float]:
        """Tokens per second per request, tau(b) / t(b), of each measured candidate (in the
        candidates' descending order)."""
        return {b: tau[b] / statistics.median(bucket.samples[b])
                for b in self.candidates if tau.get(b) is not None and bucket.samples[b]}  # fmt: skip

    def _best(self, bucket: _Bucket, tau: Dict[int, Optional[float]]) -> int:
        rates = self._rates(bucket, tau)
        # Ties go to the larger budget (candidates are in descending order; max keeps the first).
        return max(rates, key=rates.get) if rates else self.full

    def summary(self) -> List[str]:
        """One line per bucket: the budget it runs and each candidate's tokens per second
        per request (tau / t), for the stats log."""
        tau = self.accept_lengths(self.candidates)
        lines = []
        for key, bucket in sorted(self._buckets.items()):
            rates = ", ".join(f"{b}: {r:.0f}" for b, r in self._rates(bucket, tau).items())
            lines.append(f"batch <= {key}: budget {bucket.chosen or self.full} (tokens/s per request {rates or '-'})")
        return lines
