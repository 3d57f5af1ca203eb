"""Checkpoint operations of the admin API and CLI over configured store roots.

A *store root* is a name (used in URLs and on the command line) for a checkpoint
store URL, optionally with a remote tier: ``name=file:///ckpt/run`` or
``name=file:///ckpt/run|s3://bucket/run``. With a remote tier, a checkpoint's status
says whether its manifest is committed remotely too (``remote``) or only locally
(``local_only``). Every :class:`~checkpoint_store.CheckpointStore` call is blocking
file or object-store I/O, so the async side runs it in a thread, one call at a time
per root.

With a remote tier, pin and unpin act on every tier that has the checkpoint (as
``TieredCheckpointStore.pin`` does: the remote tier's retention honours only its own
pins), while delete frees local disk only: the remote copy is the archive, and
``trainguard ckpt`` on the remote URL removes it. The tiers are opened as plain
stores with no retention limit, never as a ``TieredCheckpointStore`` (that would
start a second uploader), so nothing here can apply a retention to either root.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ingest_service.errors import AdminError, BadRequest, NotFound, Refused
from trainguard.core import record
from trainguard.core.checkpoints import (
    CorruptCheckpointError,
    NoCheckpointError,
    PinnedCheckpointError,
)
from trainguard.core.record import SessionRecord
from trainguard.core.urls import redact_text, redact_url

__all__ = ["StoreRoot", "StoreSet", "manifest_json", "newest_valid", "parse_store_roots"]

T = TypeVar("T")


@dataclass(frozen=True)
class StoreRoot:
    name: str
    url: str
    remote_url: str | None = None
    storage_options: Mapping[str, Any] | None = None

    def describe(self, *, full: bool = True) -> dict[str, Any]:
        """Name and tiers; the URLs (credentials redacted) only when ``full``."""
        if not full:
            return {"name": self.name, "url": None, "remote_url": None,
                    "tiered": self.remote_url is not None}
        return {"name": self.name, "url": redact_url(self.url),
                "remote_url": redact_url(self.remote_url), "tiered": self.remote_url is not None}


def parse_store_roots(text: str) -> dict[str, StoreRoot]:
    """``"a=file:///x,b=file:///y|s3://bkt/y"`` -> store roots by name."""
    roots: dict[str, StoreRoot] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, urls = item.partition("=")
        local, _, remote = urls.partition("|")
        if not sep or not name.strip() or not local.strip():
            raise ValueError(
                f"checkpoint store {item!r} is not valid: expected name=url or "
                "name=local_url|remote_url, comma-separated"
            )
        roots[name.strip()] = StoreRoot(name.strip(), local.strip(), remote.strip() or None)
    return roots


def manifest_json(manifest: Any) -> dict[str, Any]:
    """A manifest as plain JSON data (every field, tensors index included)."""
    data = dataclasses.asdict(manifest)
    # The non-tensor state is msgpack bytes: report its size, not the bytes.
    state = data.pop("state", b"")
    data["state_bytes"] = len(state)
    # Round-trip so that tuples become lists, as JSON will send them.
    return json.loads(json.dumps(data))


def _translate(exc: Exception) -> Exception:
    """Checkpoint store errors -> the admin error of the same meaning (others as is)."""
    if isinstance(exc, PinnedCheckpointError):
        return Refused("pinned", str(exc))
    if isinstance(exc, NoCheckpointError):
        return NotFound("checkpoint_not_found", str(exc))
    if isinstance(exc, CorruptCheckpointError):
        return Refused("corrupt", str(exc))
    return exc


def newest_valid(store: Any) -> list[Any]:
    """The checkpoints a delete must keep: the first whose data verifies in restore
    order (:func:`trainguard.core.record.newest_first`: what a restart resumes from)
    and in commit order (what LATEST names, and so what an outside reader following
    FORMAT.md loads). One manifest when they agree; two when a fenced zombie
    committed late."""
    manifests = store.list()
    found: dict[str, Any] = {}
    for order in (record.newest_first(manifests), list(reversed(manifests))):
        for m in order:
            try:
                store.verify(m.step)
            except CorruptCheckpointError:
                continue
            found[m.name] = m
            break
    return list(found.values())


class Busy(AdminError, BlockingIOError):
    """Too many of an expensive operation at once; retry shortly."""

    status = 429


class StoreSet:
    """The configured roots, each opened lazily once."""

    def __init__(self, roots: Mapping[str, StoreRoot], *, verify_threads: int = 2):
        self.roots = dict(roots)
        self._stores: dict[str, Any] = {}
        self._open_lock = threading.Lock()
        self._locks: dict[str, asyncio.Lock] = {}
        # Verification reads every chunk of a checkpoint: it runs in threads of its own,
        # a bounded number at once, outside the per-root lock, so that listing and
        # readiness never queue behind it.
        self._verify_threads = verify_threads
        self._verify_pool: ThreadPoolExecutor | None = None
        self._verifying = 0

    def describe(self, *, full: bool = True) -> list[dict[str, Any]]:
        return [root.describe(full=full) for root in self.roots.values()]

    def _root(self, name: str) -> StoreRoot:
        root = self.roots.get(name)
        if root is None:
            raise NotFound(
                "store_not_found",
                f"checkpoint store {name!r} is not configured: expected one of "
                f"{sorted(self.roots)} (set TRAINGUARD_CHECKPOINT_STORES=name=url,...)",
            )
        return root

    def _open(self, url: str, root: StoreRoot) -> Any:
        from checkpoint_store import CheckpointStore

        with self._open_lock:
            if url not in self._stores:
                # No retention limit: the admin never saves or collects garbage, and a
                # default keep_last must never reach a root whose writer keeps more.
                self._stores[url] = CheckpointStore(
                    url, keep_last=sys.maxsize,
                    storage_options=dict(root.storage_options or {}) or None,
                )
            return self._stores[url]

    async def _run(self, name: str, fn: Callable[[StoreRoot], T], *, locked: bool = True) -> T:
        root = self._root(name)
        lock = self._locks.setdefault(name, asyncio.Lock()) if locked else None
        try:
            if lock is None:
                return await asyncio.to_thread(fn, root)
            async with lock:
                return await asyncio.to_thread(fn, root)
        except AdminError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    # -- blocking helpers (run in a thread) ---------------------------------------

    def _catalog(self, root: StoreRoot) -> tuple[list[Any], dict[str, list[str]]]:
        """The root's manifests and each one's status labels (tiers, pinned)."""
        from checkpoint_store import tier_statuses

        manifests = list(self._open(root.url, root).list())
        labels = {m.name: ["committed", "pinned"] if m.pinned else ["committed"]
                  for m in manifests}
        if root.remote_url:
            remote = self._open(root.remote_url, root).list()
            labels = {s.name: s.labels() for s in tier_statuses(manifests, remote) if s.local}
        return manifests, labels

    def _rows(self, root: StoreRoot) -> list[dict[str, Any]]:
        manifests, labels = self._catalog(root)
        rows = []
        for m in manifests:
            rows.append(
                {
                    "step": m.step,
                    "uid": m.uid,
                    "name": m.name,
                    "created_at": m.created_at,
                    "nbytes": m.nbytes,
                    "parent": m.parent,
                    "world_size": m.world_size,
                    "status": labels[m.name],
                }
            )
        return rows

    def _manifest(self, root: StoreRoot, step: int) -> Any:
        """The newest manifest of ``step`` (a step saved twice, e.g. after a rollback,
        means its newest save, as the store's verify/pin/load do)."""
        for m in reversed(self._open(root.url, root).list()):
            if m.step == step:
                return m
        raise NotFound(
            "checkpoint_not_found",
            f"store {root.name!r} has no checkpoint at step {step}: "
            "`trainguard ckpt ls` lists the steps it has",
        )

    def _row(self, root: StoreRoot, step: int) -> dict[str, Any]:
        for row in reversed(self._rows(root)):
            if row["step"] == step:
                return row
        raise NotFound("checkpoint_not_found", f"store {root.name!r} has no step {step}")

    # -- async API ----------------------------------------------------------------

    async def catalog(self, name: str) -> tuple[list[Any], dict[str, list[str]]]:
        """Every manifest of store ``name`` with its status labels (run history)."""
        return await self._run(name, self._catalog)

    async def list(self, name: str) -> list[dict[str, Any]]:
        return await self._run(name, self._rows)

    async def show(self, name: str, step: int) -> dict[str, Any]:
        return await self._run(name, lambda root: manifest_json(self._manifest(root, step)))

    async def verify(self, name: str, step: int) -> dict[str, Any]:
        root = self._root(name)
        if self._verifying >= self._verify_threads:
            raise Busy(
                "busy",
                f"{self._verifying} checkpoint verifications are running, the most at once; "
                "retry in a few seconds",
            )

        def run() -> dict[str, Any]:
            self._manifest(root, step)
            try:
                self._open(root.url, root).verify(step)
            except CorruptCheckpointError as exc:
                return {"step": step, "valid": False, "reason": redact_text(str(exc))}
            return {"step": step, "valid": True, "reason": None}

        if self._verify_pool is None:
            self._verify_pool = ThreadPoolExecutor(self._verify_threads,
                                                   thread_name_prefix="trainguard-verify")
        self._verifying += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._verify_pool, run)
        except AdminError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc
        finally:
            self._verifying -= 1

    async def pin(self, name: str, step: int, pinned: bool) -> dict[str, Any]:
        def run(root: StoreRoot) -> dict[str, Any]:
            self._manifest(root, step)
            urls = [root.url]
            if root.remote_url and any(
                m.step == step for m in self._open(root.remote_url, root).list()
            ):
                urls.append(root.remote_url)
            for url in urls:
                store = self._open(url, root)
                store.pin(step) if pinned else store.unpin(step)
            return self._row(root, step)

        return await self._run(name, run)

    async def delete(self, name: str, step: int) -> dict[str, Any]:
        def run(root: StoreRoot) -> dict[str, Any]:
            self._manifest(root, step)
            store = self._open(root.url, root)
            if any(m.step == step for m in newest_valid(store)):
                raise Refused(
                    "newest_checkpoint",
                    f"step {step} is the newest valid checkpoint of store {root.name!r} "
                    "(in commit order, or in the order a TrainingSession restores in): "
                    "a restart resumes from it. Expected an older step",
                )
            if self._manifest(root, step).pinned:
                raise Refused(
                    "pinned",
                    f"step {step} of store {root.name!r} is pinned: unpin it first",
                )
            store.delete(step)
            return {"store": root.name, "step": step, "deleted": True}

        return await self._run(name, run)

    async def checkpoint_offsets(self, target: Any, dataset: str) -> dict[str, str]:
        """The committed stream offsets a checkpoint's manifest carries."""
        if (
            not isinstance(target, Mapping)
            or not isinstance(target.get("store"), str)
            or type(target.get("step")) is not int
            or target["step"] < 0
        ):
            raise BadRequest(
                "bad_checkpoint",
                'checkpoint must be {"store": <configured store>, "step": <integer >= 0>}',
            )
        step = int(target["step"])

        def run(root: StoreRoot) -> dict[str, str]:
            try:
                rec = SessionRecord.of(self._manifest(root, step))
            except record.RecordError as exc:
                raise Refused("bad_record", f"checkpoint {step} of store {root.name!r}: "
                                            f"{exc}") from exc
            offsets = rec.offsets if rec is not None else {}
            owner = rec.dataset if rec is not None else None
            if owner and owner != dataset:
                raise Refused(
                    "wrong_dataset",
                    f"checkpoint {step} of store {root.name!r} belongs to dataset {owner!r}, "
                    f"not {dataset!r}",
                )
            if not offsets:
                raise Refused(
                    "no_offsets",
                    f"checkpoint {step} of store {root.name!r} carries no stream offsets: "
                    "it was not written by a TrainingSession",
                )
            return {str(k): str(v) for k, v in offsets.items()}

        return await self._run(str(target["store"]), run)

    async def ready(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in self.roots:
            try:
                # latest() reads the listing and one manifest: cheap, and proves the
                # root is reachable and readable.
                await self._run(name, lambda root: self._open(root.url, root).latest(),
                                locked=False)
                out[name] = "ok"
            except Exception as exc:
                out[name] = redact_text(f"{type(exc).__name__}: {exc}")
        return out

    def close(self) -> None:
        """Stop each opened store's writer thread (they never save here)."""
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=False, cancel_futures=True)
        stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()
