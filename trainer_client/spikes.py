"""Loss-spike detection and the rollback policy that answers it.

:class:`LossSpikeDetector` watches the loss (and optionally the gradient norm) over a
moving window. A value is *suspicious* when it exceeds ``factor`` times the moving
average of the accepted values (``factor=5.0`` means 400% above the average); a spike
is ``persistence`` consecutive suspicious steps, or any NaN/inf at once. Suspicious
values never enter the average, so a spike cannot raise its own bar. Before
``warmup_steps`` values have been accepted only NaN/inf count (early losses fall
fast and the average means little). Losses are assumed positive: while the average
is <= 0 only the NaN/inf check applies.

:class:`RollbackPolicy` bounds the answers: at most ``max_rollbacks`` rollbacks within
``within_steps`` *executed* steps (replayed steps count again, so a loop that spikes
at the same batch forever still runs into the cap), then
:class:`~trainer_client.errors.RollbackLimitError`.

:class:`SpikeGuard` is what the training session calls once per step, *before* the
optimizer step::

    loss = loss_fn(model(x), y)
    decision = guard.observe(step, loss.item(), batch_id=batch.id)
    if decision.action is Action.STOP:
        raise decision.error            # RollbackLimitError, with the history
    if decision.action is Action.ROLLBACK:
        restore the checkpoint ``decision.checkpoints_back`` before the last committed
        one (weights, optimizer, stream offsets together), then keep reading and drop
        every batch for which ``guard.is_skipped(batch_id)``; put
        ``guard.skipped_batch_ids`` into the next manifest (consumed, never trained)
        continue
    for g in optimizer.param_groups: g["lr"] = scheduled_lr * guard.lr_scale
    loss.backward(); optimizer.step()

The guard's state (detector window, rollback history, skipped IDs, LR scale) is in
:meth:`SpikeGuard.state_dict`: save it in every checkpoint and load it on a *restart*.
Do **not** load it when rolling back: the rollback history must survive rollbacks,
or the cap would never trigger. Batch IDs must be msgpack-able scalars (str or int)
that identify the same batch when the stream is replayed (e.g. its partition and
first/last stream IDs).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer_client.errors import RollbackLimitError

__all__ = [
    "STATE_VERSION",
    "Action",
    "BatchId",
    "Decision",
    "LossSpikeDetector",
    "RollbackConfig",
    "RollbackPolicy",
    "SpikeConfig",
    "SpikeGuard",
    "SpikeVerdict",
]

STATE_VERSION = 1
"""Version of the dicts returned by the ``state_dict()`` methods here."""

BatchId = str | int


@dataclass(frozen=True)
class SpikeConfig:
    window: int = 100
    """How many accepted values form the moving average."""
    factor: float = 5.0
    """A loss above ``factor x`` the moving average is suspicious (5.0 = 400% above)."""
    persistence: int = 1
    """Consecutive suspicious steps that make a spike (``k``)."""
    warmup_steps: int = 20
    """Accepted values needed before the factor check applies (NaN/inf always do)."""
    grad_norm_factor: float | None = None
    """Same check on the gradient norm with its own factor; ``None``: only NaN/inf."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.persistence < 1 or self.warmup_steps < 0:
            raise ValueError(
                "SpikeConfig needs window >= 1, persistence >= 1, warmup_steps >= 0; got "
                f"window={self.window}, persistence={self.persistence}, "
                f"warmup_steps={self.warmup_steps}"
            )
        for name in ("factor", "grad_norm_factor"):
            value = getattr(self, name)
            if value is not None and not value > 1.0:
                raise ValueError(f"SpikeConfig.{name} must be > 1.0 (a multiple of the "
                                 f"moving average), got {value}")


@dataclass(frozen=True)
class SpikeVerdict:
    step: int
    spike: bool
    """True: act now (roll back)."""
    suspicious: bool
    """Above the factor (or non-finite); a spike once ``persistence`` steps in a row."""
    reason: str
    steps: tuple[int, ...] = ()
    """For a spike: the consecutive suspicious steps it consists of, oldest first."""


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class LossSpikeDetector:
    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        self._loss: deque[float] = deque(maxlen=self.config.window)
        self._grad: deque[float] = deque(maxlen=self.config.window)
        self._accepted = 0
        self._pending: list[int] = []  # steps of the current run of suspicious values

    def loss_mean(self) -> float | None:
        return sum(self._loss) / len(self._loss) if self._loss else None

    def grad_norm_mean(self) -> float | None:
        return sum(self._grad) / len(self._grad) if self._grad else None

    def _above(self, value: float, window: deque[float], factor: float | None) -> float | None:
        """The moving average if ``value`` exceeds ``factor`` times it, else None."""
        if factor is None or self._accepted < self.config.warmup_steps or not window:
            return None
        mean = sum(window) / len(window)
        return mean if mean > 0 and value > factor * mean else None

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> SpikeVerdict:
        """Judge one step's loss (and gradient norm). Call once per step, in order."""
        loss = float(loss)
        grad_norm = None if grad_norm is None else float(grad_norm)
        cfg = self.config
        if not (_finite(loss) and _finite(grad_norm)):
            steps = (*self._pending, step)
            self._pending.clear()
            what = f"loss={loss}" if not math.isfinite(loss) else f"grad_norm={grad_norm}"
            return SpikeVerdict(step, True, True, f"non-finite {what} at step {step}", steps)
        reasons = []
        mean = self._above(loss, self._loss, cfg.factor)
        if mean is not None:
            reasons.append(
                f"loss {loss:.6g} > {cfg.factor:g} x moving average {mean:.6g} at step {step}"
            )
        if grad_norm is not None:
            gmean = self._above(grad_norm, self._grad, cfg.grad_norm_factor)
            if gmean is not None:
                reasons.append(
                    f"grad norm {grad_norm:.6g} > {cfg.grad_norm_factor:g} x moving "
                    f"average {gmean:.6g} at step {step}"
                )
        if not reasons:
            self._pending.clear()
            self._loss.append(loss)
            if grad_norm is not None:
                self._grad.append(grad_norm)
            self._accepted += 1
            return SpikeVerdict(step, False, False, "")
        self._pending.append(step)
        reason = "; ".join(reasons)
        if len(self._pending) < cfg.persistence:
            return SpikeVerdict(
                step, False, True,
                f"{reason} (suspicious {len(self._pending)} of {cfg.persistence} steps)",
            )
        steps = tuple(self._pending)
        self._pending.clear()
        if len(steps) > 1:
            reason = f"{reason}, {len(steps)} steps in a row since step {steps[0]}"
        return SpikeVerdict(step, True, True, reason, steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "loss_window": list(self._loss),
            "grad_norm_window": list(self._grad),
            "accepted": self._accepted,
            "pending": list(self._pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "LossSpikeDetector")
        # deque(maxlen) keeps the newest values if the configured window shrank.
        self._loss = deque((float(v) for v in state["loss_window"]), maxlen=self.config.window)
        self._grad = deque(
            (float(v) for v in state["grad_norm_window"]), maxlen=self.config.window
        )
        self._accepted = int(state["accepted"])
        self._pending = [int(s) for s in state["pending"]]


def _check_version(state: dict[str, Any], what: str) -> None:
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"{what} state has version {state.get('version')!r}, expected {STATE_VERSION}: "
            "it was written by an incompatible trainguard; start this state fresh."
        )


@dataclass(frozen=True)
class RollbackConfig:
    max_rollbacks: int = 3
    """Most rollbacks allowed within ``within_steps`` executed steps."""
    within_steps: int = 1000
    lr_scale: float = 1.0
    """Multiply the learning rate by this on every rollback (1.0: leave it)."""
    checkpoints_back: int = 0
    """0: roll back to the last committed checkpoint; 1: the one before it; ..."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 0 or self.within_steps < 1 or self.checkpoints_back < 0:
            raise ValueError(
                "RollbackConfig needs max_rollbacks >= 0, within_steps >= 1, "
                f"checkpoints_back >= 0; got {self}"
            )
        if not 0.0 < self.lr_scale <= 1.0:
            raise ValueError(f"RollbackConfig.lr_scale must be in (0, 1], got {self.lr_scale}")


@dataclass
class _Rollback:
    clock: int  # executed-step counter when it happened
    step: int
    reason: str


class RollbackPolicy:
    def __init__(self, config: RollbackConfig | None = None) -> None:
        self.config = config or RollbackConfig()
        self._history: list[_Rollback] = []
        self.total_rollbacks = 0
        self.skipped_batch_ids: list[BatchId] = []

    @property
    def lr_scale(self) -> float:
        """Product of the per-rollback scales so far: multiply the scheduled LR by it."""
        return self.config.lr_scale**self.total_rollbacks

    def allow(self, *, clock: int, step: int, reason: str, batch_ids: tuple[BatchId, ...]) -> None:
        """Record a rollback, or raise RollbackLimitError if it would pass the cap."""
        cfg = self.config
        self._history = [r for r in self._history if clock - r.clock < cfg.within_steps]
        if len(self._history) >= cfg.max_rollbacks:
            earlier = ", ".join(f"step {r.step} ({r.reason})" for r in self._history) or "none"
            raise RollbackLimitError(
                f"loss spike at step {step} ({reason}) would be rollback "
                f"{len(self._history) + 1} within {cfg.within_steps} executed steps; the "
                f"policy allows {cfg.max_rollbacks}. Earlier rollbacks: {earlier}. Skipped "
                f"batches so far: {self.skipped_batch_ids + list(batch_ids)}. Expected "
                "rolling back and skipping the batch to clear the spike, but training keeps "
                "diverging: lower the learning rate, inspect those batches, or raise "
                "RollbackConfig.max_rollbacks."
            )
        self._history.append(_Rollback(clock, step, reason))
        self.total_rollbacks += 1
        self.skipped_batch_ids.extend(b for b in batch_ids if b not in self.skipped_batch_ids)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "history": [asdict(r) for r in self._history],
            "total_rollbacks": self.total_rollbacks,
            "skipped_batch_ids": list(self.skipped_batch_ids),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "RollbackPolicy")
        self._history = [
            _Rollback(int(r["clock"]), int(r["step"]), str(r["reason"])) for r in state["history"]
        ]
        self.total_rollbacks = int(state["total_rollbacks"])
        self.skipped_batch_ids = list(state["skipped_batch_ids"])


class Action(enum.StrEnum):
    CONTINUE = "continue"
    ROLLBACK = "rollback"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    step: int
    reason: str = ""
    skip_batch_ids: tuple[BatchId, ...] = ()
    """ROLLBACK: the batches of this spike, never to be trained."""
    checkpoints_back: int = 0
    """ROLLBACK: 0 = last committed checkpoint, 1 = the one before, ..."""
    lr_scale: float = 1.0
    """Cumulative factor for the scheduled learning rate from now on."""
    error: RollbackLimitError | None = field(default=None, compare=False)
    """STOP: the error to raise."""

    def raise_for_stop(self) -> None:
        if self.error is not None:
            raise self.error


class SpikeGuard:
    """Detector + policy behind one call per step; see the module docstring."""

    def __init__(
        self, detector: LossSpikeDetector | None = None, policy: RollbackPolicy | None = None
    ) -> None:
        self.detector = detector or LossSpikeDetector()
        self.policy = policy or RollbackPolicy()
        self._clock = 0  # executed steps, replays included; never rolled back
        self._recent: deque[tuple[int, BatchId]] = deque(
            maxlen=self.detector.config.persistence
        )

    @property
    def lr_scale(self) -> float:
        return self.policy.lr_scale

    @property
    def skipped_batch_ids(self) -> list[BatchId]:
        return list(self.policy.skipped_batch_ids)

    def is_skipped(self, batch_id: BatchId) -> bool:
        return batch_id in self.policy.skipped_batch_ids

    def observe(
        self, step: int, loss: float, *, batch_id: BatchId, grad_norm: float | None = None
    ) -> Decision:
        self._clock += 1
        self._recent.append((step, batch_id))
        verdict = self.detector.observe(step, loss, grad_norm)
        if not verdict.spike:
            return Decision(Action.CONTINUE, step, verdict.reason, lr_scale=self.lr_scale)
        ids = tuple(b for s, b in self._recent if s in verdict.steps)
        try:
            self.policy.allow(clock=self._clock, step=step, reason=verdict.reason, batch_ids=ids)
        except RollbackLimitError as exc:
            return Decision(Action.STOP, step, verdict.reason, ids, lr_scale=self.lr_scale,
                            error=exc)
        self._recent.clear()
        return Decision(
            Action.ROLLBACK, step, verdict.reason, ids,
            checkpoints_back=self.policy.config.checkpoints_back, lr_scale=self.lr_scale,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "clock": self._clock,
            # Batch IDs of a suspicious run in progress, so a restart mid-run still
            # knows which batches to skip if the run becomes a spike.
            "recent": [[s, b] for s, b in self._recent],
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "SpikeGuard")
        self._clock = int(state["clock"])
        self.detector.load_state_dict(state["detector"])
        self.policy.load_state_dict(state["policy"])
        self._recent.clear()
        self._recent.extend((int(s), b) for s, b in state["recent"])
