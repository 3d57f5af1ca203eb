"""``checkpoint_every="auto"`` over a store of several tiers: each tier's interval from
its measured cost and the rate of the failures it is the cheapest tier to survive.

The formula is the first-order multi-level model of :mod:`trainguard.core.multilevel`
(Di, Robert, Vivien and Cappello, IPDPS 2014; Benoit et al., IEEE TC 2017: the
closed form of the Markov model SCR's users apply, Moody et al., SC'10). With tier
``i`` costing ``C_i`` seconds a checkpoint and ``lambda_i`` the rate of the failures
that tier ``i`` is the cheapest to survive, the waste per second of training is::

    W = sum_i C_i / T_i + sum_i lambda_i * T_i / 2,   T_1 <= T_2 <= ... <= T_n

so each tier is checkpointed every ``T_i = sqrt(2 C_i / lambda_i)`` seconds (two
tiers whose periods would break the order share one, with pooled cost and rate;
a tier no failure needs is never copied on its own account), and a tier-``i+1``
checkpoint is a copy of every ``round(T_{i+1} / T_i)``-th tier-``i`` one.

The kinds of failure (:data:`FailureKind`), mildest first: ``crash`` (a process dies,
its node and the node's memory stay), ``node`` (a node is lost with its memory and
disk: its partners' copies survive), ``nodes`` (several nodes restart at once, a node
and its partners: memory gone, local disks kept) and ``job`` (the job's machines are
gone: only remote storage is left). A store names, for each of its tiers, the most
severe kind it survives (:class:`TierInfo`); a failure of kind
``k`` counts against the cheapest tier that survives ``k``, or the most durable
tier when none does (nothing better exists).

Rates. Each kind's rate is a posterior (as the single-tier advisor's MTBF, a Gamma
prior read as ``prior_weight`` failures in ``prior_weight * prior_mtbf_s``)::

    lambda_k = (prior_weight + n_k) / (prior_weight * prior_mtbf_s[k] + observed_s)

with ``n_k`` the run's failures of kind ``k``. A restore says which kind the failure
before it was: the kind of the tier that served it (a restore from RAM followed a
crash, from a partner a node loss, ...); a restart whose kind is unknown (it died
before its first checkpoint, or the store does not say) counts as a ``crash``.
Defaults (:class:`TierPolicy`): a crash a day, a node lost every 4 days, a node and
its partners every 30 days, the job every 90 days, each worth one observed failure.

Costs. ``C`` of the tier the session saves to is what the save blocks the loop
(measured by the session); ``C`` of a tier the store copies to in the background is
the copy's measured duration: it uses the node's disk, network and CPU while the loop
runs, and it must end before the next copy is due. A tier not measured yet is copied
at every save, so the first saves measure every tier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from trainguard.core.multilevel import Level, level_periods, nested_multiples

__all__ = ["FAILURE_KINDS", "TIERS_KEY", "FailureKind", "MultiTierStore", "TierInfo", "TierPlan",
           "TierPolicy", "failure_kind_of", "failure_rates", "failures_extra", "plan_tiers",
           "read_failures"]

FailureKind = Literal["crash", "node", "nodes", "job"]
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)

TIERS_KEY = "trainguard_tiers"
"""The manifest ``extra`` key of the run's failures by kind (``{"version": 1,
"failures": {kind: n}}``), carried from checkpoint to checkpoint."""
TIERS_VERSION = 1


@dataclass(frozen=True)
class TierInfo:
    """One tier of a store: its name (``ram``, ``partner``, ``disk``, ``remote``), the
    most severe failure it survives, and the measured seconds of a copy to it (None:
    not measured yet; always None for the tier the session saves to)."""

    name: str
    survives: FailureKind
    copy_s: float | None = None


@runtime_checkable
class MultiTierStore(Protocol):
    """A checkpoint store of several tiers whose intervals ``checkpoint_every="auto"``
    sets: ``NodeTierStore`` (RAM, partners, disk, remote) and
    ``TieredCheckpointStore`` (local disk, remote)."""

    restored_from: str | None
    """The tier that served the last load (``ram``, ``partner:n1``, ``disk``, ...)."""

    def checkpoint_tiers(self) -> Sequence[TierInfo]:
        """The tiers, cheapest first; the first is the one each save writes."""
        ...

    def follow_tiers(self, every: Mapping[str, int]) -> None:
        """From the next save on, tier ``t`` gets a copy of every ``every[t]``-th save
        (0: none); tiers not named keep their interval."""
        ...


@dataclass(frozen=True)
class TierPolicy:
    """Priors of the failure rates by kind (module doc) and bounds on the period of
    the tier saves go to."""

    prior_mtbf_s: Mapping[str, float] = field(default_factory=lambda: {
        "crash": 24 * 3600.0, "node": 4 * 24 * 3600.0, "nodes": 30 * 24 * 3600.0,
        "job": 90 * 24 * 3600.0})
    prior_weight: float = 1.0
    min_interval_s: float = 0.0
    max_interval_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        missing = [k for k in FAILURE_KINDS if k not in self.prior_mtbf_s]
        unknown = [k for k in self.prior_mtbf_s if k not in FAILURE_KINDS]
        if missing or unknown:
            raise ValueError(f"prior_mtbf_s must name each of {FAILURE_KINDS} once, got "
                             f"{sorted(self.prior_mtbf_s)} (missing {missing}, unknown {unknown})")
        bad = {k: v for k, v in self.prior_mtbf_s.items() if not v > 0}
        if bad or not self.prior_weight > 0:
            raise ValueError(f"every prior_mtbf_s and prior_weight must be > 0, got {bad or ''} "
                             f"prior_weight={self.prior_weight}")
        if not 0 <= self.min_interval_s <= self.max_interval_s:
            raise ValueError(f"expected 0 <= min_interval_s <= max_interval_s, got "
                             f"{self.min_interval_s} and {self.max_interval_s}")


@dataclass(frozen=True)
class TierPlan:
    """What ``auto`` does now: save every ``period_s`` seconds of training (the first
    tier's period), and copy to tier ``t`` every ``every[t]``-th save."""

    period_s: float
    every: dict[str, int]
    periods_s: dict[str, float]
    rates_per_s: dict[str, float]
    costs_s: dict[str, float | None]

    def to_json(self) -> dict[str, Any]:
        return {"period_s": self.period_s, "every": dict(self.every),
                "periods_s": dict(self.periods_s), "rates_per_s": dict(self.rates_per_s),
                "costs_s": dict(self.costs_s)}


def failure_rates(failures: Mapping[str, int], observed_s: float,
                  policy: TierPolicy) -> dict[str, float]:
    """Each kind's posterior rate per second (module doc)."""
    w, seen = policy.prior_weight, max(0.0, observed_s)
    return {k: (w + max(0, failures.get(k, 0))) / (w * policy.prior_mtbf_s[k] + seen)
            for k in FAILURE_KINDS}


def _rank(kind: str) -> int:
    return FAILURE_KINDS.index(kind)


def plan_tiers(tiers: Sequence[TierInfo], *, save_cost_s: float, failures: Mapping[str, int],
               observed_s: float, policy: TierPolicy, floor_s: float = 0.0) -> TierPlan:
    """The plan for ``tiers`` (cheapest first, the first the one saves write) from the
    save's measured cost, the run's failures by kind and its observed seconds.
    ``floor_s``: the first tier's period is at least this (a save must be durable
    before the next one starts)."""
    if not tiers:
        raise ValueError("plan_tiers needs at least one tier")
    rates = failure_rates(failures, observed_s, policy)
    own = [0.0] * len(tiers)
    for kind, rate in rates.items():
        # The cheapest tier that survives the kind recovers it; else the most durable.
        at = next((i for i, t in enumerate(tiers) if _rank(t.survives) >= _rank(kind)),
                  len(tiers) - 1)
        own[at] += rate
    costs: list[float | None] = [max(save_cost_s, 1e-6), *(t.copy_s for t in tiers[1:])]
    known = [i for i, c in enumerate(costs) if c is not None]
    levels = [Level(tiers[i].name, max(float(costs[i] or 0.0), 1e-6), own[i]) for i in known]
    periods = dict(zip((lv.name for lv in levels), level_periods(levels), strict=True))
    first = tiers[0].name
    period = periods[first]
    lo = max(policy.min_interval_s, floor_s)
    period = min(max(period, lo), policy.max_interval_s)
    periods[first] = period
    # Later tiers: whole multiples of the one below (nested), counted in saves.
    ordered = [periods[lv.name] for lv in levels]
    multiples = nested_multiples([max(t, period) if not math.isinf(t) else t for t in ordered],
                                 period)
    every: dict[str, int] = {}
    cumulative = 1
    for lv, m in zip(levels[1:], multiples[1:], strict=True):
        if m == 0:
            every[lv.name] = 0
            continue
        cumulative *= m
        every[lv.name] = cumulative
    for i, t in enumerate(tiers[1:], start=1):
        if costs[i] is None:
            every[t.name] = 1  # not measured yet: this save measures it
    return TierPlan(period_s=period, every={t.name: every[t.name] for t in tiers[1:]},
                    periods_s=periods, rates_per_s={t.name: own[i] for i, t in enumerate(tiers)},
                    costs_s={t.name: costs[i] for i, t in enumerate(tiers)})


def failure_kind_of(tiers: Sequence[TierInfo], restored_from: str | None) -> FailureKind:
    """The kind of the failure a restore from ``restored_from`` followed (module doc)."""
    name = (restored_from or "").split(":", 1)[0]
    for t in tiers:
        if t.name == name:
            # The tier below it did not have the checkpoint: the failure was the one
            # the tier below does not survive, the mildest this tier does.
            i = tiers.index(t)
            return "crash" if i == 0 else FAILURE_KINDS[min(_rank(tiers[i - 1].survives) + 1,
                                                            _rank(t.survives))]
    return "crash"


def read_failures(extra: Mapping[str, Any] | None) -> dict[str, int]:
    """The failures by kind a manifest's ``extra`` carries (empty when none or newer)."""
    doc = (extra or {}).get(TIERS_KEY)
    if not isinstance(doc, Mapping) or doc.get("version") != TIERS_VERSION:
        return {}
    raw = doc.get("failures")
    if not isinstance(raw, Mapping):
        return {}
    return {k: int(v) for k, v in raw.items() if k in FAILURE_KINDS and isinstance(v, int)
            and v >= 0}


def failures_extra(failures: Mapping[str, int]) -> dict[str, Any]:
    """The ``extra`` entry that carries ``failures`` into the next manifest."""
    return {TIERS_KEY: {"version": TIERS_VERSION,
                        "failures": {k: int(failures.get(k, 0)) for k in FAILURE_KINDS}}}
