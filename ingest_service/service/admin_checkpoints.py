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
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ingest_service.errors import AdminError, BadRequest, NotFound, Refused
from ingest_service.service.catalog import NEVER, Cancel, Flights, ManifestCache
from ingest_service.service.store_roots import StoreRoot, parse_store_roots
from ingest_service.service.tier_places import server_places, with_places
from trainguard.core import record
from trainguard.core.checkpoints import (
    CheckpointStatus,
    CheckpointStoreAPI,
    CheckpointSummary,
    CorruptCheckpointError,
    ManifestView,
    NoCheckpointError,
    PinnedCheckpointError,
    checkpoint_summary,
    one_tier_status,
)
from trainguard.core.newest import commit_order, newest_first
from trainguard.core.rank_record import checkpoint_offsets
from trainguard.core.record import SessionRecord
from trainguard.core.urls import redact_text

__all__ = ["StoreRoot", "StoreSet", "manifest_json", "newest_valid", "parse_store_roots"]

T = TypeVar("T")
log = logging.getLogger(__name__)


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


def newest_valid(store: CheckpointStoreAPI) -> list[ManifestView]:
    """The checkpoints a delete must keep: the first whose data verifies in restore
    order (:func:`trainguard.core.newest.newest_first`: what a restart resumes from)
    and in commit order (what LATEST names, and so what an outside reader following
    FORMAT.md loads). One manifest when they agree; two when a fenced zombie
    committed late."""
    manifests = store.list()
    found: dict[str, ManifestView] = {}
    for order in (newest_first(manifests), sorted(manifests, key=commit_order, reverse=True)):
        for m in order:
            try:
                store.verify(m.step)
            except CorruptCheckpointError:
                continue
            found[m.name] = m
            break
    return list(found.values())


@dataclass(frozen=True)
class Catalog:
    """A root's manifests (slim: no tensor index, arrays or state), oldest first, and
    their status labels, as of one listing (``key``)."""

    key: Any
    manifests: list[Any]
    labels: dict[str, list[CheckpointStatus]]
    tiers: dict[str, list[str]]  # name -> where it lives (tier_places)


class Busy(AdminError, BlockingIOError):
    """Too many of an expensive operation at once; retry shortly."""

    status = 429


class StoreSet:
    """The configured roots, each opened lazily once."""

    def __init__(self, roots: Mapping[str, StoreRoot], *, verify_threads: int = 2,
                 catalog_threads: int = 2):
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
        # Every other store call runs here: a bounded number of threads, so that no
        # burst of reads starves the event loop (JSON parsing holds the GIL).
        self._pool = ThreadPoolExecutor(catalog_threads, thread_name_prefix="trainguard-catalog")
        self._caches: dict[str, ManifestCache] = {}
        # One catalog computation per root at a time, shared by every request asking
        # for it meanwhile; stopped when all of them have gone.
        self._flights = Flights()
        # (root, listing key) -> what was derived from exactly that listing.
        self._derived: dict[str, tuple[Any, Any]] = {}

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
                self._caches[url] = ManifestCache(self._stores[url])
            return self._stores[url]

    def opened(self, root: StoreRoot) -> Any:
        """The root's store (opened once): rank state objects are read through it."""
        return self._open(root.url, root)

    def _cache(self, url: str, root: StoreRoot) -> ManifestCache:
        self._open(url, root)
        return self._caches[url]

    async def _run(self, name: str, fn: Callable[[StoreRoot], T], *, locked: bool = True) -> T:
        root = self._root(name)
        lock = self._locks.setdefault(name, asyncio.Lock()) if locked else None
        loop = asyncio.get_running_loop()
        try:
            if lock is None:
                return await loop.run_in_executor(self._pool, fn, root)
            async with lock:
                return await loop.run_in_executor(self._pool, fn, root)
        except AdminError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    # -- blocking helpers (run in a thread) ---------------------------------------

    def read_catalog(self, root: StoreRoot, cancel: Cancel = NEVER) -> Catalog:
        """The root's manifests (slim, oldest first) and each one's status labels
        (tiers, pinned); only manifests not seen before are read."""
        from checkpoint_store import tier_statuses

        local = self._cache(root.url, root)
        names, pins = local.listing(cancel)
        remote_key: tuple[tuple[str, ...], frozenset[str]] | None = None
        if root.remote_url:
            remote = self._cache(root.remote_url, root)
            remote_key = remote.listing(cancel)
        held = server_places(root.tier_servers) if root.tier_servers else None
        key = (names, pins, remote_key, held and json.dumps(held.places, sort_keys=True))
        seen = self._derived.get(f"catalog:{root.name}")
        if seen is not None and seen[0] == key:
            return cast(Catalog, seen[1])
        manifests = local.manifests(names, pins, cancel)
        labels = {m.name: one_tier_status(m.pinned) for m in manifests}
        if remote_key is not None:
            remote_manifests = remote.manifests(remote_key[0], remote_key[1], cancel)
            labels = {s.name: s.labels()
                      for s in tier_statuses(manifests, remote_manifests) if s.local}
        catalog = Catalog(key, *with_places(root.url, manifests, labels, held))
        self._derived[f"catalog:{root.name}"] = (key, catalog)
        return catalog

    def derived(self, root: StoreRoot, what: str, catalog: Catalog,
                make: Callable[[Catalog], T]) -> T:
        """``make(catalog)``, computed once per listing of the root (blocking)."""
        seen = self._derived.get(f"{what}:{root.name}")
        if seen is not None and seen[0] == catalog.key:
            return cast(T, seen[1])
        value = make(catalog)
        self._derived[f"{what}:{root.name}"] = (catalog.key, value)
        return value

    def _rows(self, root: StoreRoot, cancel: Cancel = NEVER) -> list[CheckpointSummary]:
        catalog = self.read_catalog(root, cancel)
        return [checkpoint_summary(m, catalog.labels[m.name], catalog.tiers[m.name])
                for m in catalog.manifests]

    def _manifest(self, root: StoreRoot, step: int) -> Any:
        """The newest manifest of ``step``, read whole (a step saved twice, e.g. after
        a rollback, means its newest save, as the store's verify/pin/load do)."""
        return self._cache(root.url, root).newest_of_step(step, lambda: NotFound(
            "checkpoint_not_found",
            f"store {root.name!r} has no checkpoint at step {step}: "
            "`trainguard ckpt ls` lists the steps it has",
        ))

    def _row(self, root: StoreRoot, step: int) -> CheckpointSummary:
        for row in reversed(self._rows(root)):
            if row["step"] == step:
                return row
        raise NotFound("checkpoint_not_found", f"store {root.name!r} has no step {step}")

    # -- async API ----------------------------------------------------------------

    async def shared(self, name: str, what: str, fn: Callable[[StoreRoot, Cancel], T]) -> T:
        """``fn(root, cancel)`` in the bounded pool, one at a time per (store, what),
        shared by the requests meanwhile (:class:`~ingest_service.service.catalog.Flights`)."""
        root = self._root(name)
        try:
            return await self._flights.run(f"{what}:{name}", self._pool, fn, root)
        except AdminError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    async def catalog(self, name: str) -> Catalog:
        """Every manifest of store ``name`` (slim) with its status labels."""
        return await self.shared(name, "catalog", self.read_catalog)

    async def list(self, name: str) -> list[CheckpointSummary]:
        return await self.shared(name, "rows", lambda root, cancel: self._rows(root, cancel))

    async def show(self, name: str, step: int, *, full: bool = True) -> dict[str, Any]:
        """Step ``step``'s checkpoint: its list row (names and figures), plus with
        ``full`` the whole manifest (the caller's ``extra``, the tensor index, every
        rank's random states: for readers holding a token only)."""
        def run(root: StoreRoot) -> dict[str, Any]:
            row = self._row(root, step)
            return {**manifest_json(self._manifest(root, step)), **row} if full else dict(row)
        return await self._run(name, run)

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

    async def pin(self, name: str, step: int, pinned: bool) -> CheckpointSummary:
        def run(root: StoreRoot) -> CheckpointSummary:
            self._manifest(root, step)
            urls = [root.url]
            remote = self._cache(root.remote_url, root) if root.remote_url else None
            if remote is not None and any(
                    m.step == step for m in remote.manifests(*remote.listing())):
                urls.append(str(root.remote_url))
            for url in urls:
                store = self._open(url, root)
                store.pin(step) if pinned else store.unpin(step)
            return self._row(root, step)

        return await self._run(name, run)

    async def delete(self, name: str, step: int) -> dict[str, Any]:
        def run(root: StoreRoot) -> dict[str, Any]:
            self._manifest(root, step)
            store = self._open(root.url, root)
            kept = newest_valid(store)
            if any(m.step == step for m in kept):
                # kept[0] is the restore order's: say which order keeps this one.
                why = ("the newest in the order a TrainingSession restores in: a restart "
                       "resumes from it" if kept[0].step == step else
                       "the newest in commit order (what LATEST names; a fenced zombie's "
                       f"late commit), though a restart resumes from step {kept[0].step}")
                raise Refused(
                    "newest_checkpoint",
                    f"step {step} is the newest valid checkpoint of store {root.name!r} "
                    f"({why}). Expected an older step",
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
            manifest = self._manifest(root, step)
            try:
                rec = SessionRecord.of(manifest)
                # Version 3 keeps them in the ranks' state objects: one read per rank.
                offsets = checkpoint_offsets(self._open(root.url, root), manifest)
            except record.RecordError as exc:
                raise Refused("bad_record", f"checkpoint {step} of store {root.name!r}: "
                                            f"{exc}") from exc
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
                # /readyz is anonymous: the type only; the message (which may quote a
                # URL, a bucket or a path) goes to the log, redacted.
                log.warning("checkpoint store %r is not ready: %s", name,
                            redact_text(f"{type(exc).__name__}: {exc}"))
                out[name] = f"unreachable ({type(exc).__name__})"
        return out

    def close(self) -> None:
        """Stop each opened store's writer thread (they never save here)."""
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()
