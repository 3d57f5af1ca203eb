"""``TieredCheckpointStore``: the last K checkpoints on local disk, every checkpoint
uploaded to a remote root in the background.

```python
store = TieredCheckpointStore("/nvme/ckpt/run42", "s3://bucket/run42", keep_last=3)
store.save(state, step=100, blocking=False).wait()   # committed locally
store.tier_status(100).state                         # local -> uploading -> remote
store.load(state)                 # local copy, or the remote one if local is gone/damaged
store.close(wait_upload=60.0)     # optionally drain the upload queue
```

Same public API as :class:`~checkpoint_store.CheckpointStore` (both implement
:class:`~trainguard.core.checkpoints.CheckpointStoreAPI`), so a ``TrainingSession`` takes it
as ``store=``. Both roots have the FORMAT.md layout and a
checkpoint has the same manifest name in both; see ``upload.py`` for the upload order
(data, then the manifest with an exclusive create, then LATEST).

Rules:

- ``save`` never waits for the remote tier; its handle completes when the checkpoint
  is committed locally. Remote trouble opens ``remote_breaker`` and the uploader
  backs off; the queue is kept and resumes when the remote answers again. A
  checkpoint the remote refuses (an answer such as "permission denied", not an
  outage) goes to the back of the queue, so it does not hold back the newer ones.
- Local retention keeps the newest ``keep_last``, every ``keep_every``-th step and the
  pinned ones, and on top of that never deletes a checkpoint whose remote copy is not
  committed (unless the uploader found it damaged: it will never be uploaded), nor
  the newest remote-committed one. Remote retention (``remote_keep_last``, default:
  keep all) runs after each upload.
- A full local disk (ENOSPC) stops no save: the store drops the local copies already
  committed remotely (pinned ones excepted) and saves again; if the disk is still
  full, that save goes to the remote tier only (committed there by its manifest and
  LATEST, offsets inside, as any save; logged, counted in ``remote_only_saves``), and
  so do the next ones until dropping copies frees room again. A failed local save
  publishes nothing, so no checkpoint is ever half in one tier.
- ``load`` prefers the local copy and falls back (logged) to the remote copy when the
  local one is missing or fails verification, then to older checkpoints.
- On start the uploader lists both roots and uploads every local checkpoint the
  remote lacks: an upload cut short by a crash is redone.
- ``list`` is the union of both tiers. The remote side is listed once (in the
  background after the uploader's start-up scan, or by the first ``list``, which
  waits for the remote when local disk holds no checkpoint: a restart with a wiped
  disk must not mistake an unreachable remote for "no checkpoint"); from then on it
  is a cache that uploads keep current, so ``list``, ``load`` and the trainer's
  per-commit calls never wait on the remote. ``refresh()`` lists it again.

Single process only (world size 1): the remote tier is written by one uploader.
"""

from __future__ import annotations

import builtins
import errno
import functools
import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from checkpoint_store._remote_catalog import RemoteCatalog
from checkpoint_store._tier_load import Tiers, load_from_tiers, newest_of
from checkpoint_store._tier_upkeep import TierUpkeep
from checkpoint_store._wrapped import RankStateWrappedStore
from checkpoint_store.backends import LocalBackend, open_backend
from checkpoint_store.handle import SaveHandle
from checkpoint_store.layout import manifest_path, parse_manifest_name
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.store import DEFAULT_CHUNK_BYTES, CheckpointStore
from checkpoint_store.tiers import TierStatus, tier_statuses
from checkpoint_store.upload import Uploader, remote_backoff
from trainguard.core.checkpoints import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    ManifestView,
    NoCheckpointError,
)
from trainguard.core.newest import newest_committed, newest_save_of
from trainguard.core.resilience import (
    OBJECT_STORE_NOT_TRANSIENT,
    OBJECT_STORE_POLICY,
    CircuitBreaker,
    CircuitOpenError,
    RetryPolicy,
    object_store_breaker,
    object_store_errors,
    object_store_retrier,
)

__all__ = ["TieredCheckpointStore"]

log = logging.getLogger("checkpoint_store.tiered")

_NO_LIMIT = sys.maxsize


class TieredCheckpointStore(TierUpkeep, RankStateWrappedStore):
    """A local :class:`CheckpointStore` plus a remote copy of every checkpoint.

    ``local_url`` must be a local directory (plain path or ``file://``);
    ``remote_url`` any fsspec URL (``storage_options`` are the remote's).
    ``remote_breaker`` (default: a fresh ``object_store_breaker``) guards every remote
    call; ``upload_policy`` bounds each upload operation's retries (default: 60 s;
    when it runs out the uploader backs off and tries the checkpoint again, so it only
    bounds how long ``close`` may wait for the thread to notice a stop) and
    ``remote_read_policy`` each remote read made by ``load``/``list``/``pin``/...
    (default: ``OBJECT_STORE_POLICY``, waiting out an outage of up to 15 minutes).
    ``upload_backoff`` spaces the uploader's attempts after a failed one (its waits
    only: the uploader never gives up; default ``upload.UPLOAD_BACKOFF``, 0.2 s
    doubling to 10 s; ``upload_backoff_s``, the former ``(first, max)`` tuple, is
    deprecated);
    ``io_threads`` also sets how many files an upload sends at once.
    """

    def __init__(
        self,
        local_url: str | os.PathLike[str],
        remote_url: str,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        remote_keep_last: int | None = None,
        storage_options: dict[str, Any] | None = None,
        remote_breaker: CircuitBreaker | None = None,
        upload_policy: RetryPolicy | None = None,
        remote_read_policy: RetryPolicy | None = None,
        upload_backoff: RetryPolicy | None = None,
        upload_backoff_s: tuple[float, float] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int = 4,
        stale_after_s: float = 24 * 3600.0,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if remote_keep_last is not None and remote_keep_last < keep_last:
            raise ValueError(
                f"remote_keep_last ({remote_keep_last}) must be >= keep_last ({keep_last}) "
                "or None: the remote tier keeps at least what local disk keeps"
            )
        # Checked before anything is opened: a bad argument leaves nothing behind.
        backoff = remote_backoff(upload_backoff, upload_backoff_s, name="upload_backoff",
                                 legacy_name="upload_backoff_s")
        local_backend = open_backend(os.fspath(local_url))
        if not isinstance(local_backend, LocalBackend):
            raise ValueError(f"local_url must be a local directory, got {local_url!r}")
        # The local store keeps everything itself; this class decides what goes.
        self.local = CheckpointStore(
            local_url, keep_last=_NO_LIMIT, keep_every=keep_every, chunk_bytes=chunk_bytes,
            io_threads=io_threads, stale_after_s=stale_after_s,
        )
        self.store = self.local  # what WrappedStore.save writes through
        if self.local.world_size > 1:
            self.local.close()
            raise ValueError(
                "TieredCheckpointStore supports one process (world size 1); with "
                "torch.distributed use a CheckpointStore per tier"
            )
        self.remote = CheckpointStore(
            remote_url, keep_last=remote_keep_last or _NO_LIMIT, keep_every=keep_every,
            storage_options=storage_options, chunk_bytes=chunk_bytes, io_threads=io_threads,
            stale_after_s=stale_after_s,
        )
        self.url = self.local.url
        self.remote_url = remote_url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.remote_keep_last = remote_keep_last
        self.breaker = remote_breaker or object_store_breaker(f"ckpt-remote:{remote_url}")
        self._read = object_store_retrier(self.breaker, remote_read_policy or OBJECT_STORE_POLICY)
        self._transient: tuple[type[BaseException], ...] = (CircuitOpenError,
                                                             *object_store_errors())
        self._local_backend = local_backend
        self._remote_backend = open_backend(remote_url, storage_options)
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._last_handle: SaveHandle | None = None
        self._closed = False
        self._local_full = False  # the last local save found the disk full
        self.remote_only_saves = 0
        self._auto_init()
        """Saves that went to the remote tier only, the local disk being full."""
        self._uploader = Uploader(
            local_backend, self._remote_backend,
            object_store_retrier(self.breaker, upload_policy or RetryPolicy(
                attempts=None, timeout_s=60.0, wait_max_s=10.0)).call,
            on_committed=self._on_remote_commit, on_scanned=self._on_scanned,
            backoff=backoff, threads=io_threads,
            outage=self._transient, answers=OBJECT_STORE_NOT_TRANSIENT,
        )
        self._remote = RemoteCatalog(
            self._remote_backend, remote_url, read=self._read.call, try_once=self.breaker.call,
            transient=self._transient, on_listed=self._uploader.mark_remote,
        )
        self._uploader.start()

    # ---------------------------------------------------------------- save
    def _before_save(self, state: Mapping[str, Any]) -> None:
        """The save itself is the local tier's; the handle completes when the
        checkpoint is committed locally. Its upload is queued then; it never delays
        the save."""
        if self._closed:
            raise CheckpointError("the store is closed")

    def _after_save(self, handle: SaveHandle) -> None:
        with self._lock:
            self._last_handle = handle
        handle.add_done_callback(functools.partial(self._on_local_commit, every=self.upload_every))

    def _hooked_save(self, state: Mapping[str, Any], **options: Any) -> SaveHandle:
        """The local save; on a full local disk, room made and a second try, then the
        remote tier only (see the module docstring)."""
        self._before_save(state)
        if self._local_full and not self._free_local():
            return self._save_remote_only(state, options)
        try:
            handle = self.store.save(state, **options)
        except CheckpointWriteError as e:
            if e.errno != errno.ENOSPC:
                raise
            return self._save_when_full(state, options, e)
        self._local_full = False
        self._after_save(handle)
        return handle

    def _save_when_full(self, state: Mapping[str, Any], options: dict[str, Any],
                        error: CheckpointWriteError) -> SaveHandle:
        log.warning("local tier %s is full (%s)", self.url, error)
        if self._free_local():
            try:
                handle = self.store.save(state, **options)
            except CheckpointWriteError as e:
                if e.errno != errno.ENOSPC:
                    raise
            else:
                self._after_save(handle)
                return handle
        self._local_full = True
        return self._save_remote_only(state, options)

    def _save_remote_only(self, state: Mapping[str, Any],
                          options: dict[str, Any]) -> SaveHandle:
        log.warning("local tier %s is full: the checkpoint of step %s goes to %s only",
                    self.url, options.get("step"), self.remote_url)
        self.remote_only_saves += 1
        handle: SaveHandle = self._read.call(self.remote.save, state, **options)
        with self._lock:
            self._last_handle = handle
        handle.add_done_callback(self._on_remote_only_commit)
        return handle

    def _on_remote_only_commit(self, handle: SaveHandle) -> None:
        if handle.manifest is None:
            return
        self._remote.remember(handle.manifest, replace=False)
        self._uploader.mark_remote({handle.manifest.name})

    def _on_local_commit(self, handle: SaveHandle, every: int = 1) -> None:
        if isinstance(handle.error, CheckpointWriteError) and handle.error.errno == errno.ENOSPC:
            self._local_full = True  # a background save found the disk full
        if handle.error is not None or handle.manifest is None:
            return
        self._queue_upload(handle.manifest.name, every)
        self._retain_local()

    def _on_remote_commit(self, name: str) -> None:
        self._upload_done(name)
        if self._closed:
            return
        try:
            # The remote manifest is a byte copy of the local one: remember it, so
            # that list() knows it without asking the remote (and after local eviction).
            m = parse_manifest(name, self._local_backend.read(manifest_path(name)))
        except (FileNotFoundError, CorruptCheckpointError):
            pass
        else:
            self._remote.remember(m, replace=False)
        if self.remote_keep_last is not None:
            try:
                self._retain_remote()
            except Exception:
                log.exception("remote retention in %s failed", self.remote_url)
        self._retain_local()

    def _on_scanned(self) -> None:
        # The remote answered the uploader: learn its manifests now, in this
        # background thread, so that list() need not ask it later.
        if not self._remote.listed:
            self._remote.list(wait=False)

    def _wait_local(self) -> None:
        with self._lock:
            handle = self._last_handle
        if handle is not None and not handle.done():
            done = threading.Event()
            handle.add_done_callback(lambda _h: done.set())
            done.wait()

    # ---------------------------------------------------------------- catalog
    def _catalog(self, *, fresh: bool = False) -> tuple[dict[str, Manifest],
                                                      dict[str, Manifest]]:
        """(local, remote) manifests by name. The remote side comes from the cache
        once a listing succeeded, unless ``fresh`` (list it now, waiting out an
        outage). Before any listing: with no local checkpoint, wait for one (an
        empty disk must not pass for a fresh start); else try once."""
        local = {m.name: m for m in self.local.list()}
        if fresh:
            return local, self._remote.list(wait=True)
        if self._remote.listed:
            return local, self._remote.known()
        return local, self._remote.list(wait=not local)

    @staticmethod
    def _merged(local: dict[str, Manifest],
                remote: dict[str, Manifest]) -> builtins.list[Manifest]:
        both = {**remote, **local}
        return [both[n] for n in sorted(both, key=lambda n: parse_manifest_name(n) or n)]

    def list(self) -> builtins.list[Manifest]:
        """Committed manifests of both tiers, oldest first (the local copy's record
        where both have one). No remote I/O once the remote has been listed: what
        this store uploads is added as it goes; :meth:`refresh` lists it again."""
        return self._merged(*self._catalog())

    def refresh(self) -> None:
        """List the remote root again (waits out an outage), e.g. after another tool
        changed it."""
        self._remote.list(wait=True)

    def latest(self) -> Manifest | None:
        """The last committed checkpoint of either tier (commit order, as LATEST)."""
        return newest_committed(self.list())

    def tiers(self) -> builtins.list[TierStatus]:
        """Where each checkpoint is, oldest first. No remote I/O: the remote side is
        what the uploader and the last listing saw."""
        return tier_statuses(self.local.list(), self._remote.known().values(),
                             remote_committed=self._uploader.remote_committed(),
                             uploading=self._uploader.uploading())

    def tier_status(self, step: int) -> TierStatus:
        """Where the newest checkpoint of ``step`` is."""
        found = newest_save_of(step, self.tiers())
        if found is None:
            raise self._no_such_step(step)
        return found

    def wait_uploads(self, timeout_s: float | None = None) -> bool:
        """Wait until every local checkpoint known so far is remote-committed (or
        found damaged); False on timeout."""
        return self._uploader.wait_idle(timeout_s)

    @property
    def upload_failures(self) -> int:
        """Failed upload attempts so far (each was retried)."""
        return self._uploader.failures

    # ---------------------------------------------------------------- load / verify
    def _tiers(self) -> Tiers:
        return Tiers(self.local, self.remote, self._read.call, self._transient,
                     self._retention_lock, self.url, self.remote_url)

    def _no_such_step(self, step: int) -> NoCheckpointError:
        return self._tiers().no_such_step(step)

    def _newest_anywhere(self, step: int, local: Iterable[str], remote: Iterable[str]) -> str:
        name = newest_of(step, [*local, *remote])
        if name is None:
            raise self._no_such_step(step)
        return name

    def load(
        self,
        state: Mapping[str, Any],
        *,
        step: int | None = None,
        keys: Iterable[str] | None = None,
        strict: bool = False,
    ) -> Manifest | None:
        """Load the checkpoint a restart resumes from (or ``step``'s newest; the order
        is :func:`trainguard.core.newest.restore_order`) into ``state`` in place: the
        local copy if it verifies, else the remote copy; if neither loads, the previous
        checkpoint (``strict=True`` raises CorruptCheckpointError instead)."""
        self._wait_local()
        local, remote = self._catalog()
        loaded = load_from_tiers(tiers := self._tiers(), local, remote, state, step=step,
                                 keys=None if keys is None else list(keys), strict=strict)
        self.restored_from = tiers.served[-1] if tiers.served else None
        return loaded

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        """As :meth:`CheckpointStore.read_rank_state`: from the local copy if it holds
        the checkpoint and the object verifies, else from the remote copy."""
        local, remote = self._catalog()
        name = manifest.name
        if name in local:
            try:
                return self.local.read_rank_state(local[name], rank)
            except CorruptCheckpointError as e:
                if name not in remote:
                    raise
                log.warning("local copy of %s is damaged (%s); reading rank %s's state from "
                            "the remote copy", name, e, rank)
        if name not in remote:
            raise NoCheckpointError(f"checkpoint {name} is in neither tier of {self.url}")
        return self._read.call(self.remote.read_rank_state, remote[name], rank)

    def verify(self, step: int) -> Manifest:
        """Verify the newest checkpoint of ``step``: the local copy if there is one
        (falling back to the remote copy if it is damaged), else the remote copy."""
        local, remote = self._catalog()
        name = self._newest_anywhere(step, local, remote)
        if name in local and newest_of(step, local) == name:
            try:
                return self.local.verify(step)
            except CorruptCheckpointError as e:
                if name not in remote:
                    raise
                log.warning("local copy of %s is damaged (%s); verifying the remote copy",
                            name, e)
        return self._read.call(self.remote.verify, step)

    # ---------------------------------------------------------------- lifecycle
    def close(self, wait_upload: bool | float = False) -> bool:
        """Wait for the local save in flight; with ``wait_upload`` (True, or a timeout
        in seconds) also for the upload queue. Returns False if uploads were left
        pending (the next store on these roots uploads them)."""
        if self._closed:
            return True
        try:
            # Raises a local save's unreported background failure: the uploader and
            # the remote store must still be stopped when it does.
            self._wait_local()
            self.local.close()
            drained = self._uploader.idle()
            if wait_upload is not False:
                timeout = None if wait_upload is True else float(wait_upload)
                drained = self._uploader.wait_idle(timeout)
                if not drained:
                    log.warning("closing with uploads pending to %s; the next start resumes them",
                                self.remote_url)
        finally:
            self._closed = True
            self._uploader.stop(join_timeout_s=5.0)
            self.remote.close()
        return drained

    def __repr__(self) -> str:
        return f"TieredCheckpointStore({self.url!r}, {self.remote_url!r})"
