"""The one home of "the newest checkpoint", in both of its orders.

Restore order (:func:`restore_order`, :func:`newest_first`) is which checkpoint a
restart resumes from: the newest by the session record's ``(generation, commit)``,
then commit time. It is what every load, the CLI, the admin API and an outside reader
following FORMAT.md must use: a fenced zombie trainer (an older generation) may commit
after the newer one, and its late manifest must never be resumed from.

Commit order (:func:`commit_order`, :func:`newest_committed`) is the order manifests
were written in: ``(uid, step)`` of the name, the uid starting with the commit time.
It is what ``LATEST`` names (a hint for tools) and which manifest a save records as
its parent. "The newest save of step S" (:func:`saves_of`, :func:`newest_save_of`) is
commit order among that step's saves: a step saved twice after a rollback.

Both work on anything with ``uid`` and ``step``: a manifest or a parsed manifest name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from trainguard.core.checkpoints import ManifestView
from trainguard.core.record import RecordError, SessionRecord

__all__ = ["commit_order", "newest_committed", "newest_first", "newest_save_of",
           "restore_order", "saves_of"]


class Named(Protocol):
    """What commit order reads: a manifest or its parsed name."""

    @property
    def uid(self) -> str: ...

    @property
    def step(self) -> int: ...


N = TypeVar("N", bound=Named)
M = TypeVar("M", bound=ManifestView)


def commit_order(item: Named) -> tuple[str, int]:
    """The sort key of commit order (larger: committed later)."""
    return item.uid, item.step


def newest_committed(items: Iterable[N]) -> N | None:
    """The last committed of ``items`` (what LATEST names); None when empty."""
    return max(items, key=commit_order, default=None)


def saves_of(step: int, items: Iterable[N]) -> list[N]:
    """``step``'s saves, newest first (commit order)."""
    return sorted((i for i in items if i.step == step), key=commit_order, reverse=True)


def newest_save_of(step: int, items: Iterable[N]) -> N | None:
    """The newest save of ``step``; None when it has none."""
    return newest_committed(i for i in items if i.step == step)


def restore_order(manifest: ManifestView) -> tuple[int, int, str, int]:
    """The sort key of "which checkpoint a restart resumes from" (larger: preferred).

    ``(generation, commit, uid, step)``: the uid starts with the commit time, so
    checkpoints without a (readable) session record sort by commit time."""
    try:
        record = SessionRecord.of(manifest)
    except RecordError:
        record = None
    if record is None:
        return 0, 0, manifest.uid, manifest.step
    return record.generation, record.commit, manifest.uid, manifest.step


def newest_first(manifests: Iterable[M]) -> list[M]:
    """``manifests`` in the order restores try them: the preferred one first."""
    return sorted(manifests, key=restore_order, reverse=True)
