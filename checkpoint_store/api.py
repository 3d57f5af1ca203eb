"""``CheckpointStoreAPI``: what :class:`CheckpointStore` and
:class:`TieredCheckpointStore` both offer, so that a caller (e.g. a
``TrainingSession``'s ``store``) can be typed against either. The tiered store mirrors
the plain one's signatures on purpose; ``test_both_stores_implement_the_shared_api``
keeps them from drifting apart."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from checkpoint_store.handle import SaveHandle
from checkpoint_store.manifest import Manifest
from checkpoint_store.retention import GcReport

__all__ = ["CheckpointStoreAPI"]


class CheckpointStoreAPI(Protocol):
    """Save, list, verify, load, pin and delete checkpoints of one run."""

    url: str

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def save(self, state: Mapping[str, Any], *, step: int,
             extra: Mapping[str, Any] | None = None, blocking: bool = True,
             if_busy: str = "wait") -> SaveHandle: ...

    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> Manifest | None: ...

    def list(self) -> builtins.list[Manifest]: ...

    def latest(self) -> Manifest | None: ...

    def verify(self, step: int) -> Manifest: ...

    def pin(self, step: int) -> Manifest: ...

    def unpin(self, step: int) -> None: ...

    def delete(self, step: int) -> builtins.list[str]: ...

    def gc(self) -> GcReport: ...

    def close(self) -> object: ...
