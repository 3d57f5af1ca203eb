"""The lost-work part of ``bench/tiers.py``: arithmetic on the tier costs the bench
measured and failure rates it states, never a measurement of its own.

Four kinds of failure, each needing a tier to recover from (the cheapest tier that
survives it):

- a process crash (the node lives): its own RAM tier;
- a node lost (its RAM and its disk): a partner's copy;
- every node rebooted at once (RAM and partners gone, local disks kept): local disk;
- a node and its partner lost at once: remote storage.

*Today* (one interval): the session saves every ``tau`` seconds to the tiered store
(local disk, then remote), ``tau`` Daly's interval for the save's cost ``C`` (a disk
save and its upload) and the MTBF of all failures together. A process crash or a reboot restores from local disk,
a lost node from remote: each loses ``lost_work(tau, C, durable)``
(:func:`trainguard.core.interval.lost_work`), ``durable`` being how long after the
save's start that tier holds the checkpoint.

*Multi-level*: :meth:`TierIntervals.auto` picks each tier's period from its cost and
its failures' rate (first-order Young/Daly per tier, :mod:`trainguard.core.multilevel`).
A failure needing tier ``i`` loses ``lost_work(T_i, C, durable_i)``.

Both policies are charged the same way: a tier's cost is the wall seconds of its save
or copy as measured (RAM: the committed RAM save; today: the disk save plus the
upload), as if that background work stopped the loop. The loop itself stalls only
for the staging copy (``stall_s``), which is what the per-day stall figure uses and
what ``lost_work`` takes as the blocked part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from checkpoint_store.node_tiers import TierIntervals
from trainguard.core.interval import daly_interval, lost_work
from trainguard.core.multilevel import Level, first_order_waste

TIERS = ("ram", "partner", "disk", "remote")


@dataclass(frozen=True)
class Failure:
    """One kind of failure: the tier a multi-level restore needs, the tier today's
    tiered store restores from, and the stated mean time between such failures."""

    kind: str
    tier: str
    today_tier: str
    mtbf_h: float

    @property
    def rate_per_s(self) -> float:
        return 1.0 / (self.mtbf_h * 3600.0)


FAILURES = (
    Failure("process crash (node lives)", "ram", "disk", 6.0),
    Failure("node lost (RAM + disk)", "partner", "remote", 24.0),
    Failure("every node rebooted", "disk", "disk", 24.0 * 7),
    Failure("node + its partner lost", "remote", "remote", 24.0 * 30),
)
"""Stated rates for one job, not measured: a crash every 6 h, a lost node a day, a
job-wide reboot a week, a node and its partner at once a month."""


@dataclass(frozen=True)
class TierCosts:
    """Measured wall seconds: the loop's stall of an async save; how long each tier's
    save or copy takes (the RAM save committed, the partner copy of it, a local-disk
    save, a remote save)."""

    stall_s: float
    ram_s: float
    partner_s: float
    disk_s: float
    remote_s: float

    def durable_s(self, tier: str) -> float:
        """Seconds from a save's start until ``tier`` holds it (multi-level: each copy
        starts from the committed RAM checkpoint)."""
        return {"ram": self.ram_s, "partner": self.ram_s + self.partner_s,
                "disk": self.ram_s + self.disk_s,
                "remote": self.ram_s + self.remote_s}[tier]

    def today_durable_s(self, tier: str) -> float:
        """Today's tiered store: local disk first, then the upload."""
        return {"disk": self.disk_s, "remote": self.disk_s + self.remote_s}[tier]


def _expected(per_kind: dict[str, float], failures: Sequence[Failure]) -> float:
    total = sum(f.rate_per_s for f in failures)
    return sum(f.rate_per_s * per_kind[f.kind] for f in failures) / total


def compare(costs: TierCosts, *, step_s: float,
            failures: Sequence[Failure] = FAILURES) -> dict[str, Any]:
    """Lost work per failure, today's single interval against the advisor's (module doc)."""
    rates = {t: sum(f.rate_per_s for f in failures if f.tier == t) for t in TIERS}
    cost = {"ram": costs.ram_s, "partner": costs.partner_s, "disk": costs.disk_s,
            "remote": costs.remote_s}
    levels = {t: Level(t, max(cost[t], 1e-6), rates[t]) for t in TIERS}
    ram_every, iv = TierIntervals.auto(step_s=step_s, ram=levels["ram"],
                                       partner=levels["partner"], disk=levels["disk"],
                                       remote=levels["remote"])
    t_ram = ram_every * step_s
    periods = {"ram": t_ram, "partner": t_ram * iv.partner_every,
               "disk": t_ram * iv.disk_every, "remote": t_ram * iv.remote_every}
    multi = {f.kind: lost_work(periods[f.tier], costs.stall_s, costs.durable_s(f.tier))
             for f in failures}
    mtbf_s = 1.0 / sum(f.rate_per_s for f in failures)
    today_cost = costs.disk_s + costs.remote_s
    tau = max(1, round(daly_interval(today_cost, mtbf_s) / step_s)) * step_s
    today = {f.kind: lost_work(tau, costs.stall_s, costs.today_durable_s(f.today_tier))
             for f in failures}
    lost_multi, lost_today = _expected(multi, failures), _expected(today, failures)
    day = 86400.0
    return {
        "step_s": step_s, "costs": asdict(costs),
        "failures": [{"kind": f.kind, "multilevel_tier": f.tier, "today_tier": f.today_tier,
                      "mtbf_h": f.mtbf_h} for f in failures],
        "advisor": {"ram_every_steps": ram_every, "partner_every": iv.partner_every,
                    "disk_every": iv.disk_every, "remote_every": iv.remote_every,
                    "periods_s": periods,
                    "first_order_waste": first_order_waste(
                        [periods[t] for t in TIERS], [levels[t] for t in TIERS])},
        "today": {"interval_s": tau, "mtbf_s": mtbf_s, "cost_s": today_cost},
        "lost_s_per_kind": {"multilevel": multi, "today": today},
        "lost_s_per_failure": {"multilevel": lost_multi, "today": lost_today},
        "today_over_multilevel": lost_today / lost_multi if lost_multi > 0 else math.inf,
        # What each policy's saves stall the loop for, per day (lost work is only half
        # of the bill: saving every step costs a stall every step).
        "stall_s_per_day": {"multilevel": costs.stall_s / t_ram * day,
                            "today": costs.stall_s / tau * day},
        "lost_s_per_day": {"multilevel": lost_multi / mtbf_s * day,
                           "today": lost_today / mtbf_s * day},
    }


def table(doc: dict[str, Any]) -> str:
    """The comparison as printed lines (arithmetic on measured costs, said so)."""
    adv, lost = doc["advisor"], doc["lost_s_per_kind"]
    lines = [
        f"(arithmetic on the measured costs above and STATED failure rates; step {doc['step_s']} s)",
        f"advisor: RAM every {adv['ram_every_steps']} step(s), partner every "
        f"{adv['partner_every']}, disk every {adv['disk_every']}, remote every "
        f"{adv['remote_every']} RAM saves; today: one interval of "
        f"{doc['today']['interval_s']:.0f} s (Daly, MTBF {doc['today']['mtbf_s'] / 3600:.2f} h)",
        f"{'failure':30s} {'MTBF h':>7s} {'multi-level: tier':>18s} {'lost s':>8s} "
        f"{'today: tier':>12s} {'lost s':>8s}",
    ]
    for f in doc["failures"]:
        lines.append(f"{f['kind']:30s} {f['mtbf_h']:7.0f} {f['multilevel_tier']:>18s} "
                     f"{lost['multilevel'][f['kind']]:8.2f} {f['today_tier']:>12s} "
                     f"{lost['today'][f['kind']]:8.2f}")
    per = doc["lost_s_per_failure"]
    lines.append(f"{'expected per failure':30s} {'':7s} {'':>18s} {per['multilevel']:8.2f} "
                 f"{'':>12s} {per['today']:8.2f}")
    lines.append(f"loop stalled by saves per day: multi-level {doc['stall_s_per_day']['multilevel']:.1f} s, "
                 f"today {doc['stall_s_per_day']['today']:.1f} s; work redone per day: multi-level "
                 f"{doc['lost_s_per_day']['multilevel']:.1f} s, today {doc['lost_s_per_day']['today']:.1f} s")
    return "\n".join(lines)
