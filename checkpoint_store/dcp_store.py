"""``DcpCheckpointStore``: the checkpoint port with save and load through DCP.

A ``TrainingSession`` (or anything written against ``CheckpointStoreAPI``) given this
store checkpoints through ``torch.distributed.checkpoint``: ``save`` runs
``dcp.save`` (``blocking=False``: ``dcp.async_save``) with ``dcp.StorageWriter``, and
``load`` runs ``dcp.load`` with ``dcp.StorageReader``, so DCP's planners and its
FSDP2 paths decide the layout while the checkpoint is an ordinary trainguard one, with
the session's offsets committed with it: each rank's ``rank_state`` goes through
``StorageWriter`` into the wrapped store's own save, so every rank writes its per-rank
state object beside its shards and the manifest indexes it, as ``CheckpointStore``
does (a session on this store gathers no rank's offsets). Listing, pinning,
verification, retention, gc and :meth:`read_rank_state` are the wrapped
``CheckpointStore``'s.

DCP reports failures as ``CheckpointException``, a ``BaseException`` that
``except Exception`` misses; here they become ``CheckpointError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_store._wrapped import WrappedStore
from checkpoint_store.dcp import StorageReader, StorageWriter
from checkpoint_store.handle import SaveHandle
from checkpoint_store.manifest import Manifest
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import (
    CheckpointError,
    IfBusy,
    ManifestView,
    NoCheckpointError,
    SaveInProgressError,
    check_if_busy,
)

__all__ = ["DcpCheckpointStore"]


def _plain(e: BaseException, what: str) -> BaseException:
    """DCP's CheckpointException as the first rank's own error (or a CheckpointError)."""
    if not isinstance(e, CheckpointException):
        return e
    for rank, (exc, _) in sorted(e.failures.items()):
        if isinstance(exc, CheckpointError):
            return exc
        err = CheckpointError(f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return CheckpointError(f"{what} failed: {e}")


class DcpCheckpointStore(WrappedStore):
    """``store``: a ``CheckpointStore`` or its URL (``options`` then go to it)."""

    supports_rank_state = True
    """Capability: ``save(rank_state=...)`` and :meth:`read_rank_state`, so a session
    writes per-rank state objects instead of gathering every rank's offsets."""

    def __init__(self, store: CheckpointStore | str, **options: Any):
        self.store = store if isinstance(store, CheckpointStore) else \
            CheckpointStore(store, **options)
        self.url = self.store.url
        self._lock = threading.Lock()
        self._current: tuple[SaveHandle, Any] | None = None

    def _settle_current(self, if_busy: IfBusy) -> None:
        with self._lock:
            current = self._current
        if current is None or current[0].done():
            return
        if if_busy == "raise":
            raise SaveInProgressError(f"the DCP save of step {current[0].step} is still "
                                      "running; wait for its handle or pass if_busy='wait'")
        current[1].exception()  # wait, whatever its outcome (the handle holds it)

    def save(self, state: Mapping[str, Any], *, step: int,
             extra: Mapping[str, Any] | None = None, blocking: bool = True,
             if_busy: IfBusy = "wait",
             rank_state: Mapping[str, Any] | None = None,
             precommit: Callable[[], None] | None = None) -> SaveHandle:
        """``dcp.save`` (or ``dcp.async_save``) of ``state`` as checkpoint ``step``;
        ``rank_state``: this rank's state object, as ``CheckpointStore.save`` takes it
        (every rank passes one, or none does). ``precommit`` (the session's fence check)
        runs here, before the save starts, and what it raises is raised as it is: DCP
        writes and commits in its own machinery (an async save in another process),
        which has no step between this rank's data and the commit to run it in."""
        self._settle_current(check_if_busy(if_busy))
        if precommit is not None:
            precommit()
        writer = StorageWriter(self.store, step=step, extra=extra, rank_state=rank_state)
        handle = SaveHandle(step)
        if blocking:
            try:
                tdcp.save(dict(state), storage_writer=writer)
            except BaseException as e:
                raise _plain(e, f"DCP save of step {step}") from e
            handle._finish(writer.manifest, None)
            return handle
        future = tdcp.async_save(dict(state), storage_writer=writer)
        # The default stager returns a plain Future (an AsyncSaveResponse needs a
        # stager configured for it, which this store does not pass).
        assert isinstance(future, Future)

        def done(f: Any) -> None:
            error = f.exception()
            handle._finish(writer.manifest if error is None else None,
                           None if error is None else _plain(error, f"DCP save of step {step}"))

        with self._lock:
            self._current = (handle, future)
        future.add_done_callback(done)
        return handle

    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> Manifest | None:
        """``dcp.load`` of the newest checkpoint (or ``step``'s) into ``state``; None
        when the store holds none. A damaged checkpoint raises (no fallback under
        DCP; ``strict`` is accepted for the port's sake)."""
        self._settle_current("wait")
        if step is None and self.store.latest() is None:
            return None
        selected = list(keys) if keys is not None else list(state)
        sub = {k: state[k] for k in selected}
        reader = StorageReader(self.store, step=step)
        try:
            tdcp.load(sub, storage_reader=reader)
        except BaseException as e:
            raise _plain(e, "DCP load") from e
        if isinstance(state, dict):
            state.update(sub)  # values DCP replaced (non-tensor items) go back in place
        if reader.manifest is None:
            raise NoCheckpointError(f"no checkpoint was loaded from {self.url}")
        return reader.manifest

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s state object of ``manifest``, verified (the wrapped store's)."""
        return self.store.read_rank_state(manifest, rank)

    def close(self) -> None:
        self._settle_current("wait")
        self.store.close()
