"""The checkpoint interval advisor: Young/Daly from measured save cost and MTBF.

The simulation injects failures at a known rate (a Poisson process, seeded) into a
run with a known save cost, sweeps the checkpoint interval, and finds the interval
that finishes the work soonest. The advisor, given the same cost and MTBF, must land
within 20% of it: for a blocking save (the classic case) and for an asynchronous one
(the loop stops only while staging, the manifest commits later; a failure before the
commit loses the previous interval too)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from trainguard.core.interval import (
    IntervalPolicy,
    advise,
    daly_interval,
    estimate_mtbf,
    lost_work,
)


def simulate(interval_s: float, *, blocked_s: float, durable_s: float, work_s: float,
             failures: list[float], restart_s: float) -> float:
    """Wall time to finish ``work_s`` of training, saving every ``interval_s`` of
    compute; ``failures`` are the wall-clock times of the failures (sorted). A save
    stops the loop ``blocked_s`` and is durable ``durable_s`` after it began; a save
    that starts before the previous one is durable waits for it (as the store does).
    A failure returns the run to the last durable save, after ``restart_s``."""
    t, done, work, fi = 0.0, 0.0, 0.0, 0
    pending: tuple[float, float] | None = None  # (work saved, wall time it is durable)
    while True:
        nxt_fail = failures[fi] if fi < len(failures) else math.inf
        if work >= work_s:  # all trained: finished when the last save is durable
            if pending is None or nxt_fail >= pending[1]:
                return t if pending is None else pending[1]
            t_event = nxt_fail
        else:
            k = math.floor(work / interval_s + 1e-9) + 1
            target = min(work_s, k * interval_s)
            # The save begins when the work is reached and the previous save is durable.
            t_begin = t + (target - work)
            if pending is not None:
                t_begin = max(t_begin, pending[1])
            t_end = t_begin + blocked_s
            if nxt_fail >= t_end:
                if pending is not None:  # durable by t_begin: the new save supersedes it
                    done = pending[0]
                work, t, pending = target, t_end, (target, t_begin + durable_s)
                continue
            t_event = nxt_fail
        # A failure: back to the newest save durable by then, after the restart.
        if pending is not None and pending[1] <= t_event:
            done = pending[0]
        pending, work, t = None, done, t_event + restart_s
        while fi < len(failures) and failures[fi] < t:
            fi += 1  # failures during the restart are the same outage


def sweep_optimum(*, blocked_s: float, durable_s: float, mtbf_s: float, seed: int,
                  work_in_mtbf: float = 1500.0) -> float:
    """The interval minimising the simulated wall time: a log-spaced sweep over one
    shared failure sequence (common random numbers), then the vertex of a parabola
    fitted to the points around the best (the curve is flat at its bottom)."""
    rng = random.Random(seed)
    work = work_in_mtbf * mtbf_s
    horizon = 3 * work
    failures, t = [], 0.0
    while t < horizon:
        t += rng.expovariate(1 / mtbf_s)
        failures.append(t)
    guess = math.sqrt(2 * blocked_s * mtbf_s)
    grid = np.geomspace(guess / 4, guess * 4, 41)
    times = np.array([simulate(float(x), blocked_s=blocked_s, durable_s=durable_s,
                               work_s=work, failures=failures, restart_s=30.0)
                      for x in grid])
    best = int(np.argmin(times))
    lo, hi = max(0, best - 6), min(len(grid), best + 7)
    a, b, _ = np.polyfit(np.log(grid[lo:hi]), times[lo:hi], 2)
    assert a > 0, "the swept curve has no minimum inside the grid"
    return float(math.exp(-b / (2 * a)))


@pytest.mark.parametrize(("blocked_s", "durable_s", "mtbf_s"), [
    (60.0, 60.0, 3600.0),    # a blocking save of a minute, a failure an hour
    (5.0, 120.0, 3600.0),    # async: 5 s staging, durable after 2 minutes
    (20.0, 20.0, 14400.0),   # rarer failures, cheaper save
])
def test_recommendation_is_within_20_percent_of_the_swept_optimum(blocked_s, durable_s, mtbf_s):
    """Failures injected at rate 1/MTBF with a known save cost: the advisor's interval
    is within 20% of the interval that finished the same work soonest."""
    optimum = sweep_optimum(blocked_s=blocked_s, durable_s=durable_s, mtbf_s=mtbf_s, seed=7)
    advice = advise(blocked_s=blocked_s, durable_s=durable_s, observed_s=mtbf_s * 50,
                    failures=50, policy=IntervalPolicy(prior_mtbf_s=mtbf_s, prior_weight=1,
                                                       min_interval_s=0))
    assert advice.mtbf_s == pytest.approx(mtbf_s)
    assert abs(advice.recommended_s - optimum) / optimum < 0.20, (advice.recommended_s, optimum)


def test_daly_formula_and_its_limits():
    """Daly's higher-order estimate: sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C below
    C = 2M, and M from there on; Young's sqrt(2CM) is its leading term."""
    c, m = 60.0, 3600.0
    r = c / (2 * m)
    assert daly_interval(c, m) == pytest.approx(
        math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c)
    assert daly_interval(c, m) == pytest.approx(math.sqrt(2 * c * m), rel=0.1)
    assert daly_interval(3 * m, m) == m
    with pytest.raises(ValueError, match="mtbf_s > 0"):
        daly_interval(1.0, 0.0)


def test_mtbf_prior_and_evidence():
    """A new run gets the prior; evidence moves the estimate toward the observed rate."""
    assert estimate_mtbf(0, 0, prior_mtbf_s=86400, prior_weight=1) == 86400
    assert estimate_mtbf(36000, 9, prior_mtbf_s=86400, prior_weight=1) == pytest.approx(
        (86400 + 36000) / 10)
    assert estimate_mtbf(3600 * 1000, 1000, prior_mtbf_s=86400, prior_weight=1) == \
        pytest.approx(3600, rel=0.03)


def test_bounds_and_lost_work():
    """The recommendation respects min/max and never starts a save before the previous
    one is durable; lost work per failure is half an interval plus the commit delay."""
    fast = advise(blocked_s=0.01, durable_s=0.02, observed_s=10, failures=5,
                  policy=IntervalPolicy(prior_mtbf_s=1, min_interval_s=30))
    assert (fast.recommended_s, fast.bound) == (30, "min")
    slow = advise(blocked_s=1, durable_s=2, observed_s=0, failures=0,
                  policy=IntervalPolicy(prior_mtbf_s=1e9, max_interval_s=600))
    assert (slow.recommended_s, slow.bound) == (600, "max")
    lagging = advise(blocked_s=1, durable_s=500, observed_s=0, failures=0,
                     policy=IntervalPolicy(prior_mtbf_s=3600, min_interval_s=0))
    assert (lagging.recommended_s, lagging.bound) == (499, "durable")
    assert lost_work(100, 4, 10) == 52 + 6
    with_current = advise(blocked_s=2, durable_s=2, observed_s=0, failures=0, current_s=40,
                          policy=IntervalPolicy(prior_mtbf_s=3600, min_interval_s=0))
    assert with_current.lost_current_s == lost_work(40, 2, 2)
    with pytest.raises(ValueError, match="min_interval_s"):
        IntervalPolicy(min_interval_s=10, max_interval_s=5)
