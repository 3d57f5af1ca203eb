"""``TrainingSession(checkpoint_every=...)``: when ``should_checkpoint`` says yes, and
with ``"auto"`` over a store of several tiers, which tiers each save goes on to.

- ``None`` (default): the single-tier advisor (Young/Daly, :mod:`trainguard.core.interval`)
  decides when; a tiered store keeps the intervals it was made with.
- an ``int`` ``n``: every ``n``-th step.
- ``"auto"``: with a plain store, the single-tier advisor; with a store of several tiers
  (:class:`~trainguard.core.tier_plan.MultiTierStore`: ``NodeTierStore``,
  ``TieredCheckpointStore``), the multi-level plan of :mod:`trainguard.core.tier_plan`:
  save every ``T_1`` seconds of training, and copy to each tier above at its own
  multiple, from each tier's measured cost and the run's failures by kind. Rank 0's
  plan is broadcast with its answer, so every rank's store follows the same one.

With ``"auto"`` over tiers, the run's failures by kind ride in each manifest
(``extra["trainguard_tiers"]``): a restore adds the kind of the failure before it (the
tier that served it says which).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from trainer_client._timing import SaveClock
from trainguard.core.checkpoints import ManifestView
from trainguard.core.tier_plan import (
    FAILURE_KINDS,
    MultiTierStore,
    TierPlan,
    TierPolicy,
    failure_kind_of,
    failures_extra,
    plan_tiers,
    read_failures,
)

__all__ = ["CheckpointEvery", "EveryMode", "check_every"]

EveryMode = int | Literal["auto"] | None


def check_every(value: Any) -> EveryMode:
    """``value`` when it is a valid ``checkpoint_every``, else a ValueError saying why."""
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        f"checkpoint_every must be a whole number of steps >= 1, 'auto' or None, got "
        f"{value!r}: pass e.g. checkpoint_every=100 (every 100th step), 'auto' (an interval "
        "per tier from measured costs and failures) or None (session.should_checkpoint's "
        "single-tier advisor)")


class CheckpointEvery:
    """One session's answer to ``should_checkpoint`` (module doc)."""

    def __init__(self, every: Any, store: Any, clock: SaveClock,
                 policy: TierPolicy | None = None) -> None:
        self.mode = check_every(every)
        self.policy = policy or TierPolicy()
        self.clock = clock
        self.tiered: MultiTierStore | None = (
            store if every == "auto" and isinstance(store, MultiTierStore) else None)
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)
        self.plan: TierPlan | None = None

    def restored(self, manifest: ManifestView | None) -> None:
        """A restore loaded ``manifest``: carry its failures by kind and add this one's."""
        self.failures = dict.fromkeys(FAILURE_KINDS, 0)
        if manifest is None:
            return
        self.failures.update(read_failures(manifest.extra))
        kind = "crash"
        if self.tiered is not None:
            kind = failure_kind_of(self.tiered.checkpoint_tiers(), self.tiered.restored_from)
        self.failures[kind] += 1

    def extra(self) -> dict[str, Any]:
        """The manifest ``extra`` entry that carries the failures by kind; only with
        ``"auto"`` over tiers, the one user of them (other manifests stay as they were)."""
        return failures_extra(self.failures) if self.tiered is not None else {}

    def _failures(self, restarts: int) -> dict[str, int]:
        """The failures by kind, with the restarts Redis counted beyond those a restore
        could name (a process that died before its first checkpoint) as crashes."""
        out = dict(self.failures)
        named = sum(n for k, n in out.items() if k != "crash")
        out["crash"] = max(out["crash"], restarts - named)
        return out

    def decide(self, step: int) -> tuple[bool, dict[str, int] | None]:
        """``(due, every)``: whether to save at ``step``, and with ``"auto"`` over
        tiers the copy interval of each tier above the first (else None)."""
        if isinstance(self.mode, int):
            self.clock.elapsed_s(step)
            return step % self.mode == 0, None
        if self.tiered is None:
            return self.clock.should_checkpoint(step), None
        elapsed = self.clock.elapsed_s(step)
        tiers = self.tiered.checkpoint_tiers()
        advice = self.clock.advice()
        if advice is None:
            # Nothing measured: the first save goes to every tier and measures each.
            return elapsed >= self.policy.min_interval_s, {t.name: 1 for t in tiers[1:]}
        self.plan = plan_tiers(
            tiers, save_cost_s=advice.blocked_s, failures=self._failures(advice.failures),
            observed_s=advice.observed_s, policy=self.policy,
            floor_s=max(0.0, advice.durable_s - advice.blocked_s))
        return elapsed >= self.plan.period_s, self.plan.every

    def follow(self, every: Mapping[str, int] | None) -> None:
        """The save about to start and the next ones copy to the tiers at ``every``."""
        if every is not None and self.tiered is not None:
            self.tiered.follow_tiers(every)
