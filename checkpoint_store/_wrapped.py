"""``WrappedStore``: what a store built around a ``CheckpointStore`` passes through.

The RAM tier, the tiered store and the DCP store each wrap one ``CheckpointStore`` and
add their policy around it (a budget, an upload queue, DCP's planners). The calls they
pass through unchanged live here, once; a wrapper overrides what it changes and hooks
into ``save`` through :meth:`_before_save` and :meth:`_after_save`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping
from typing import Any, Self

from checkpoint_store.handle import SaveHandle
from checkpoint_store.manifest import Manifest
from checkpoint_store.retention import GcReport
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import IfBusy, ManifestView

__all__ = ["RankStateWrappedStore", "WrappedStore"]


class WrappedStore:
    """Passes the checkpoint port through to ``self.store`` (set by the subclass)."""

    store: CheckpointStore

    @property
    def rank(self) -> int:
        return self.store.rank

    @property
    def world_size(self) -> int:
        return self.store.world_size

    def _before_save(self, state: Mapping[str, Any]) -> None:
        """Runs before the wrapped save starts (a check, making room); may raise."""

    def _after_save(self, handle: SaveHandle) -> None:
        """Runs once the wrapped save has handed back its handle."""

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = True,
        if_busy: IfBusy = "wait",
    ) -> SaveHandle:
        """As :meth:`CheckpointStore.save`, between this wrapper's two hooks."""
        return self._hooked_save(state, step=step, extra=extra, blocking=blocking,
                                 if_busy=if_busy)

    def _hooked_save(self, state: Mapping[str, Any], **options: Any) -> SaveHandle:
        """The wrapped store's save of ``options``, between this wrapper's two hooks."""
        self._before_save(state)
        handle = self.store.save(state, **options)
        self._after_save(handle)
        return handle

    def list(self) -> builtins.list[Manifest]:
        return self.store.list()

    def latest(self) -> Manifest | None:
        return self.store.latest()

    def verify(self, step: int) -> Manifest:
        return self.store.verify(step)

    def pin(self, step: int) -> Manifest:
        return self.store.pin(step)

    def unpin(self, step: int) -> None:
        self.store.unpin(step)

    def delete(self, step: int) -> builtins.list[str]:
        return self.store.delete(step)

    def gc(self) -> GcReport:
        return self.store.gc()

    def close(self) -> object:
        """Closes the wrapped store; a wrapper settles what it adds first."""
        self.store.close()
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RankStateWrappedStore(WrappedStore):
    """A wrapper that also passes per-rank state objects through (the wider
    ``RankStateStoreAPI``): ``save(rank_state=...)`` and :meth:`read_rank_state`."""

    supports_rank_state = True
    """Capability: ``save(rank_state=...)`` and :meth:`read_rank_state` (a session
    then writes per-rank state objects; without it, its whole record in ``extra``)."""

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = True,
        if_busy: IfBusy = "wait",
        rank_state: Mapping[str, Any] | None = None,
        precommit: Callable[[], None] | None = None,
    ) -> SaveHandle:
        """As :meth:`CheckpointStore.save`, between this wrapper's two hooks."""
        return self._hooked_save(state, step=step, extra=extra, blocking=blocking,
                                 if_busy=if_busy, rank_state=rank_state, precommit=precommit)

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        return self.store.read_rank_state(manifest, rank)
