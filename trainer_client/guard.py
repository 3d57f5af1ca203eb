"""``GuardedTraining``: loss-spike rollback and GPU health checks over a TrainingSession.

A thin layer: the session keeps doing restore, reading and checkpoints (offsets in the
manifest); this adds the answers of :mod:`trainer_client.spikes` and
:mod:`trainer_client.health`. The whole script can be three lines::

    guarded = GuardedTraining(session, state, optimizer=opt, monitor=monitor)
    guarded.restore()
    guarded.run(session.dataset(batch_size=32), train_step, checkpoint_every=100)

where ``train_step(batch)`` computes the loss, calls ``backward()`` and returns the
loss (or ``(loss, grad_norm)``). The same loop by hand::

    with guarded.exit_on_gpu_critical():          # CRITICAL GPU: checkpoint, exit 75
        for batch in guarded.batches(loader):     # health check before each batch
            loss = loss_fn(model, batch); loss.backward()
            if guarded.observe(loss, batch):      # False: rolled back, or raises
                optimizer.step()                  # RollbackLimitError at the cap
            optimizer.zero_grad()
            if guarded.step % 100 == 0:
                guarded.checkpoint()

On a spike :meth:`observe` waits for in-flight checkpoints and calls
``session.rollback(state, to_step)``: weights, optimizer and stream offsets go back
together to the newest committed checkpoint of the current lineage taken before the
spike (``RollbackConfig.checkpoints_back`` further back), the gradients are cleared and
the learning rate is set to ``base_lr x guard.lr_scale``. The replay then drops the
offending batches in :meth:`batches`, *after* the session recorded their offsets:
consumed, never trained. Every checkpoint written through :meth:`checkpoint` lists all
batches this rank dropped so far: in its rank's state object (session record 4,
:func:`trainguard.core.rank_record.checkpoint_skipped` reads them), or in the
manifest's ``extra["skipped_batches"]`` with a store without per-rank objects.

Batch IDs (:func:`batch_id`) name a batch by its records: ``"<partition>:<first
ID>..<last ID>"`` per partition, joined by ``;``. They are stable across a replay when
the replay forms the same batches, which deterministic mode guarantees. A greedy-mode
replay may form other batches: then every replayed batch that shares a record with an
offending one is dropped (and listed), so a poisoned record is never trained.

Guard state: the :class:`~trainer_client.spikes.SpikeGuard` state, the dropped batch
IDs and the steps of the current lineage's checkpoints are saved in every checkpoint
under the state key :data:`GUARD_STATE_KEY` and loaded by :meth:`restore` (a restart).
A rollback loads only the training state and keeps the guard's live state: the rollback
history must survive rollbacks, or the cap would never trigger (the detector window
needs no rewinding either: spike values never enter it). A checkpoint without guard
state (written before the run used the guard) restores with a fresh guard.

A fresh run (no checkpoint yet) gets a blocking checkpoint of step 0 from
:meth:`restore`, so a spike before the first periodic checkpoint (NaN during warmup)
still has somewhere to roll back to.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Literal

import torch

from trainer_client._batch_ids import batch_id, overlaps
from trainer_client._every import check_every
from trainer_client.batch import Batch
from trainer_client.errors import GpuCriticalError, NoRollbackTargetError, PeerGpuCriticalError
from trainer_client.health import HealthMonitor, HealthProbe, HealthReport
from trainer_client.health.leave import leave_node
from trainer_client.session import TrainingSession
from trainer_client.spikes import (
    STATE_VERSION,
    Action,
    Decision,
    LossSpikeDetector,
    RollbackConfig,
    RollbackPolicy,
    SpikeConfig,
    SpikeGuard,
)
from trainguard.core.checkpoints import SaveHandleView, StateMismatchError
from trainguard.core.record import SKIPPED_KEY as SKIPPED_EXTRA_KEY

__all__ = ["GUARD_STATE_KEY", "SKIPPED_EXTRA_KEY", "GuardedTraining", "batch_id"]

log = logging.getLogger(__name__)

GUARD_STATE_KEY = "trainguard_guard"
"""Key of the guard's state inside the saved training state."""

class _GuardState:
    """What the checkpoint store saves under GUARD_STATE_KEY; see the module docstring."""

    def __init__(self, owner: GuardedTraining) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        o = self._owner
        return {
            "version": STATE_VERSION,
            "spike_guard": o.guard.state_dict(),
            "dropped": list(o.dropped_batch_ids),
            "lineage": list(o._lineage),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        o = self._owner
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"guard state has version {state.get('version')!r}, expected {STATE_VERSION}: "
                "the checkpoint was written by an incompatible trainguard; restore it "
                "without GuardedTraining or start a new run"
            )
        o.guard.load_state_dict(dict(state["spike_guard"]))
        o.dropped_batch_ids = [str(b) for b in state["dropped"]]
        o._lineage = [int(s) for s in state["lineage"]]


class GuardedTraining:
    """Spike rollback and GPU health over ``session``; see the module docstring.

    ``state`` is the mapping the session checkpoints (model, optimizer, ...); the guard
    adds its own key when saving and loading, never to ``state`` itself. ``optimizer``
    (optional) gets its gradients cleared on a rollback and its learning rates set to
    ``base x lr_scale`` (base: the rates it has when passed here) when
    ``RollbackConfig.lr_scale < 1``; with an LR scheduler pass ``scale_lr=False`` and
    multiply the scheduled rate by :attr:`lr_scale` yourself. ``monitor`` is checked
    between steps; without one, :meth:`health` probes on demand.

    With several ranks, report the all-reduced loss so that every rank decides the
    same (``session.rollback`` is collective); each rank drops its own batches, and the
    manifest lists rank 0's. A rank out of data gets join mode's empty batches
    (``len(batch) == 0``) until every rank is: ``train_step`` steps on them as its peers
    do (a zero loss, so that a gradient all-reduce still matches). A CRITICAL GPU on
    one rank is decided by all of them at one step boundary (see
    :meth:`exit_on_gpu_critical`).
    """

    def __init__(
        self,
        session: TrainingSession,
        state: MutableMapping[str, Any],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        spike: SpikeConfig | None = None,
        rollback: RollbackConfig | None = None,
        monitor: HealthMonitor | None = None,
        probe: HealthProbe | None = None,
        initial_checkpoint: bool = True,
        scale_lr: bool = True,
    ) -> None:
        if GUARD_STATE_KEY in state:
            raise ValueError(f"state must not use the key {GUARD_STATE_KEY!r}: the guard saves "
                             "its own state there")
        self.session = session
        self.state = state
        self.optimizer = optimizer
        self.guard = SpikeGuard(LossSpikeDetector(spike), RollbackPolicy(rollback))
        self.monitor = monitor
        self._probe = probe
        self.initial_checkpoint = initial_checkpoint
        self.scale_lr = scale_lr
        self.step = 0
        """Steps applied in the current lineage (the step the next checkpoint gets)."""
        self.dropped_batch_ids: list[str] = []
        """Batches dropped on replay so far: consumed, never trained."""
        self._lineage: list[int] = []  # steps of this lineage's checkpoints, oldest first
        self._stateful = _GuardState(self)
        self._base_lrs = [float(g["lr"]) for g in optimizer.param_groups] if optimizer else []

    # ------------------------------------------------------------------ state

    @property
    def lr_scale(self) -> float:
        return self.guard.lr_scale

    def _target(self) -> dict[str, Any]:
        return {**self.state, GUARD_STATE_KEY: self._stateful}

    def _copy_back(self, target: Mapping[str, Any]) -> None:
        # Stateful objects were loaded in place; plain values were replaced in the copy.
        for k in self.state:
            self.state[k] = target[k]

    def _apply_lr(self) -> None:
        if (self.optimizer is None or not self.scale_lr
                or self.guard.policy.config.lr_scale == 1.0):
            return
        for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            g["lr"] = base * self.lr_scale

    def restore(self) -> int:
        """Restore the newest checkpoint (guard state included) through the session;
        on a fresh run, write the step-0 checkpoint. Returns the step."""
        target = self._target()
        try:
            self.step = self.session.restore(target)
        except StateMismatchError:
            # The newest checkpoint may predate the guard (a run switched onto it): it
            # lacks only our key if the plain state loads; else this raises the same
            # mismatch. The store checks keys before it changes anything.
            self.step = self.session.restore(self.state)
            log.warning("checkpoint of step %d has no guard state: the spike guard starts "
                        "fresh", self.step)
        else:
            self._copy_back(target)
        if not self._lineage:
            if self.step > 0:
                self._lineage = [self.step]  # the restored checkpoint is a rollback target
            elif self.initial_checkpoint:
                self.checkpoint(blocking=True)
        self._apply_lr()
        return self.step

    def checkpoint(self, *, blocking: bool = False, extra: Mapping[str, Any] | None = None) -> SaveHandleView:
        """``session.checkpoint`` of the state plus the guard's, at :attr:`step`, with
        the dropped batch IDs as the checkpoint's skipped batches (module docstring)."""
        if extra is not None and SKIPPED_EXTRA_KEY in extra:
            raise ValueError(f"extra must not use the key {SKIPPED_EXTRA_KEY!r}: the guard "
                             "writes it")
        self._lineage = [s for s in self._lineage if s != self.step] + [self.step]
        return self.session.checkpoint(self._target(), self.step, blocking=blocking, extra=extra,
                                       skipped=list(self.dropped_batch_ids))

    # ------------------------------------------------------------------ health

    def health(self) -> HealthReport:
        """``session.health`` with this guard's monitor or probe: the monitor's latest
        report (probing now if it has none yet); without a monitor, a probe now. A
        node without GPUs reports ``no_gpu=True``."""
        return self.session.health(self.monitor, probe=self._probe)

    def check_health(self) -> None:
        """Raise GpuCriticalError once the monitor saw a CRITICAL report. With several
        ranks this is left to the session's per-step all-reduce (a rank raising alone
        would leave the others in the checkpoint's collective without it)."""
        if self.monitor is not None and self.session.world_size == 1:
            self.monitor.check()

    @contextlib.contextmanager
    def exit_on_gpu_critical(self) -> Iterator[None]:
        """On GpuCriticalError inside: blocking checkpoint of the current step, then
        ``SystemExit`` with the error's exit code (75): the orchestrator replaces the node.

        With several ranks, every rank gets here at the same step boundary (the
        session's all-reduce, see :meth:`batches`) and the checkpoint is taken by all of
        them. The bad rank then quarantines its node and stops its torchrun agent
        (:func:`~trainer_client.health.leave.leave_node`) before exiting with 75; the
        healthy ranks exit with 76 (PeerGpuCriticalError) so that their agents
        rendezvous again without the bad node."""
        try:
            yield
        except GpuCriticalError as exc:
            log.critical("%s Checkpointing step %d, then exiting with code %d.",
                         exc, self.step, exc.exit_code)
            try:
                self.checkpoint(blocking=True)
                self.session.wait()
            except Exception:
                # A failing GPU may fail the save too: the node must still be replaced,
                # and the last committed checkpoint is restored there.
                log.exception("checkpoint after the CRITICAL health report failed; exiting "
                              "with code %d anyway", exc.exit_code)
            if not isinstance(exc, PeerGpuCriticalError):
                report = exc.report if isinstance(exc.report, HealthReport) else None
                reason = ("GPU health " + "; ".join(report.problems())
                          if report is not None else str(exc))
                leave_node(self.session.redis_url, reason,
                           report=report.to_dict() if report is not None else None)
            # The run's incident says gpu_critical, not an exit or a crash.
            self.session._heal.attempts.gpu_critical(exc)
            raise SystemExit(exc.exit_code) from exc

    # ------------------------------------------------------------------ the loop

    def _offending(self, bid: str) -> bool:
        if self.guard.is_skipped(bid):
            return True
        return any(overlaps(bid, str(s)) for s in self.guard.skipped_batch_ids if s)

    def batches(self, loader: Iterable[Batch]) -> Iterator[Batch]:
        """``session.batches(loader)`` without the offending batches. The health check
        runs before each batch is taken from the session, so a checkpoint made on
        GpuCriticalError never includes a batch that was not trained."""
        inner = self.session.batches(loader, health=self.monitor)
        try:
            while True:
                self.check_health()
                batch = next(inner, None)
                if batch is None:
                    return
                if not batch.ids:
                    # Join mode's empty batch (this rank ran out, another has not):
                    # nothing in it to drop; the loop steps on it like its peers.
                    yield batch
                    continue
                bid = batch_id(batch)
                if self._offending(bid):
                    # The session already recorded its offsets: consumed, never trained.
                    if bid not in self.dropped_batch_ids:
                        self.dropped_batch_ids.append(bid)
                    log.warning("dropping batch %s on replay (it caused a loss spike)", bid)
                    continue
                yield batch
        finally:
            # Close the session's generator now (it stops an abandoned pass's workers),
            # not whenever it is collected.
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    def observe(
        self, loss: float | torch.Tensor, batch: Batch, *, grad_norm: float | torch.Tensor | None = None
    ) -> bool:
        """Judge the step of ``batch`` after backward, before ``optimizer.step()``.

        True: apply it (it becomes :attr:`step`). False: it was a spike and training
        was rolled back (:attr:`step` is the restored step). Raises RollbackLimitError
        at the cap, NoRollbackTargetError (a RollbackLimitError) when no checkpoint
        before the spike is left to roll back to."""
        value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss)
        gn = None if grad_norm is None else float(grad_norm)
        # An empty batch (join mode) is judged too: with the all-reduced loss every rank
        # must take the same decision, or one would roll back (a collective) alone.
        bid = batch_id(batch) if batch.ids else ""
        decision = self.guard.observe(self.step + 1, value, batch_id=bid, grad_norm=gn)
        if decision.action is Action.CONTINUE:
            self.step += 1
            return True
        decision.raise_for_stop()
        self._rollback(decision)
        return False

    def _rollback_target(self, decision: Decision) -> int:
        # The spike's steps are consecutive and end at decision.step; a checkpoint of
        # one of them already holds a spike batch's update.
        first = decision.step - len(decision.skip_batch_ids) + 1
        stored = {int(m.step) for m in self.session.checkpoints()}
        eligible = sorted((s for s in self._lineage if s < first and s in stored), reverse=True)
        if not eligible:
            raise NoRollbackTargetError(
                f"loss spike at step {decision.step} ({decision.reason}) needs a committed "
                f"checkpoint before step {first} to roll back to, found none in "
                f"{sorted(stored)} (this lineage: {self._lineage}). Keep initial_checkpoint="
                "True or checkpoint before training starts."
            )
        back = decision.checkpoints_back
        if back >= len(eligible):
            log.warning("RollbackConfig.checkpoints_back=%d but only %d checkpoints before "
                        "the spike are kept: using the oldest, step %d",
                        back, len(eligible), eligible[-1])
        return eligible[min(back, len(eligible) - 1)]

    def _rollback(self, decision: Decision) -> None:
        if self.optimizer is not None:
            # The spike's gradients must not leak into the replay's first step.
            self.optimizer.zero_grad(set_to_none=True)
        self.session.wait()
        to_step = self._rollback_target(decision)
        log.warning("loss spike at step %d (%s): rolling back to step %d, skipping %s",
                    decision.step, decision.reason, to_step, list(decision.skip_batch_ids))
        # Only the training state: the guard's saved state stays on disk (see the
        # module docstring), and checkpoints from before the guard have none.
        self.step = self.session.rollback(
            self.state, to_step, reason=f"loss spike at step {decision.step} ({decision.reason})")
        self._lineage = [s for s in self._lineage if s <= to_step]
        self._apply_lr()

    def run(
        self,
        loader: Iterable[Batch],
        train_step: Callable[[Batch], Any],
        *,
        checkpoint_every: int | Literal["auto"],
    ) -> int:
        """The loop of the module docstring until the data ends; a final blocking
        checkpoint; returns the last step. ``train_step(batch)`` does forward and
        backward and returns the loss or ``(loss, grad_norm)``; the optimizer (required
        here) steps on accepted steps. CRITICAL GPU health: checkpoint and exit 75.
        ``checkpoint_every``: every n-th step, or ``"auto"``: when
        ``session.should_checkpoint`` says (the session's own ``checkpoint_every``
        decides how: ``"auto"`` there gives each tier of its store its interval)."""
        if self.optimizer is None:
            raise ValueError("run() needs the optimizer: pass optimizer= to GuardedTraining")
        if check_every(checkpoint_every) is None:
            raise ValueError("checkpoint_every must be a whole number of steps >= 1 or "
                             "'auto', got None")
        opt = self.optimizer
        saved = self.step
        with self.exit_on_gpu_critical():
            for batch in self.batches(loader):
                out = train_step(batch)
                loss, gn = out if isinstance(out, tuple) else (out, None)
                applied = self.observe(loss, batch, grad_norm=gn)
                if applied:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                if not applied:
                    saved = self.step
                elif (self.session.should_checkpoint(self.step) if checkpoint_every == "auto"
                      else self.step % checkpoint_every == 0):
                    self.checkpoint()
                    saved = self.step
            if saved != self.step:
                self.checkpoint(blocking=True)
            self.session.wait()
        return self.step
