"""Where each checkpoint of a tiered store is: local, uploading, remote."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from checkpoint_store.layout import parse_manifest_name
from checkpoint_store.manifest import Manifest
from trainguard.core.checkpoints import CheckpointStatus

__all__ = ["TierState", "TierStatus", "tier_statuses"]


class TierState(enum.StrEnum):
    LOCAL = "local"  # committed locally, remote copy not committed (queued)
    UPLOADING = "uploading"  # being copied now
    REMOTE = "remote"  # remote manifest exists (local copy may or may not)


@dataclass(frozen=True)
class TierStatus:
    """One checkpoint's place: ``local`` (a local manifest exists), ``remote`` (the
    remote manifest exists: committed there) and the resulting ``state``."""

    name: str
    step: int
    uid: str
    state: TierState
    local: bool
    remote: bool
    pinned: bool

    def labels(self) -> list[CheckpointStatus]:
        """The admin API's status words: committed, pinned, remote | local_only."""
        out: list[CheckpointStatus] = ["committed"]
        if self.pinned:
            out.append("pinned")
        out.append("remote" if self.remote else "local_only")
        return out


def tier_statuses(
    local: Iterable[Manifest],
    remote: Iterable[Manifest],
    *,
    remote_committed: Iterable[str] = (),
    uploading: str | None = None,
) -> list[TierStatus]:
    """Where each checkpoint is, oldest first, from the manifests of a local and a
    remote root (e.g. two ``CheckpointStore.list()`` results; a checkpoint has the
    same manifest name in both). ``remote_committed`` adds names known to be remote
    without a listing, ``uploading`` names the one being copied now."""
    local_by = {m.name: m for m in local}
    remote_by = {m.name: m for m in remote}
    committed = set(remote_committed) | set(remote_by)
    out = []
    for name in sorted({*local_by, *remote_by}, key=lambda n: parse_manifest_name(n) or n):
        m = local_by.get(name) or remote_by[name]
        in_remote = name in committed
        state = (TierState.REMOTE if in_remote else
                 TierState.UPLOADING if name == uploading else TierState.LOCAL)
        pinned = any(x.pinned for x in (local_by.get(name), remote_by.get(name)) if x)
        out.append(TierStatus(name, m.step, m.uid, state, name in local_by, in_remote, pinned))
    return out
