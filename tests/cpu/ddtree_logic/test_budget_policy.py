# SPDX-License-Identifier: Apache-2.0
"""The adaptive budget policy (``speculative/ddtree/budget_policy.py``) against simulated
servers: a clock that advances by each chosen step's cost, accept lengths that depend on
the budget. It must settle on the budget with the most tokens per second in each
batch-size bucket, keep re-measuring the others, and not be fooled by a step's first run
at a new width or by an interval that spans a prefill."""

import math

import pytest

from sglang.srt.speculative.ddtree import budget_policy as bp
from sglang.srt.speculative.ddtree.metrics import budget_tiers

FULL = 16
CANDIDATES = budget_tiers(FULL)  # 1, 2, 4, 8, 16


def tau(b):
    """A concave accept-length curve, as trees give: 1.6 at B=1, 3.6 at B=16."""
    return 1.6 + 0.5 * math.log2(b)


def cost(bs, b):
    """Step seconds: a fixed part, and a part linear in the verified tokens that dominates
    at large batches (compute-bound) and hardly matters at small ones (memory-bound)."""
    return 0.010 + 2e-6 * bs * (b + 1)


def best_budget(bs):
    return max(CANDIDATES, key=lambda b: (tau(b) / cost(bs, b), b))


class Sim:
    def __init__(self, known=True):
        self.now = 0.0
        self.known = known
        self.policy = bp.AdaptiveBudget(FULL, CANDIDATES, self.accept_lengths, clock=lambda: self.now)
        self.first_at_width = set()

    def accept_lengths(self, budgets):
        return {b: (tau(b) if self.known else None) for b in budgets}

    def step(self, bs, extra=0.0):
        b = self.policy.choose(bs)
        # The first step at a width compiles kernels: ten times its cost, once.
        compile_s = 0.0 if b in self.first_at_width else 9 * cost(bs, b)
        self.first_at_width.add(b)
        self.now += cost(bs, b) + compile_s + extra
        return b


def test_the_full_budget_until_the_statistics_arrive():
    sim = Sim(known=False)
    assert {sim.step(64) for _ in range(50)} == {FULL}


def test_measures_every_candidate_then_runs_the_fastest():
    sim = Sim()
    chosen = [sim.step(64) for _ in range(40)]
    # Full budget first, then each smaller one, MIN_SAMPLES steady steps each (+1 unmeasured).
    per = bp.MIN_SAMPLES + 1
    assert chosen[: per * len(CANDIDATES)] == [b for b in sorted(CANDIDATES, reverse=True) for _ in range(per)]
    assert set(chosen[per * len(CANDIDATES):]) == {best_budget(64)}
    # The measured step times are the steps' own costs: the first step at a width is not among them.
    times = sim.policy.step_times(64)
    assert times == pytest.approx({b: cost(64, b) for b in CANDIDATES})


@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_each_bucket_settles_on_its_own_best(bs):
    sim = Sim()
    for _ in range(60):
        sim.step(bs)
    assert sim.step(bs) == best_budget(bs)
    assert best_budget(1) == FULL and best_budget(256) < FULL  # the simulation spans both regimes


def test_buckets_do_not_share_measurements():
    sim = Sim()
    for _ in range(60):
        sim.step(1)
        sim.step(256)
    assert sim.step(1) == best_budget(1) and sim.step(256) == best_budget(256)
    assert bp.bucket_of(1) == 1 and bp.bucket_of(5) == 8 and bp.bucket_of(8) == 8 and bp.bucket_of(9) == 16


def test_probes_remeasure_the_other_candidates_in_turn():
    sim = Sim()
    chosen = [sim.step(256) for _ in range(3 * bp.PROBE_EVERY + 10)]
    best = best_budget(256)
    probes = [b for b in chosen[len(CANDIDATES) * (bp.MIN_SAMPLES + 1):] if b != best]
    others = [b for b in sorted(CANDIDATES, reverse=True) if b != best]
    # Three probes of PROBE_STEPS steps, each on the next other candidate.
    assert probes == [b for b in others[:3] for _ in range(bp.PROBE_STEPS)]


def test_a_costlier_budget_is_left_when_the_probe_shows_it():
    """Costs change (longer contexts): the probes see it and the choice follows."""
    sim = Sim()
    for _ in range(40):
        sim.step(256)
    assert sim.step(256) == best_budget(256)
    global cost
    saved = cost
    try:
        cost = lambda bs, b: 0.010 if b == FULL else saved(bs, b) * 3  # noqa: E731
        for _ in range(len(CANDIDATES) * bp.PROBE_EVERY + 50):
            sim.step(256)
        assert sim.step(256) == FULL
    finally:
        cost = saved


def test_intervals_that_span_other_work_are_not_step_times():
    sim = Sim()
    for _ in range(3):
        sim.step(8)
    sim.policy.interrupted()  # a prefill ran: the next interval spans it
    sim.now += 2.0
    sim.step(8)
    sim.now += 60.0  # idle for a minute
    sim.step(8)
    assert all(t is None or t < 1.0 for t in sim.policy.step_times(8).values())
    assert sim.policy.step_times(8)[FULL] == pytest.approx(cost(8, FULL))


def test_exploration_ends_when_prefills_interrupt_every_interval():
    """A server whose decode steps are always separated by prefills never yields a step time:
    each candidate gets a bounded number of steps, then the full budget runs."""
    sim = Sim()
    chosen = []
    for _ in range(len(CANDIDATES) * bp.EXPLORE_STEPS + 30):
        chosen.append(sim.step(64))
        sim.policy.interrupted()
    assert chosen[: bp.EXPLORE_STEPS] == [FULL] * bp.EXPLORE_STEPS
    assert set(chosen[-30:]) == {FULL}
    assert all(t is None for t in sim.policy.step_times(64).values())


def test_summary_and_bad_candidates():
    sim = Sim()
    for _ in range(40):
        sim.step(64)
    (line,) = sim.policy.summary()
    assert line.startswith(f"batch <= 64: budget {best_budget(64)} (tokens/s per request 16: ")
    with pytest.raises(ValueError, match="must lie in"):
        bp.AdaptiveBudget(FULL, [4, 8], sim.accept_lengths)
    with pytest.raises(ValueError, match="must lie in"):
        bp.AdaptiveBudget(FULL, [0, 16], sim.accept_lengths)
