"""Batches whose consumption the training loop confirms later.

``TrainingSession.batches`` records a batch as consumed when it hands it out, which is
right for a loop that trains each batch as it takes it. Frameworks take one batch
ahead (Lightning's fetcher and Accelerate's ``DataLoaderShard`` look ahead to know
which batch is the last): a checkpoint taken after step k would record batch k+1,
which was never trained, and a resume would skip it.

:class:`ConfirmedBatches` hands the framework the loader's batches straight away, and
passes each one through ``session.batches`` only when :meth:`confirm` says the
framework started training it: the session's offsets are exactly what was trained,
whatever the framework prefetched. It uses only the session's public API: the
session reads a *gate* (a loader-like object) whose iterator first yields a batch of
no records (which records nothing) and then the confirmed batches, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Mapping
from typing import Any, cast

from trainer_client import Batch, TrainingSession

__all__ = ["ConfirmedBatches", "session_options"]


def session_options(framework: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``TrainingSession`` options an integration runs with: one process, greedy
    order. Greedy, because the gate below hands the session its batches one at a time,
    which deterministic mode's worker-order merge cannot take (and deterministic is
    the session's default). Raises ValueError for options that ask otherwise."""
    if options.get("world_size", 1) != 1 or options.get("deterministic"):
        raise ValueError(f"the {framework} integration runs one process in greedy order: "
                         "world_size and deterministic are not supported")
    return {**options, "deterministic": False}


class _Gate:
    """What ``session.batches`` iterates: looks like the loader (its dataset, workers)
    so the session sets the pass's seek on it; iterating it starts the loader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.dataset = getattr(loader, "dataset", None)
        self.num_workers = int(getattr(loader, "num_workers", 0))
        self.persistent_workers = bool(getattr(loader, "persistent_workers", False))
        self.raw: Iterator[Batch] | None = None
        self.confirmed: deque[Batch] = deque()

    def __iter__(self) -> Iterator[Batch]:
        self.raw = iter(self.loader)  # after the session wrote this pass's seek
        return self._feed()

    def _feed(self) -> Iterator[Batch]:
        try:
            yield Batch(data=None, ids={}, offsets={})  # starts the pass, records nothing
            while self.confirmed:
                yield self.confirmed.popleft()
        finally:
            shutdown = getattr(self.raw, "_shutdown_workers", None)
            if shutdown is not None and not self.persistent_workers:
                shutdown()
            self.raw = None


class ConfirmedBatches:
    """Iterate for the framework; call :meth:`confirm` as it starts training each
    batch (in order). One pass at a time: a new ``iter()`` ends the previous pass."""

    def __init__(self, session: TrainingSession, loader: Any) -> None:
        self.session = session
        self.loader = loader
        self._gate: _Gate | None = None
        self._recorder: Generator[Batch, None, None] | None = None
        # Handed out, not yet confirmed; None: an empty step of a rank out of data
        # (see pad()).
        self._pending: deque[Batch | None] = deque()

    @property
    def unconfirmed(self) -> int:
        """Batches handed out and not yet confirmed (what the framework prefetched)."""
        return len(self._pending)

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        gate = _Gate(self.loader)
        # A generator (the session's), so that close() ends its pass.
        recorder = cast(Generator[Batch, None, None], self.session.batches(gate))
        try:
            next(recorder)  # writes the pass's seek, starts the loader; records nothing
        except StopIteration:
            return  # a finished run (session.finished): nothing to train, nothing written
        self._gate, self._recorder = gate, recorder
        assert gate.raw is not None
        for batch in gate.raw:
            self._pending.append(batch)
            yield batch

    def pad(self) -> None:
        """Several ranks: this rank's loader is out while another rank's is not, and
        the framework is handed an empty step (so the ranks stay in step). Its
        confirm() advances the session's pass by an empty batch: the session's own
        per-step agreement of the ranks (``uneven="join"``) then matches the steps."""
        self._pending.append(None)

    def confirm(self) -> Batch:
        """The framework starts training the oldest batch handed out and not yet
        confirmed: record it as consumed. Returns it."""
        if not self._pending or self._recorder is None or self._gate is None:
            raise RuntimeError("confirm() without a batch handed out: the framework trains "
                               "batches that did not come from this loader")
        batch = self._pending.popleft()
        if batch is not None:
            self._gate.confirmed.append(batch)
        recorded = next(self._recorder)
        if batch is None:
            # The gate has nothing more: the session yields this rank an empty batch.
            assert len(recorded) == 0
            return recorded
        assert recorded is batch
        return batch

    def close(self) -> None:
        """End the current pass: the loader stops; unconfirmed batches are dropped
        (never recorded, so the next pass reads them again)."""
        if self._recorder is not None:
            self._recorder.close()
        self._recorder, self._gate = None, None
        self._pending.clear()
