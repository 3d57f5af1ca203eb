"""Background upload of locally committed checkpoints to a remote checkpoint root.

The remote root has the same layout as a local one (FORMAT.md); a checkpoint keeps
its manifest name, so ``<step>-<uid>.json`` names the same save in both tiers.
Uploading one checkpoint is idempotent and resumable, in this order:

1. the remote manifest exists: the checkpoint is remote-committed, nothing to do;
2. the local copy is verified (``reader.verify_data``: every chunk's CRC, the
   skeleton, tensor bounds), so a damaged local copy is never published remotely;
3. an in-flight marker is written remotely (so a remote ``gc`` leaves the upload be);
4. every data file is copied with one PUT each; a file already there with the same
   size is skipped (a PUT is atomic: the object exists complete or not at all);
5. the manifest is written with an exclusive create (``If-None-Match: *``): the
   remote commit point; "exists" means an earlier attempt committed it;
6. the remote LATEST is pointed at the newest remote manifest, the pin marker is
   copied, the in-flight marker removed.

A crash anywhere leaves the local checkpoint committed and the remote one absent (or
committed); the next :class:`Uploader` scans for local checkpoints that are not
remote-committed and uploads them again. Every remote call goes through a
``Retrier`` (breaker + backoff); when its policy runs out the checkpoint stays
queued and the uploader backs off and tries again, for as long as it runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from checkpoint_store import _faults
from checkpoint_store.backends import Backend, FsspecBackend, LocalBackend
from checkpoint_store.layout import (
    INFLIGHT_DIR,
    LATEST,
    MANIFEST_DIR,
    PINS_DIR,
    TMP_PREFIX,
    ManifestName,
    data_dir,
    inflight_marker,
    manifest_path,
    parse_manifest_name,
)
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.rank_content import with_content
from checkpoint_store.reader import verify_data
from checkpoint_store.saving import latest_pointer
from trainguard.core.backoff import Backoff, RetryPolicy
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["UPLOAD_BACKOFF", "UPLOAD_PHASES", "Uploader", "local_files", "remote_backoff",
           "remote_sizes"]

log = logging.getLogger("checkpoint_store.tiered")

UPLOAD_PHASES = ("upload-before-data", "upload-mid-data", "upload-before-manifest",
                 "upload-after-manifest")
"""Fault-injection phases of an upload (``TRAINGUARD_CKPT_CRASH_AT`` etc., see _faults)."""


class _Gone(Exception):
    """The local checkpoint was deleted while it waited or uploaded."""


def local_files(backend: LocalBackend, directory: str) -> list[tuple[str, int]]:
    """``(path relative to the root, size)`` of every file under ``directory``,
    temp files excluded, sorted."""
    out = []
    top = os.path.join(backend.root, *directory.split("/"))
    for dirpath, _dirs, files in os.walk(top):
        rel = os.path.relpath(dirpath, backend.root).replace(os.sep, "/")
        for f in files:
            if not f.startswith(TMP_PREFIX):
                out.append((f"{rel}/{f}", os.path.getsize(os.path.join(dirpath, f))))
    return sorted(out)


def remote_sizes(backend: Backend, directory: str) -> dict[str, int]:
    """Sizes of the files under ``directory`` of a remote root, by relative path."""
    if isinstance(backend, LocalBackend):
        return dict(local_files(backend, directory))
    if not isinstance(backend, FsspecBackend):
        raise TypeError(f"cannot list files of backend {type(backend).__name__}")
    top = f"{backend.root}/{directory}"
    try:
        found = backend.fs.find(top, detail=True)
    except FileNotFoundError:
        return {}
    prefix = backend.root + "/"
    return {path[len(prefix):]: int(info.get("size") or 0) for path, info in found.items()
            if path.startswith(prefix)}


UPLOAD_BACKOFF = RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.2,
                             wait_max_s=10.0, wait_jitter_s=0.0)
"""The uploader's wait after a failed attempt: 0.2 s doubling to 10 s, without jitter
(one uploader per store, nobody to spread out); it never gives up."""


def remote_backoff(policy: RetryPolicy | None, legacy_s: tuple[float, float] | None, *,
                   name: str, legacy_name: str) -> RetryPolicy:
    """The uploader's backoff policy of the arguments ``name`` (a :class:`RetryPolicy`)
    and ``legacy_name`` (the former ``(first, max)`` tuple, doubling without jitter,
    accepted for one release with a DeprecationWarning). Neither: ``UPLOAD_BACKOFF``."""
    if legacy_s is None:
        return UPLOAD_BACKOFF if policy is None else policy
    if policy is not None:
        raise ValueError(f"{name} and {legacy_name} were both given: pass {name} only "
                         f"({legacy_name} is its deprecated former shape)")
    if (not isinstance(legacy_s, tuple | list) or len(legacy_s) != 2
            or not all(isinstance(v, int | float) and v > 0 for v in legacy_s)):
        raise ValueError(f"{legacy_name} must be (first, max) wait in seconds, both > 0, got "
                         f"{legacy_s!r}: pass {name}=RetryPolicy(...) instead")
    first, most = float(legacy_s[0]), float(legacy_s[1])
    # stacklevel 3: the warning names the caller of the constructor that took the tuple.
    warnings.warn(f"{legacy_name}=(first, max) is deprecated and goes in the next release: "
                  f"pass {name}=RetryPolicy(attempts=None, timeout_s=None, "
                  f"wait_initial_s={first}, wait_max_s={most}, wait_jitter_s=0.0)",
                  DeprecationWarning, stacklevel=3)
    return RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=first, wait_max_s=most,
                       wait_jitter_s=0.0)


class Uploader:
    """One background thread that uploads queued checkpoints oldest first.

    ``call(fn, *args)`` runs one remote operation (retries, breaker); ``on_committed``
    is called with each remote-committed manifest name and ``on_scanned`` after the
    start-up scan (both from this thread; their errors are logged, not retried).
    ``backoff`` spaces the attempts after a failed upload (its waits, through
    :class:`~trainguard.core.backoff.Backoff`; its attempts and timeout do not apply:
    the uploader never gives up; default ``UPLOAD_BACKOFF``; ``backoff_s``, the former
    ``(first, max)`` tuple, is deprecated);
    ``threads`` data files are uploaded in parallel. A failure of type ``outage`` but
    not ``answers`` means the remote is unreachable: the queue keeps its order. Any
    other failure is the checkpoint's own (e.g. the remote refuses it) and sends it to
    the back of the queue.
    """

    def __init__(
        self,
        local: LocalBackend,
        remote: Backend,
        call: Callable[..., Any],
        *,
        on_committed: Callable[[str], None],
        on_scanned: Callable[[], None] = lambda: None,
        backoff: RetryPolicy | None = None,
        backoff_s: tuple[float, float] | None = None,
        threads: int = 4,
        outage: tuple[type[BaseException], ...] = (OSError,),
        answers: tuple[type[BaseException], ...] = (),
    ):
        self.local = local
        self.remote = remote
        self._call = call
        self._on_committed = on_committed
        self._on_scanned = on_scanned
        self.backoff = remote_backoff(backoff, backoff_s, name="backoff",
                                      legacy_name="backoff_s")
        self._threads = max(1, threads)
        self._outage = outage
        self._answers = answers
        self._cond = threading.Condition()
        self._pending: dict[str, None] = {}  # insertion-ordered set of manifest names
        self._remote: set[str] = set()
        self._damaged: set[str] = set()
        self._uploading: str | None = None
        self._scanned = False
        self._stop = False
        self.failures = 0
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="ckpt-upload", daemon=True)

    # ------------------------------------------------------------ state (any thread)
    def start(self) -> None:
        self._thread.start()

    def enqueue(self, name: str) -> None:
        with self._cond:
            if name not in self._remote:
                self._pending[name] = None
            self._cond.notify_all()

    def forget(self, name: str) -> None:
        """The checkpoint was deleted on purpose: stop tracking it."""
        with self._cond:
            self._pending.pop(name, None)
            self._remote.discard(name)

    def remote_committed(self) -> set[str]:
        with self._cond:
            return set(self._remote)

    def mark_remote(self, names: set[str]) -> None:
        """Names seen in a remote listing (by the facade) are remote-committed."""
        with self._cond:
            self._remote |= names
            for n in names:
                self._pending.pop(n, None)

    def uploading(self) -> str | None:
        with self._cond:
            return self._uploading

    def holds(self, name: str) -> bool:
        """Whether ``name`` is queued or being uploaded: its files are still to be read."""
        with self._cond:
            return name in self._pending or self._uploading == name

    def damaged(self) -> set[str]:
        with self._cond:
            return set(self._damaged)

    def idle(self) -> bool:
        with self._cond:
            return self._scanned and not self._pending and self._uploading is None

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until the start-up scan ran and the queue is empty; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not (self._scanned and not self._pending and self._uploading is None):
                if self._stop or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            return True

    def stop(self, join_timeout_s: float | None) -> bool:
        """Ask the thread to stop after its current remote call; True if it ended."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(join_timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the thread
    def _is_outage(self, e: BaseException) -> bool:
        return isinstance(e, self._outage) and not isinstance(e, self._answers)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            if not self._stop:
                self._cond.wait(seconds)

    def _loop(self) -> None:
        backoff = Backoff(self.backoff)
        while True:
            with self._cond:
                while self._scanned and not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                name = next(iter(self._pending), None) if self._scanned else None
                self._uploading = name
            try:
                if name is None:
                    self._scan()
                else:
                    self._upload(name)
                backoff.reset()
            except Exception as e:  # remote down or refusing: back off, keep the queue
                self.failures += 1
                self.last_error = e
                delay = backoff.next_wait_s()
                log.warning("upload to %s failed (%s: %s); retrying in %.1f s",
                            self.remote.url, type(e).__name__, e, delay)
                with self._cond:
                    self._uploading = None
                    if name is not None and name in self._pending and not self._is_outage(e):
                        # To the back of the queue: a checkpoint the remote keeps
                        # refusing must not hold back the newer ones behind it.
                        del self._pending[name]
                        self._pending[name] = None
                    self._cond.notify_all()
                self._sleep(delay)
                continue
            with self._cond:
                self._uploading = None
                self._cond.notify_all()

    def _scan(self) -> None:
        """Queue every local checkpoint whose remote manifest does not exist, oldest
        first (this is how an upload cut short by a crash is resumed)."""
        remote = set(self._call(self.remote.listdir, MANIFEST_DIR))
        local = sorted(p for p in map(parse_manifest_name, self.local.listdir(MANIFEST_DIR))
                       if p)
        names = [p for p in map(parse_manifest_name, remote) if p]
        if names:
            self._point_latest(max(names))
        committed_uids = {n.uid for n in names}
        for marker in self._call(self.remote.listdir, INFLIGHT_DIR):
            # A committed checkpoint's marker is left over from a crash after its
            # manifest: the upload is finished, the marker is debris.
            if marker.split(".", 1)[0] in committed_uids:
                self._call(self.remote.remove, f"{INFLIGHT_DIR}/{marker}")
        with self._cond:
            self._remote |= {n.name for n in names}
            queued = dict(self._pending)
            self._pending = {p.name: None for p in local if p.name not in self._remote}
            self._pending.update({n: None for n in queued if n not in self._remote})
            self._scanned = True
            self._cond.notify_all()
        if self._pending:
            log.info("%d local checkpoints are not yet in %s; uploading them",
                     len(self._pending), self.remote.url)
        self._notify(self._on_scanned)

    def _point_latest(self, newest: ManifestName) -> None:
        """Make the remote LATEST name ``newest`` unless it does already (a crash
        between an upload's manifest and its LATEST leaves it one behind)."""
        pointer = latest_pointer(newest.name, newest.step, newest.uid)
        try:
            current = self._call(self.remote.read, LATEST)
        except FileNotFoundError:
            current = b""
        if current != pointer:
            self._call(self.remote.replace, LATEST, pointer)

    def _read_local_manifest(self, name: str) -> tuple[bytes, Manifest]:
        try:
            raw = self.local.read(manifest_path(name))
        except FileNotFoundError as e:
            raise _Gone(name) from e
        return raw, with_content(self.local, parse_manifest(name, raw))

    def _upload(self, name: str) -> None:
        try:
            self._upload_once(name)
        except (_Gone, CorruptCheckpointError) as e:
            gone = isinstance(e, _Gone) or not os.path.exists(
                os.path.join(self.local.root, MANIFEST_DIR, name))
            with self._cond:
                self._pending.pop(name, None)
                if not gone:
                    self._damaged.add(name)
            self._drop_marker(name)
            if gone:
                log.info("checkpoint %s was deleted locally before its upload", name)
            else:
                log.error("local checkpoint %s is damaged (%s); it is not uploaded and stays "
                          "on local disk for inspection until local retention drops it",
                          name, e)

    def _drop_marker(self, name: str) -> None:
        """Remove the remote in-flight marker an earlier attempt may have left for a
        checkpoint that will not be uploaded: without it, a remote ``gc`` removes the
        partial upload as debris instead of keeping it as in flight."""
        parsed = parse_manifest_name(name)
        if parsed is None:
            return
        try:
            self._call(self.remote.remove, inflight_marker(parsed.uid, 0))
        except Exception as e:  # best effort: the next process's gc sees a dead writer
            log.warning("could not remove the in-flight marker of %s from %s (%s: %s)",
                        name, self.remote.url, type(e).__name__, e)

    def _upload_once(self, name: str) -> None:
        mpath = manifest_path(name)
        if self._call(self.remote.mtime, mpath) is not None:
            self._committed(name, fresh=False)
            return
        raw, manifest = self._read_local_manifest(name)
        verify_data(self.local, manifest, io_threads=1)
        marker = inflight_marker(manifest.uid, 0)
        self._call(self.remote.replace, marker, json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
            "rank": 0, "upload_of": name,
        }).encode())
        _faults.reached("upload-before-data")
        have = self._call(remote_sizes, self.remote, data_dir(manifest.uid))
        todo = [(path, size) for path, size in local_files(self.local, data_dir(manifest.uid))
                if have.get(path) != size]
        if todo:
            # The first file alone, so that "upload-mid-data" sees exactly one file
            # uploaded; the rest in parallel (object-store PUTs are latency-bound).
            self._put(name, todo[0][0], stale=todo[0][0] in have)
            _faults.reached("upload-mid-data")
        if len(todo) > 1:
            with ThreadPoolExecutor(self._threads, thread_name_prefix="ckpt-upload-io") as pool:
                for _ in pool.map(lambda t: self._put(name, t[0], stale=t[0] in have),
                                  todo[1:]):
                    pass
        _faults.reached("upload-before-manifest")
        try:
            self._call(self.remote.exclusive_create, mpath, raw)
        except FileExistsError:
            log.info("remote manifest %s already exists (an earlier attempt committed it)",
                     name)
        _faults.reached("upload-after-manifest")
        self._call(self.remote.remove, marker)
        self._committed(name, fresh=True)

    def _put(self, name: str, path: str, *, stale: bool) -> None:
        try:
            data = self.local.read(path)
        except FileNotFoundError as e:
            raise _Gone(name) from e
        if stale:
            self._call(self.remote.remove, path)  # an object of another size: replace it
        self._call(self.remote.write_file, path, [data])

    def _committed(self, name: str, *, fresh: bool) -> None:
        names = [p for p in map(parse_manifest_name,
                                self._call(self.remote.listdir, MANIFEST_DIR)) if p]
        if names:
            self._point_latest(max(names))
        if os.path.exists(os.path.join(self.local.root, PINS_DIR, name)):
            self._call(self.remote.replace, f"{PINS_DIR}/{name}", b"")
        with self._cond:
            self._remote.add(name)
            self._remote |= {n.name for n in names}
            self._pending.pop(name, None)
        if fresh:
            log.info("checkpoint %s is committed in %s", name, self.remote.url)
        self._notify(self._on_committed, name)

    def _notify(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("a callback of the uploader to %s failed", self.remote.url)

