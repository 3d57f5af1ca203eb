"""The checkpoint interval advisor: how often to save, from what a save costs and how
often the run fails.

The formula (Young 1974, with Daly's 2006 higher-order correction). With ``C`` the
seconds a save *stops the training loop* and ``M`` the mean time between failures,
the compute time between two saves that wastes the least is::

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C     (C < 2M)
    tau = M                                                             (C >= 2M)

Young's first-order ``sqrt(2 C M)`` is the leading term. The waste it balances is
``C / (tau + C)`` (time spent saving) against ``(tau + C) / 2M`` (work redone after
a failure, half an interval on average).

Asynchronous saves. A ``TrainingSession`` save blocks the loop only while the state
is staged to host memory (``blocked_s``); the data is written and the manifest
committed in the background (``durable_s``, counted from the start of the save). So
``C`` is the blocked time, and the background part adds a constant to the work lost
per failure (a failure before the manifest commits loses the previous interval
too) without moving the optimum, as long as a save is durable before the next one
starts: hence the lower bound ``tau >= durable_s - blocked_s``. Then::

    expected lost work per failure = (tau + blocked_s) / 2 + (durable_s - blocked_s)

The MTBF comes from the run's restarts with a prior (a Gamma prior on the failure
rate, read as ``prior_weight`` failures seen in ``prior_weight * prior_mtbf_s``
seconds), so a new run with no restarts yet gets the prior, and the estimate moves
to the run's own rate as it runs::

    M = (prior_weight * prior_mtbf_s + observed_s) / (prior_weight + failures)

Every restart counts as a failure (a generation change in the manifests: the
manifests cannot tell a crash from a deliberate stop and resume).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Advice", "Bound", "IntervalPolicy", "advise", "daly_interval", "estimate_mtbf", "lost_work"]


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between saves (seconds), for a save
    that stops the loop ``cost_s`` and failures every ``mtbf_s`` on average."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"expected cost_s >= 0 and mtbf_s > 0, got {cost_s} and {mtbf_s}")
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def estimate_mtbf(observed_s: float, failures: int, *, prior_mtbf_s: float,
                  prior_weight: float) -> float:
    """Posterior mean time between failures (see the module docstring)."""
    if prior_mtbf_s <= 0 or prior_weight <= 0:
        raise ValueError("prior_mtbf_s and prior_weight must be > 0")
    return (prior_weight * prior_mtbf_s + max(0.0, observed_s)) / (prior_weight + max(0, failures))


def lost_work(interval_s: float, blocked_s: float, durable_s: float) -> float:
    """Expected seconds of training redone per failure at ``interval_s``."""
    return (interval_s + blocked_s) / 2 + max(0.0, durable_s - blocked_s)


@dataclass(frozen=True)
class IntervalPolicy:
    """How the advisor is tuned. ``prior_mtbf_s``/``prior_weight``: the prior of a run
    with no history (default: one failure a day, worth one observed failure);
    ``min_interval_s``/``max_interval_s``: bounds on the recommendation."""

    prior_mtbf_s: float = 24 * 3600.0
    prior_weight: float = 1.0
    min_interval_s: float = 10.0
    max_interval_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        if self.prior_mtbf_s <= 0 or self.prior_weight <= 0:
            raise ValueError(
                f"prior_mtbf_s and prior_weight must be > 0, got {self.prior_mtbf_s} and "
                f"{self.prior_weight}"
            )
        if not 0 <= self.min_interval_s <= self.max_interval_s:
            raise ValueError(
                f"expected 0 <= min_interval_s <= max_interval_s, got {self.min_interval_s} "
                f"and {self.max_interval_s}"
            )


Bound = Literal["min", "max", "durable"]
"""The bound that decided a recommendation: the policy's minimum or maximum, or the
time to durability (``tau >= durable_s - blocked_s``)."""


@dataclass(frozen=True)
class Advice:
    """A recommendation and what it rests on (seconds throughout)."""

    recommended_s: float
    mtbf_s: float
    blocked_s: float
    durable_s: float
    failures: int
    observed_s: float
    current_s: float | None
    lost_recommended_s: float
    lost_current_s: float | None
    bound: Bound | None
    """``"min"``, ``"max"`` or ``"durable"`` when a bound decided, else None."""
    formula: str = "Daly: sqrt(2CM)(1+sqrt(C/2M)/3+C/18M)-C, C=blocked_s"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def advise(*, blocked_s: float, durable_s: float, observed_s: float, failures: int,
           current_s: float | None = None, policy: IntervalPolicy | None = None) -> Advice:
    """The recommended interval for a save that blocks ``blocked_s`` and is durable
    after ``durable_s``, in a run observed for ``observed_s`` with ``failures``
    restarts; ``current_s`` (the interval in use) gets its lost work too."""
    policy = policy or IntervalPolicy()
    mtbf = estimate_mtbf(observed_s, failures, prior_mtbf_s=policy.prior_mtbf_s,
                         prior_weight=policy.prior_weight)
    tau = daly_interval(blocked_s, mtbf)
    bound: Bound | None = None
    floor = max(policy.min_interval_s, durable_s - blocked_s)
    if tau < floor:
        tau, bound = floor, "min" if floor == policy.min_interval_s else "durable"
    if tau > policy.max_interval_s:
        tau, bound = policy.max_interval_s, "max"
    return Advice(
        recommended_s=tau, mtbf_s=mtbf, blocked_s=blocked_s, durable_s=durable_s,
        failures=failures, observed_s=observed_s, current_s=current_s,
        lost_recommended_s=lost_work(tau, blocked_s, durable_s),
        lost_current_s=None if current_s is None else lost_work(current_s, blocked_s, durable_s),
        bound=bound,
    )
