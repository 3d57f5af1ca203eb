"""Checkpoint intervals for several tiers at once: the first-order multi-level model.

Tier ``i`` (RAM, a partner's RAM, local disk, remote; cheapest first) costs ``C_i``
seconds per checkpoint, and ``lambda_i`` is the rate of the failures whose recovery
needs tier ``i``: the tiers below it do not survive them (a process crash needs RAM,
a node loss a partner copy, the loss of a node and its partners the disk... the loss
of the job remote storage). Checkpoints are nested: a tier-``i+1`` checkpoint is
taken at every ``m``-th tier-``i`` one. To first order the waste per second is::

    W(T_1..T_n) = sum_i C_i / T_i  +  sum_i lambda_i * T_i / 2      (T_1 <= ... <= T_n)

which separates, so each tier gets Young's period for its own cost and failures::

    T_i* = sqrt(2 * C_i / lambda_i)

When that breaks the nesting (``T_i* > T_{i+1}*``) the two tiers are merged, pooling
costs and rates, ``T = sqrt(2 * (C_i + C_{i+1}) / (lambda_i + lambda_{i+1}))``, until
it holds. This is the first-order model of Di, Robert, Vivien and Cappello
(IPDPS 2014) and Benoit et al. (IEEE TC 2017), the closed form of SCR's Markov model
(Moody et al., SC'10). A tier that no failure needs (``lambda_i = 0``) is never
checkpointed on its own account (``inf``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Level", "first_order_waste", "level_periods", "nested_multiples"]


@dataclass(frozen=True)
class Level:
    """One tier: seconds a checkpoint to it costs, and the rate (per second) of the
    failures that only it and the tiers above survive."""

    name: str
    cost_s: float
    rate_per_s: float

    def __post_init__(self) -> None:
        if not self.cost_s > 0:
            raise ValueError(f"tier {self.name}: cost_s must be > 0, got {self.cost_s}")
        if self.rate_per_s < 0:
            raise ValueError(f"tier {self.name}: rate_per_s must be >= 0, got {self.rate_per_s}")


def _period(levels: Sequence[Level]) -> float:
    rate = sum(lv.rate_per_s for lv in levels)
    cost = sum(lv.cost_s for lv in levels)
    return math.inf if rate == 0 else math.sqrt(2 * cost / rate)


def level_periods(levels: Sequence[Level]) -> list[float]:
    """Each tier's period in seconds of training (module doc), non-decreasing."""
    if not levels:
        raise ValueError("level_periods needs at least one tier")
    groups: list[list[Level]] = [[lv] for lv in levels]
    merged = True
    while merged:
        merged = False
        for i in range(len(groups) - 1):
            if _period(groups[i]) > _period(groups[i + 1]):
                groups[i:i + 2] = [groups[i] + groups[i + 1]]
                merged = True
                break
    return [_period(g) for g in groups for _ in g]


def nested_multiples(periods: Sequence[float], base_s: float) -> list[int]:
    """The periods as whole multiples: ``[every]`` where tier 0 is taken every
    ``every[0]`` units of ``base_s`` (e.g. a training step) and tier ``i`` at every
    ``every[i]``-th tier-``i-1`` checkpoint; 0 means never."""
    out: list[int] = []
    below = base_s
    for t in periods:
        if math.isinf(t):
            out.append(0)
            continue
        m = max(1, round(t / below))
        out.append(m)
        below *= m
    return out


def first_order_waste(periods: Sequence[float], levels: Sequence[Level]) -> float:
    """``W`` of the module doc: the fraction of time lost to saves and redone work."""
    return sum(lv.cost_s / t + lv.rate_per_s * t / 2
               for t, lv in zip(periods, levels, strict=True) if not math.isinf(t))
