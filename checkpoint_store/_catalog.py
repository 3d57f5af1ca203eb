"""The read side and the upkeep of a ``CheckpointStore``: listing manifests (commit
order, restore order, LATEST checked as the hint it is), reading and verifying them,
per-rank state objects, and retention, gc, pins and deletes (:class:`Catalog`, a part
of :class:`checkpoint_store.store.CheckpointStore`, which sets the attributes below)."""

from __future__ import annotations

import builtins
import dataclasses
import json
import logging
from typing import Any

from checkpoint_store.backends import Backend
from checkpoint_store.layout import (
    LATEST,
    MANIFEST_DIR,
    PINS_DIR,
    ManifestName,
    manifest_path,
    parse_manifest_name,
)
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.rank_content import with_content
from checkpoint_store.rank_state import read_rank_object
from checkpoint_store.reader import verify_data
from checkpoint_store.retention import (
    GcReport,
    apply_retention,
    choose_deletions,
    collect_garbage,
    retire,
)
from checkpoint_store.saving import latest_pointer
from trainguard.core.checkpoints import (
    CorruptCheckpointError,
    ManifestView,
    NoCheckpointError,
    PinnedCheckpointError,
)
from trainguard.core.newest import commit_order, newest_committed, restore_order, saves_of

log = logging.getLogger("checkpoint_store")

__all__ = ["Catalog"]


class Catalog:
    """Listing, verifying, retention, pinning and deleting of a store's checkpoints."""

    url: str
    keep_last: int
    keep_every: int | None
    io_threads: int
    stale_after_s: float
    _backend: Backend
    _own_inflight: set[str]
    _parsed: dict[str, tuple[float | None, Manifest]]

    # ---------------------------------------------------------------- read side
    def _names(self) -> builtins.list[ManifestName]:
        """Manifest names in commit order (oldest first)."""
        return sorted((p for p in map(parse_manifest_name,
                                      self._backend.listdir(MANIFEST_DIR)) if p),
                      key=commit_order)

    def _pins(self) -> set[str]:
        return set(self._backend.listdir(PINS_DIR))

    def _read_manifest(self, name: str, pins: set[str] | None = None, *,
                       reuse: bool = False) -> Manifest:
        """Read and verify a manifest. ``reuse``: return the copy this store parsed
        (or committed) before when the file's modification time is still the one it
        had then, without reading it (listings and retention, after every save: a
        manifest is written once, by exclusive create, so a name whose file was not
        touched since holds the bytes verified then, and a listing costs a stat per
        manifest, not a read and parse of its whole index of ranks). A file rewritten
        in place (damage, a forgery) has a new time and is read and verified again."""
        pinned = name in (pins if pins is not None else self._pins())
        seen = self._parsed.get(name) if reuse else None
        if seen is not None and seen[0] is not None \
                and self._backend.mtime(manifest_path(name)) == seen[0]:
            # The record itself while its pin is unchanged: a replace() costs more
            # than the stat (listings run before every RAM-tier save).
            return seen[1] if seen[1].pinned == pinned else dataclasses.replace(seen[1], pinned=pinned)
        # The time before the read: a rewrite after it gives a newer time, never this.
        stamp = self._backend.mtime(manifest_path(name)) if reuse else None
        try:
            raw = self._backend.read(manifest_path(name))
        except FileNotFoundError as e:
            raise NoCheckpointError(f"manifest {name} does not exist") from e
        manifest = with_content(self._backend, parse_manifest(name, raw, pinned=pinned))
        if reuse:
            self._remember(name, stamp, manifest)
        return manifest

    def _remember(self, name: str, stamp: float | None, manifest: Manifest) -> None:
        """Keep ``manifest``, verified when its file's modification time was ``stamp``
        (None: the backend tells no times, so it is read again each time)."""
        if len(self._parsed) >= 4096:  # a store far past any retention: start over
            self._parsed.clear()
        self._parsed[name] = (stamp, manifest)

    def _remember_commit(self, manifest: Manifest) -> None:
        """This store just committed ``manifest``: listings after it need not read it."""
        self._remember(manifest.name, self._backend.mtime(manifest_path(manifest.name)),
                       manifest)

    def list(self) -> builtins.list[Manifest]:
        """Committed, readable manifests, oldest first (damaged ones are logged). A
        manifest this store read or committed before and whose file is untouched since
        is not read again (:meth:`_read_manifest`), so rank 0's listing at each commit
        costs one stat per kept checkpoint, whatever the world size. The manifests
        returned are shared records: read them, never change them."""
        return self._list(reuse=True)

    def manifest_names(self) -> builtins.list[str]:
        """The manifest names, in commit order, from one listing (nothing is read):
        with :meth:`read_manifest`, how a reader caching manifests (they are never
        rewritten under a name) lists at the cost of what changed."""
        parsed = [p for p in map(parse_manifest_name, self._backend.listdir(MANIFEST_DIR)) if p]
        # ManifestName's own order, by a tuple key: sorting the dataclasses compares
        # them in Python, the bulk of a warm listing's cost at a thousand manifests.
        parsed.sort(key=lambda p: (p.uid, p.step))
        return [p.name for p in parsed]

    def pinned_names(self) -> set[str]:
        """The names of the pinned manifests (one listing)."""
        return self._pins()

    def read_manifest(self, name: str, *, pinned: bool = False) -> Manifest:
        """One manifest, read and verified; raises NoCheckpointError when it is gone,
        CorruptCheckpointError when it is damaged."""
        return self._read_manifest(name, {name} if pinned else set())

    def _list(self, *, reuse: bool) -> builtins.list[Manifest]:
        pins = self._pins()
        out = []
        names = self._names()
        if reuse:  # forget the deleted (retention): the cache holds the kept only
            present = {n.name for n in names}
            for gone in [k for k in list(self._parsed) if k not in present]:
                self._parsed.pop(gone, None)  # the writer thread's retention lists too
        for n in names:
            try:
                out.append(self._read_manifest(n.name, pins, reuse=reuse))
            except CorruptCheckpointError as e:
                log.warning("skipping damaged manifest %s: %s", n.name, e)
            except NoCheckpointError:
                continue  # deleted between listing and reading
        return out

    def latest(self) -> Manifest | None:
        """The newest committed manifest whose checksum holds (what LATEST names: the
        commit order, not the restore order); no tensor data is read."""
        pins = self._pins()
        for n in reversed(self._names()):
            try:
                return self._read_manifest(n.name, pins)
            except CorruptCheckpointError as e:
                log.warning("skipping damaged manifest %s: %s", n.name, e)
            except NoCheckpointError:
                continue
        return None

    def _check_latest_pointer(self, names: builtins.list[ManifestName]) -> str | None:
        """A problem with LATEST (it is a hint: loads never depend on it), or None.
        A LATEST older than the newest manifest is no problem: a crash after the
        commit and before the pointer swap leaves it so."""
        newest = newest_committed(names)
        try:
            raw = self._backend.read(LATEST)
        except FileNotFoundError:
            return None if newest is None else f"LATEST is missing (newest is {newest.name})"
        try:
            doc = json.loads(raw)
            name, step, uid = doc["manifest"], doc["step"], doc["uid"]
        except (ValueError, KeyError, TypeError) as e:
            return f"LATEST is unreadable ({e})"
        parsed = parse_manifest_name(name) if isinstance(name, str) else None
        if parsed is None or (parsed.step, parsed.uid) != (step, uid):
            return f"LATEST is inconsistent: {doc!r}"
        if parsed not in names:
            return f"LATEST names {name}, which is not among the manifests"
        return None

    def _candidates(self, step: int | None) -> builtins.list[ManifestName]:
        """``step``'s saves, newest first; without a step, every checkpoint in the
        order a restart resumes in (:func:`trainguard.core.newest.restore_order`),
        which needs each manifest read. One that cannot be read sorts by its commit
        time, after every checkpoint with a session record, and is reported as damaged
        when its turn comes."""
        names = self._names()
        if step is not None:
            return saves_of(step, names)
        pins = self._pins()
        keys: dict[ManifestName, tuple[int, int, str, int]] = {}
        for n in names:
            try:
                keys[n] = restore_order(self._read_manifest(n.name, pins))
            except (CorruptCheckpointError, NoCheckpointError):
                keys[n] = (0, 0, n.uid, n.step)
        return sorted(names, key=keys.__getitem__, reverse=True)

    def verify(self, step: int) -> Manifest:
        """Read every chunk of the newest checkpoint of ``step`` and check its CRC, and
        every rank state object against its digest."""
        candidates = self._candidates(step)
        if not candidates:
            raise NoCheckpointError(f"no checkpoint of step {step} in {self.url}")
        manifest = self._read_manifest(candidates[0].name)
        verify_data(self._backend, manifest, io_threads=self.io_threads)
        for r in range(manifest.world_size if manifest.ranks is not None else 0):
            self.read_rank_state(manifest, r)
        return manifest

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s state object of the checkpoint ``manifest`` names (its own
        ``rank_state`` given to ``save``), verified against the manifest's digest; None
        when that save carried no rank states. One small read: a restore reads the
        objects it needs, not all. Raises CorruptCheckpointError when the object is
        damaged or missing, IndexError when ``rank`` is not one of the save's."""
        found = manifest if isinstance(manifest, Manifest) else \
            self._read_manifest(manifest.name, set())
        return read_rank_object(self._backend, found, rank)

    # ---------------------------------------------------------------- retention
    def _doomed(self, protect: str | None = None) -> builtins.list[Manifest]:
        """The checkpoints retention drops (never ``protect``)."""
        manifests = self._list(reuse=True)
        return [m for m in choose_deletions(manifests, keep_last=self.keep_last,
                                            keep_every=self.keep_every)
                if m.name != protect]

    def _retire(self, protect: str | None = None) -> builtins.list[Manifest]:
        """Delete the manifests retention drops; returns them (their data is left)."""
        doomed = self._doomed(protect)
        retire(self._backend, doomed)
        return doomed

    def _apply_retention(self) -> builtins.list[str]:
        return apply_retention(self._backend, self._doomed())

    def gc(self) -> GcReport:
        """Remove debris of crashed saves and apply retention; a save in flight (here
        or in a live process) is left alone."""
        return collect_garbage(
            self._backend, own_inflight=set(self._own_inflight),
            stale_after_s=self.stale_after_s, retention=self._apply_retention,
        )

    def _by_step(self, step: int) -> builtins.list[Manifest]:
        found = [m for m in self.list() if m.step == step]
        if not found:
            raise NoCheckpointError(f"no checkpoint of step {step} in {self.url}")
        return found

    def pin(self, step: int) -> Manifest:
        """Keep the newest checkpoint of ``step`` forever (until unpinned)."""
        m = self._by_step(step)[-1]
        self._backend.replace(f"{PINS_DIR}/{m.name}", b"")
        return self._read_manifest(m.name)

    def unpin(self, step: int) -> None:
        for m in self._by_step(step):
            self._backend.remove(f"{PINS_DIR}/{m.name}")

    def delete(self, step: int) -> builtins.list[str]:
        """Delete every checkpoint of ``step`` (manifest first, then data)."""
        found = self._by_step(step)
        pinned = [m.name for m in found if m.pinned]
        if pinned:
            raise PinnedCheckpointError(f"checkpoints {pinned} are pinned; unpin step {step} "
                                        "before deleting it")
        deleted = apply_retention(self._backend, found)
        newest = self.latest()
        if newest is None:
            self._backend.remove(LATEST)
        else:
            self._backend.replace(LATEST, latest_pointer(newest.name, newest.step, newest.uid))
        return deleted

