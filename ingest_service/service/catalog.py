"""What the admin API lists about a checkpoint root, at the cost of what changed.

A manifest is never rewritten under its name (it is created once, exclusively), so
each one is read, verified and parsed once: :class:`ManifestCache` keeps it by name,
slim (no tensor index, no array table, no state skeleton: the listing and the run
histories need neither) and bounded in count. A listing then costs one directory
listing of the manifests and one of the pins; only names not seen before are read.
Names that disappeared (deleted, retired) are dropped from the cache.

The work is blocking file or object-store I/O and JSON parsing, so it runs in a
thread; :class:`Abandoned` stops it between two manifests when every request that
waited for it has gone (``cancel`` is set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ingest_service.errors import IngestError
from trainguard.core.checkpoints import CorruptCheckpointError, NoCheckpointError
from trainguard.core.newest import saves_of
from trainguard.core.urls import redact_text

__all__ = ["MAX_CACHED_MANIFESTS", "NEVER", "Abandoned", "Flights", "ManifestCache", "Never"]

log = logging.getLogger(__name__)

MAX_CACHED_MANIFESTS = 20_000
"""Slim manifests kept per root (each ~1-2 KB plus its ``extra``): a root holding
more is read partly again on each listing, never held whole."""


class Abandoned(IngestError):
    """Every request waiting for this catalog work went away: it stopped early (a
    signal between the worker thread and its waiters, never shown to a caller)."""


class Never:
    """A cancel flag that is never set (the CLI waits for its own work)."""

    def is_set(self) -> bool:
        return False


Cancel = threading.Event | Never
NEVER = Never()
T = TypeVar("T")


@dataclass
class _Flight:
    future: asyncio.Future[Any]
    cancel: threading.Event
    waiters: int = 0


class Flights:
    """Blocking work run once per key at a time: a request arriving while it runs
    waits for the same result (eight dashboards polling cost one computation), and
    when every waiting request has gone (its task cancelled, e.g. the client closed
    the connection) the work's ``cancel`` flag is set, so it stops early."""

    def __init__(self) -> None:
        self._running: dict[str, _Flight] = {}

    async def run(self, key: str, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args, cancel)`` in ``pool``, shared by every caller of ``key``."""
        flight = self._running.get(key)
        if flight is None or flight.cancel.is_set():  # an abandoned one stops: start anew
            cancel = threading.Event()
            future: asyncio.Future[Any] = asyncio.get_running_loop().run_in_executor(
                pool, functools.partial(fn, *args, cancel))
            flight = self._running[key] = _Flight(future, cancel)
            future.add_done_callback(functools.partial(self._done, key, flight))
        flight.waiters += 1
        try:
            return cast(T, await asyncio.shield(flight.future))
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done():
                log.info("%s: every request waiting for it has gone; stopping it", key)
                flight.cancel.set()

    def _done(self, key: str, flight: _Flight, future: asyncio.Future[Any]) -> None:
        if self._running.get(key) is flight:
            del self._running[key]
        # Retrieved here: an abandoned flight's outcome is no one's.
        if not future.cancelled() and isinstance(future.exception(), Abandoned):
            log.info("%s: stopped early, abandoned", key)


class ManifestCache:
    """One store root's manifests by name, parsed once. Thread-safe."""

    def __init__(self, store: Any, *, max_entries: int = MAX_CACHED_MANIFESTS) -> None:
        self._store = store
        self._max = max_entries
        # name -> slim manifest, or None for one found damaged (it stays damaged).
        self._parsed: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, name: str) -> tuple[bool, Any]:
        with self._lock:
            if name in self._parsed:
                self._parsed.move_to_end(name)
                return True, self._parsed[name]
        return False, None

    def _put(self, name: str, manifest: Any) -> None:
        with self._lock:
            self._parsed[name] = manifest
            while len(self._parsed) > self._max:
                self._parsed.popitem(last=False)

    def listing(self, cancel: Cancel = NEVER) -> tuple[tuple[str, ...], frozenset[str]]:
        """The manifest names (commit order) and the pinned names, listed now."""
        names = tuple(self._store.manifest_names())
        pins = frozenset(self._store.pinned_names())
        with self._lock:
            for gone in set(self._parsed) - set(names):
                del self._parsed[gone]
        if cancel.is_set():
            raise Abandoned
        return names, pins

    def manifests(self, names: tuple[str, ...], pins: frozenset[str],
                  cancel: Cancel = NEVER) -> list[Any]:
        """The readable manifests among ``names``, oldest first, slim, with their pin
        flag from ``pins``; each name not seen before is read once."""
        out = []
        for name in names:
            known, manifest = self._get(name)
            if not known:
                if cancel.is_set():
                    raise Abandoned
                manifest = self._read(name)
                if manifest is _GONE:
                    continue
                self._put(name, manifest)
            if manifest is not None:
                out.append(dataclasses.replace(manifest, pinned=name in pins))
        return out

    def _read(self, name: str) -> Any:
        try:
            full = self._store.read_manifest(name)
        except NoCheckpointError:
            return _GONE  # deleted between listing and reading: not cached
        except CorruptCheckpointError as exc:
            log.warning("skipping damaged manifest %s: %s", name, redact_text(str(exc)))
            return None
        return dataclasses.replace(full, tensors={}, arrays={}, state=b"")

    def newest_of_step(self, step: int, on_missing: Callable[[], Exception]) -> Any:
        """The newest readable manifest of ``step``, read whole (with its tensor index
        and state), pinned flag included; raises ``on_missing()`` when there is none."""
        from checkpoint_store.layout import parse_manifest_name

        names, pins = self.listing()
        for parsed in saves_of(step, [p for p in map(parse_manifest_name, names) if p]):
            name = parsed.name
            try:
                return self._store.read_manifest(name, pinned=name in pins)
            except (CorruptCheckpointError, NoCheckpointError):
                continue
        raise on_missing()


_GONE = object()
