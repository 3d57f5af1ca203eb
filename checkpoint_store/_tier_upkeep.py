"""The upkeep of a tiered store: local and remote retention, pins, deletion and gc,
and the remote tier's interval (``checkpoint_every="auto"``: ``follow_tiers``).

A mixin of :class:`~checkpoint_store.tiered.TieredCheckpointStore` (which owns the
state declared below); kept apart so that the store itself is saving, listing and
loading.
"""

from __future__ import annotations

import builtins
import collections
import logging
import statistics
import threading
import time
from collections.abc import Iterable, Mapping

from checkpoint_store._remote_catalog import RemoteCatalog
from checkpoint_store.backends import Backend
from checkpoint_store.layout import parse_manifest_name
from checkpoint_store.manifest import Manifest
from checkpoint_store.retention import GcReport, apply_retention, choose_deletions
from checkpoint_store.store import CheckpointStore
from checkpoint_store.upload import Uploader
from trainguard.core.checkpoints import NoCheckpointError, PinnedCheckpointError
from trainguard.core.newest import newest_committed
from trainguard.core.resilience import CircuitBreaker, Retrier
from trainguard.core.tier_plan import TierInfo

__all__ = ["TierUpkeep"]

log = logging.getLogger("checkpoint_store.tiered")


class TierUpkeep:
    """Retention, pin/unpin/delete and gc over both tiers."""

    local: CheckpointStore
    remote: CheckpointStore
    remote_url: str
    keep_last: int
    keep_every: int | None
    remote_keep_last: int | None
    breaker: CircuitBreaker
    _read: Retrier
    _transient: tuple[type[BaseException], ...]
    _local_backend: Backend
    _remote_backend: Backend
    _retention_lock: threading.Lock
    _uploader: Uploader
    _remote: RemoteCatalog

    # Defined by the store.
    def _catalog(self, *, fresh: bool = False) -> tuple[dict[str, Manifest],
                                                      dict[str, Manifest]]:
        raise NotImplementedError

    def _no_such_step(self, step: int) -> NoCheckpointError:
        raise NotImplementedError

    def _newest_anywhere(self, step: int, local: Iterable[str], remote: Iterable[str]) -> str:
        raise NotImplementedError

    # ---------------------------------------------------------- auto intervals
    def _auto_init(self) -> None:
        self.upload_every = 1
        """Every ``upload_every``-th local save is uploaded (0: none); set by
        ``follow_tiers``. A skipped one lives on local disk only, under retention."""
        self.restored_from: str | None = None
        """The tier the last load served from: ``disk`` or ``remote``."""
        self._commits_seen = 0
        self._skipped: set[str] = set()
        self._upload_started: dict[str, float] = {}
        self._upload_s: collections.deque[float] = collections.deque(maxlen=8)

    def checkpoint_tiers(self) -> builtins.list[TierInfo]:
        """Local disk (survives a crash; a reboot keeps it) and remote (the job lost),
        with the measured seconds from a local commit to its remote commit (median of
        the last 8): what ``checkpoint_every="auto"`` plans from."""
        seen = list(self._upload_s)
        return [TierInfo("disk", "crash"),
                TierInfo("remote", "job", statistics.median(seen) if seen else None)]

    def follow_tiers(self, every: Mapping[str, int]) -> None:
        """From the next save on, every ``every["remote"]``-th one is uploaded."""
        n = every.get("remote", self.upload_every)
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"every['remote'] must be an int >= 0, got {n!r}")
        self.upload_every = n

    def _queue_upload(self, name: str, every: int) -> None:
        self._commits_seen += 1
        if not every or self._commits_seen % every:
            self._skipped.add(name)  # not due: retention may drop it like any local copy
            return
        self._upload_started[name] = time.monotonic()
        self._uploader.enqueue(name)

    def _upload_done(self, name: str) -> None:
        started = self._upload_started.pop(name, None)
        if started is not None:
            self._upload_s.append(time.monotonic() - started)

    # ---------------------------------------------------------------- retention
    def _retain_local(self) -> builtins.list[str]:
        """Delete local checkpoints beyond retention that are safe to lose: remote
        copy committed, and not the newest remote-committed checkpoint; or found
        damaged by the uploader (never uploaded, so nothing else would drop them)."""
        with self._retention_lock:
            manifests = self.local.list()
            remote = self._uploader.remote_committed()
            damaged = self._uploader.damaged()
            parsed = [p for p in map(parse_manifest_name, remote) if p]
            newest = newest_committed(parsed)
            newest_remote = newest.name if newest else None
            doomed = [m for m in choose_deletions(manifests, keep_last=self.keep_last,
                                                  keep_every=self.keep_every)
                      if (m.name in remote and m.name != newest_remote) or m.name in damaged
                      or m.name in self._skipped]
            deleted = apply_retention(self._local_backend, doomed)
            self._skipped.difference_update(m.name for m in doomed)  # bounded: kept ones only
            return deleted

    def _free_local(self) -> builtins.list[str]:
        """The local disk is full: delete every local copy whose remote copy is
        committed, pinned ones excepted. ``keep_last`` and "keep the newest
        remote-committed one" give way to a full disk; a copy not yet uploaded never
        does (it exists nowhere else)."""
        with self._retention_lock:
            remote = self._uploader.remote_committed()
            doomed = [m for m in self.local.list() if m.name in remote and not m.pinned]
            if doomed:
                log.warning("local tier %s is full: dropping %d local copies already safe "
                            "in %s (%s)", self.local.url, len(doomed), self.remote_url,
                            ", ".join(m.name for m in doomed))
            return apply_retention(self._local_backend, doomed)

    def _retain_remote(self) -> None:
        assert self.remote_keep_last is not None
        remote = sorted(self._remote.list(wait=True).values(),
                        key=lambda m: parse_manifest_name(m.name) or m.name)
        doomed = choose_deletions(remote, keep_last=self.remote_keep_last,
                                  keep_every=self.keep_every)
        if doomed:
            self._read.call(apply_retention, self._remote_backend, doomed)
            self._remote.forget(m.name for m in doomed)

    # ---------------------------------------------------------------- pins, deletion, gc
    def pin(self, step: int) -> Manifest:
        """Pin the newest checkpoint of ``step`` in every tier that has it (an upload
        later copies the pin)."""
        local, remote = self._catalog()
        name = self._newest_anywhere(step, local, remote)
        result: Manifest | None = None
        if name in local:
            result = self.local.pin(step)
        if name in remote:
            pinned = self._read.call(self.remote.pin, step)
            self._remote.set_pinned([remote[name]], True)
            result = result or pinned
        assert result is not None
        return result

    def unpin(self, step: int) -> None:
        local, remote = self._catalog()
        if not any(m.step == step for m in [*local.values(), *remote.values()]):
            raise self._no_such_step(step)
        if any(m.step == step for m in local.values()):
            self.local.unpin(step)
        if any(m.step == step for m in remote.values()):
            self._read.call(self.remote.unpin, step)
            self._remote.set_pinned([m for m in remote.values() if m.step == step], False)

    def delete(self, step: int) -> builtins.list[str]:
        """Delete every checkpoint of ``step`` from both tiers."""
        local, remote = self._catalog(fresh=True)
        found = [m for m in [*local.values(), *remote.values()] if m.step == step]
        if not found:
            raise self._no_such_step(step)
        pinned = sorted({m.name for m in found if m.pinned})
        if pinned:
            raise PinnedCheckpointError(f"checkpoints {pinned} are pinned; unpin step {step} "
                                        "before deleting it")
        for m in found:
            self._uploader.forget(m.name)
        deleted: set[str] = set()
        if any(m.step == step for m in local.values()):
            deleted.update(self.local.delete(step))
        if any(m.step == step for m in remote.values()):
            deleted.update(self._read.call(self.remote.delete, step))
        self._remote.forget(deleted)
        return sorted(deleted)

    def gc(self) -> GcReport:
        """Local debris and retention; then the remote root's debris (one try: a
        remote outage skips it). Remote paths are reported with the remote URL."""
        report = self.local.gc()
        report.deleted_checkpoints.extend(self._retain_local())
        try:
            remote = self.breaker.call(self.remote.gc)
        except self._transient as e:
            log.warning("remote gc of %s skipped: %s", self.remote_url, e)
            return report
        prefix = self.remote_url.rstrip("/") + "/"
        report.removed_data.extend(prefix + p for p in remote.removed_data)
        report.removed_files.extend(prefix + p for p in remote.removed_files)
        report.deleted_checkpoints.extend(prefix + p for p in remote.deleted_checkpoints)
        report.in_flight.extend(prefix + p for p in remote.in_flight)
        return report
