"""``NodeTierStore``: one node's checkpoints in RAM, on its partners and on local
disk, behind the checkpoint port (a ``TrainingSession`` takes it as ``store=``).

```python
ram = RamTierStore(node_root(shm_root, node), budget_bytes=8 << 30)
store = NodeTierStore(ram, node=node, peers=tier_server_urls, disk_root="/local/ckpt",
                      intervals=TierIntervals(partner_every=1, disk_every=10))
session = TrainingSession(redis_url, dataset="tok", run="run42", store=store, ...)
```

Each save goes to the RAM tier; once committed there, a background thread sends a
byte copy to the node's partners (:func:`checkpoint_store.partner.partners_of`) every
``partner_every``-th save, copies it to local disk every ``disk_every``-th and uploads
it to remote storage (``remote_url/n<node>``) every ``remote_every``-th. The copies
carry the same manifest name, so a checkpoint is one name on every tier.

The catalog (:meth:`catalog`) says where each checkpoint lives; :meth:`list` is the
restore's view of it: the checkpoints this node can get from some tier *and* that
every other node can get too (from its own tier server or a partner's), so that all
ranks restore the same step. :meth:`load` of a step tries the tiers in order (own
RAM, a partner's copy streamed into the state, local disk, remote), each verified
(CRC-32C of every chunk, SHA-256 of a partner's small files); a damaged copy is
skipped with a warning; :attr:`restored_from` names the tier that served.

Node ``r`` is the session's rank ``r``. The store has per-rank state objects
(``supports_rank_state``): rank ``r``'s object is a file of node ``r``'s checkpoint
and goes wherever it goes; :meth:`read_rank_state` reads a rank's own from this
node's tiers, or another rank's (a world-size change) from that node's tiers and its
partners' copies (:mod:`checkpoint_store._node_ranks`). ``peers`` names the tier
servers of every node whose tiers may hold checkpoints: after a node is lost the job
may go on with fewer ranks, and the lost rank's objects are read from its partners.
"""

from __future__ import annotations

import builtins
import collections
import logging
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint_store._copies import PartnerCopyError, copy_local
from checkpoint_store._node_ranks import NodeRankReader
from checkpoint_store._partner_link import PartnerLink
from checkpoint_store._partner_stream import restore_from_partner
from checkpoint_store._wrapped import RankStateWrappedStore
from checkpoint_store.backends import LocalBackend, open_backend
from checkpoint_store.dist import ONE_PROCESS
from checkpoint_store.handle import SaveHandle
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.partner import partners_of
from checkpoint_store.ram_tier import RamTierStore
from checkpoint_store.retention import apply_retention, choose_deletions
from checkpoint_store.store import CheckpointStore
from checkpoint_store.upload import Uploader
from trainguard.core.checkpoints import (
    CheckpointError,
    CorruptCheckpointError,
    IfBusy,
    ManifestView,
)
from trainguard.core.multilevel import Level, level_periods, nested_multiples
from trainguard.core.newest import newest_first, newest_save_of
from trainguard.core.record import RecordError, SessionRecord
from trainguard.core.tier_plan import TierInfo

__all__ = ["NodeTierStore", "TierIntervals"]

log = logging.getLogger("checkpoint_store.node_tiers")


@dataclass(frozen=True)
class TierIntervals:
    """Which RAM-tier saves go further: every ``partner_every``-th to the partners,
    every ``disk_every``-th to local disk, every ``remote_every``-th to remote storage
    (0: never)."""

    partner_every: int = 1
    disk_every: int = 0
    remote_every: int = 0

    def __post_init__(self) -> None:
        for name in ("partner_every", "disk_every", "remote_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def auto(cls, *, step_s: float, ram: Level, partner: Level, disk: Level | None = None,
             remote: Level | None = None) -> tuple[int, TierIntervals]:
        """``(ram_every_steps, intervals)`` from each tier's measured cost and the rate
        of the failures it alone survives (:mod:`trainguard.core.multilevel`): the
        session checkpoints every ``ram_every_steps`` steps, and the tiers above
        follow at these multiples."""
        levels = [lv for lv in (ram, partner, disk, remote) if lv is not None]
        every = nested_multiples(level_periods(levels), step_s)
        by_name = dict(zip(["ram", "partner", *(["disk"] if disk else []),
                            *(["remote"] if remote else [])], every, strict=True))
        # The intervals count RAM saves: a tier's multiple of the RAM tier's.
        partner_every = by_name["partner"]
        disk_every = partner_every * by_name.get("disk", 0)
        remote_every = (disk_every or partner_every) * by_name.get("remote", 0)
        return max(1, by_name["ram"]), cls(partner_every=partner_every, disk_every=disk_every,
                                           remote_every=remote_every)


class NodeTierStore(RankStateWrappedStore):
    """The checkpoint port over one node's tiers (module doc). ``peers[r]`` is node
    ``r``'s tier server; ``copies`` partners keep each checkpoint. ``on_copied(name)``
    is called once a save's copies are all made; ``hold_until_copied`` keeps the RAM
    tier from dropping a checkpoint before then (its ``may_drop``)."""

    def __init__(self, ram: RamTierStore, *, node: int, peers: Sequence[str],
                 disk_root: str | os.PathLike[str] | None = None, disk_keep_last: int = 2,
                 remote_url: str | None = None, storage_options: dict[str, Any] | None = None,
                 intervals: TierIntervals = TierIntervals(), copies: int = 1,
                 domains: Sequence[str] | None = None, timeout_s: float = 30.0,
                 hold_until_copied: bool = False):
        self.ram = ram
        self.store = ram.store  # what passes through: verify, pins, gc (WrappedStore)
        self.node = node
        self.nodes = len(peers)
        self.partners = partners_of(node, self.nodes, copies=copies, domains=domains)
        self.domains = domains
        self.copies = copies
        self.link = PartnerLink(peers, timeout_s=timeout_s)
        self.intervals = intervals
        self.disk: CheckpointStore | None = None
        self.disk_root = Path(disk_root) if disk_root is not None else None
        if disk_root is not None:
            Path(disk_root).mkdir(parents=True, exist_ok=True)
            self.disk = CheckpointStore(disk_root, keep_last=disk_keep_last,
                                        process_group=ONE_PROCESS)
        self.disk_keep_last = disk_keep_last
        self.remote_url = remote_url.rstrip("/") if remote_url is not None else None
        self._storage_options = storage_options
        self._remotes: dict[int, CheckpointStore] = {}
        self._uploader: Uploader | None = None
        if self.remote_url is not None:
            self._uploader = Uploader(
                LocalBackend(str(ram.root)), open_backend(self._remote_root(node), storage_options),
                lambda fn, *args: fn(*args), on_committed=self._uploaded)
            self._uploader.start()
        self.url = ram.url
        self.restored_from: str | None = None
        self.copy_failures = 0
        self.copies_made: collections.Counter[str] = collections.Counter()
        """Copies sent per tier (``partner``: to all partners; ``remote``: queued)."""
        self.on_copied: Callable[[str], None] = lambda _name: None
        self._copied: set[str] = set()
        if hold_until_copied:
            # The RAM tier drops a checkpoint only once its copies exist elsewhere.
            ram.may_drop = self._copied.__contains__
        # A save rewrites a dropped checkpoint's pages only once no copy reads them.
        ram.may_recycle = lambda n: n in self._copied and not (self._uploader and self._uploader.holds(n))
        self._objects = NodeRankReader(
            node=node, ram=ram.store, disk=self.disk, link=self.link, remote=self._remote,
            hosts=lambda owner: partners_of(owner, self.nodes, copies=copies, domains=domains))
        self._saves = 0
        self._refetch: threading.Thread | None = None
        # Seconds of each tier's recent copies (checkpoint_tiers: the auto plan's costs).
        self._copy_s: dict[str, collections.deque[float]] = {}
        self._upload_started: dict[str, float] = {}
        self._queue: queue.Queue[tuple[str, TierIntervals] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._copy_loop, daemon=True,
                                        name=f"tier-copies-n{node}")
        self._thread.start()

    # ---------------------------------------------------------------- save
    def save(self, state: Mapping[str, Any], *, step: int,
             extra: Mapping[str, Any] | None = None, blocking: bool = True,
             if_busy: IfBusy = "wait", rank_state: Mapping[str, Any] | None = None,
             precommit: Callable[[], None] | None = None) -> SaveHandle:
        """A RAM-tier save (``rank_state``: this rank's state object, a file of the
        checkpoint like its shards); its copies to partners and disk follow in the
        background."""
        # This moment's plan; one changed meanwhile (follow_tiers) applies from the next save.
        intervals = self.intervals
        handle = self.ram.save(state, step=step, extra=extra, blocking=blocking,
                               if_busy=if_busy, rank_state=rank_state, precommit=precommit)
        handle.add_done_callback(lambda h: self._committed(h, intervals))
        return handle

    def _committed(self, handle: SaveHandle, intervals: TierIntervals) -> None:
        if handle.manifest is not None:
            self._queue.put((handle.manifest.name, intervals))

    def _timed(self, tier: str, started: float) -> None:
        self._copy_s.setdefault(tier, collections.deque(maxlen=8)).append(
            time.monotonic() - started)

    def _uploaded(self, name: str) -> None:
        started = self._upload_started.pop(name, None)
        if started is not None:
            self._timed("remote", started)

    def _copy_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, iv = item
            self._saves += 1
            try:
                every = iv.partner_every
                if every and self._saves % every == 0:
                    started = time.monotonic()
                    for to in self.partners:
                        self.link.send(to, self.node, self.ram.root, name)
                    self._timed("partner", started)
                    self.copies_made["partner"] += 1
                every = iv.disk_every
                if self.disk_root is not None and every and self._saves % every == 0:
                    started = time.monotonic()
                    copy_local(self.ram.root, self.disk_root, name)
                    self._retain_disk()
                    self._timed("disk", started)
                    self.copies_made["disk"] += 1
                every = iv.remote_every
                if self._uploader is not None and every and self._saves % every == 0:
                    self._upload_started[name] = time.monotonic()
                    self._uploader.enqueue(name)
                    self.copies_made["remote"] += 1
                self._copied.add(name)
                self.ram.notify()
                self.on_copied(name)
            except (OSError, CheckpointError) as e:
                # The RAM copy stands; the next save is copied again.
                self.copy_failures += 1
                log.warning("node %s: copy of %s failed: %s", self.node, name, e)
            finally:
                self._queue.task_done()

    # ---------------------------------------------------------- auto intervals
    def checkpoint_tiers(self) -> builtins.list[TierInfo]:
        """RAM (survives a crash), partners (a node lost), local disk (a node and its
        partners restarted, disks kept), remote (the job lost), with each copy's
        measured seconds (median of the last 8): what ``checkpoint_every="auto"``
        plans from (:mod:`trainguard.core.tier_plan`)."""
        def cost(tier: str) -> float | None:
            seen = list(self._copy_s.get(tier, ()))
            return statistics.median(seen) if seen else None

        tiers = [TierInfo("ram", "crash"), TierInfo("partner", "node", cost("partner"))]
        if self.disk_root is not None:
            tiers.append(TierInfo("disk", "nodes", cost("disk")))
        if self._uploader is not None:
            tiers.append(TierInfo("remote", "job", cost("remote")))
        return tiers

    def follow_tiers(self, every: Mapping[str, int]) -> None:
        """From the next save on, every ``every[t]``-th RAM save is copied to tier
        ``t`` (``partner``, ``disk``, ``remote``; 0: never)."""
        iv = self.intervals
        self.intervals = TierIntervals(partner_every=every.get("partner", iv.partner_every),
                                       disk_every=every.get("disk", iv.disk_every),
                                       remote_every=every.get("remote", iv.remote_every))

    def _retain_disk(self) -> None:
        assert self.disk is not None and self.disk_root is not None
        doomed = choose_deletions(self.disk.list(), keep_last=self.disk_keep_last, keep_every=None)
        if doomed:
            apply_retention(LocalBackend(str(self.disk_root)), doomed)

    def _remote_root(self, node: int) -> str:
        return f"{self.remote_url}/n{node}"

    def _remote(self, node: int) -> CheckpointStore | None:
        """Node ``node``'s remote tier (one root per node under ``remote_url``)."""
        if self.remote_url is None:
            return None
        if node not in self._remotes:
            self._remotes[node] = CheckpointStore(
                self._remote_root(node), storage_options=self._storage_options,
                process_group=ONE_PROCESS)
        return self._remotes[node]

    def wait_copies(self, timeout_s: float | None = None) -> None:
        """Return once every committed save has been copied (or failed to be),
        uploads included, and a partner's copy restored from is back in RAM."""
        self._queue.join()
        if self._refetch is not None:  # a restored partner copy coming back into RAM
            self._refetch.join(timeout_s)
        if self._uploader is not None:
            self._uploader.wait_idle(timeout_s)

    # ---------------------------------------------------------------- catalog
    def _available(self, owner: int) -> dict[str, tuple[Manifest, list[str]]]:
        """``owner``'s checkpoints that some tier serves: name -> (manifest, where)."""
        found: dict[str, tuple[Manifest, list[str]]] = {}

        def add(m: Manifest, where: str) -> None:
            found.setdefault(m.name, (m, []))[1].append(where)

        if owner == self.node:
            for m in self.ram.list():
                add(m, "ram")
            for m in self.disk.list() if self.disk is not None else []:
                add(m, "disk")
            hosts = self.partners
        else:
            hosts = [owner, *partners_of(owner, self.nodes, copies=self.copies,
                                         domains=self.domains)]
        remote = self._remote(owner)
        for m in remote.list() if remote is not None else []:
            add(m, "remote")
        for host in hosts:
            tiers = self.link.index(host, owner)
            for tier, entries in (tiers or {}).items():
                where = tier if host == owner else f"partner:n{host}"
                for e in entries:
                    try:
                        add(parse_manifest(e["name"], e["manifest"].encode("utf-8")), where)
                    except CheckpointError:
                        continue  # a damaged manifest there: that tier does not hold it
        return found

    def catalog(self) -> dict[str, list[str]]:
        """Where each checkpoint of this node lives: name -> ``ram``, ``partner:n<r>``, ``disk``."""
        return {name: where for name, (_m, where) in self._available(self.node).items()}

    def list(self) -> builtins.list[Manifest]:
        """This node's checkpoints whose step every node that wrote it can restore:
        nodes ``0..W-1`` for a checkpoint of a session on ``W`` ranks (its record's
        ``world_size``), all of ``peers`` for one without a session record."""
        mine = self._available(self.node)
        steps: dict[int, set[int]] = {}

        def restorable(node: int, step: int) -> bool:
            if node == self.node:
                return True
            if node >= self.nodes:
                return False  # a rank whose node this store cannot reach
            if node not in steps:
                steps[node] = {m.step for m, _w in self._available(node).values()}
            return step in steps[node]

        kept = [m for m, _w in mine.values()
                if all(restorable(node, m.step) for node in range(self._writers(m)))]
        return sorted(kept, key=lambda m: (m.uid, m.step))

    def _writers(self, m: Manifest) -> int:
        """How many nodes wrote checkpoint ``m`` (its session's ranks)."""
        try:
            rec = SessionRecord.of(m)
        except RecordError:
            rec = None
        return rec.world_size if rec is not None else self.nodes

    def latest(self) -> Manifest | None:
        return next(iter(newest_first(self.list())), None)

    # ---------------------------------------------------------------- load
    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> Manifest | None:
        """Load ``step`` (default: the newest in :meth:`list`) from the first tier with a
        verified copy. CorruptCheckpointError when none has one (the session then tries
        the step before); None when there is no checkpoint at all. A partner's copy is
        streamed in place (``strict``: verified first); the next tier reloads a damaged one."""
        if step is None:
            newest = self.latest()
            if newest is None:
                return None
            step = newest.step
        dirty = ""  # an in-place partner restore failed: its bytes may be in the state
        for tier, attempt in self._tiers_for(step, strict):
            try:
                manifest = attempt(state, keys)
            except (CorruptCheckpointError, PartnerCopyError) as e:
                dirty = dirty or (tier if tier.startswith("partner") and not strict else "")
                log.warning("node %s: the %s copy of step %s is not usable (%s); trying the "
                            "next tier", self.node, tier, step, e)
                continue
            if manifest is None:
                continue
            self.restored_from = tier
            if tier == "remote":
                log.warning("node %s restored step %s from REMOTE storage: no RAM, partner "
                            "or disk copy of it was left (several nodes lost at once?)",
                            self.node, step)
            else:
                log.warning("node %s restored step %s from %s", self.node, step, tier)
            return manifest
        raise CorruptCheckpointError(
            f"node {self.node}: no tier holds a verified copy of step {step} (RAM, "
            f"partners {self.partners}, disk, remote); the restore tries the checkpoint "
            "before it" + (f". The state's tensors may hold bytes of {dirty}'s damaged copy "
                           "(read in place): load another checkpoint before using them"
                           if dirty else ""))

    def _tiers_for(self, step: int, strict: bool) -> builtins.list[tuple[str, Any]]:
        def from_ram(state: Mapping[str, Any], keys: Iterable[str] | None) -> Manifest | None:
            if newest_save_of(step, self.ram.list()) is None:
                return None
            return self.ram.load(state, step=step, keys=keys, strict=True)

        def from_partner(host: int) -> Any:
            def attempt(state: Mapping[str, Any], keys: Iterable[str] | None) -> Manifest | None:
                if self._refetch is not None:  # an earlier restore's fetch into RAM
                    self._refetch.join()
                manifest, self._refetch = restore_from_partner(
                    self.link, host, self.node, step, state, keys, ram_root=self.ram.root,
                    in_place=not strict, io_threads=self.ram.store.io_threads)
                return manifest
            return attempt

        def from_disk(state: Mapping[str, Any], keys: Iterable[str] | None) -> Manifest | None:
            if self.disk is None or newest_save_of(step, self.disk.list()) is None:
                return None
            return self.disk.load(state, step=step, keys=keys, strict=True)

        def from_remote(state: Mapping[str, Any], keys: Iterable[str] | None) -> Manifest | None:
            remote = self._remote(self.node)
            if remote is None or newest_save_of(step, remote.list()) is None:
                return None
            return remote.load(state, step=step, keys=keys, strict=True)

        return [("ram", from_ram),
                *((f"partner:n{h}", from_partner(h)) for h in self.partners),
                ("disk", from_disk), ("remote", from_remote)]

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s state object of this node's checkpoint ``manifest``: its own
        (``rank == node``) or node ``rank``'s of the same checkpoint call, from the
        first tier whose copy is verified (:class:`NodeRankReader`)."""
        return self._objects.read(manifest, rank)

    @property
    def rank_objects_from(self) -> dict[int, builtins.list[str]]:
        """The tiers that served each rank's state objects so far."""
        return self._objects.read_from

    # ---------------------------------------------------------------- the rest
    def delete(self, step: int) -> builtins.list[str]:
        return self.ram.delete(step)

    def close(self) -> None:
        """Waits for the save in flight and its copies; the tiers keep their files."""
        self.ram.close()
        self.wait_copies()
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self._uploader is not None:
            self._uploader.stop(join_timeout_s=30)
        for store in [*self._remotes.values(), *([self.disk] if self.disk is not None else [])]:
            store.close()

