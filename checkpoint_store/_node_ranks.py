"""Per-rank state objects of a node job's checkpoints, read from whichever tier holds
a verified copy (``NodeTierStore.read_rank_state``).

In a ``NodeTierStore`` job node ``r`` is the session's rank ``r``, and each node's
tiers hold that node's checkpoints only: one store-rank each, so a manifest indexes
one object (``data/<uid>/ranks/0.json``, :mod:`checkpoint_store.rank_state`), the
document the session's rank ``r`` gave ``save(rank_state=...)``. The object travels
with its checkpoint like every other file of it (RAM, partner copies, local disk,
remote), so rank ``r``'s object of a checkpoint is found on node ``r``'s tiers:

- ``r`` is this node: the checkpoint itself, by its manifest's name;
- another node: its *sibling*, node ``r``'s save of the same step written by the same
  ``checkpoint`` call, told by the session record's ``(generation, commit)``
  (:func:`trainguard.core.newest.restore_order`), so a zombie's or an abandoned save
  of that step never answers.

The sources are tried in the restore's tier order (this node: its RAM, its partners'
copies, its disk, remote; node ``o``: o's tier server, RAM then disk, o's partners'
copies, then remote ``n<o>``); the first whose bytes match the digest of *its*
manifest (and the uid, step and rank inside) wins. A damaged, missing or unreachable
one is logged and the next is tried, as the tensor load does; none at all is a
``CorruptCheckpointError``, as a missing object is to the plain store.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpoint_store._copies import SERVED_TIERS, ServedTier
from checkpoint_store._partner_link import PartnerLink
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.rank_state import decode_rank_state, rank_state_path
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError, ManifestView
from trainguard.core.newest import commit_order, restore_order

__all__ = ["NodeRankReader"]

log = logging.getLogger("checkpoint_store.node_tiers")

OWN_RANK = 0
"""The store-rank of a node's part: its tiers are one-process stores."""


@dataclass(frozen=True)
class _Source:
    """One tier that may hold an owner's checkpoints: its committed manifests, and how
    to read the verified object of one of them (None: that save carried none)."""

    where: str
    manifests: Callable[[], builtins.list[Manifest]]
    read: Callable[[Manifest], dict[str, Any] | None]


class NodeRankReader:
    """Reads rank ``r``'s state object of a checkpoint from node ``r``'s tiers
    (module doc). ``hosts(o)`` are the nodes keeping copies of node ``o``;
    ``remote(o)`` its remote tier (None without one)."""

    def __init__(self, *, node: int, ram: CheckpointStore, disk: CheckpointStore | None,
                 link: PartnerLink, hosts: Callable[[int], builtins.list[int]],
                 remote: Callable[[int], CheckpointStore | None]):
        self.node = node
        self.nodes = len(link.urls)
        self._ram, self._disk, self._link = ram, disk, link
        self._hosts, self._remote = hosts, remote
        self.read_from: dict[int, builtins.list[str]] = {}
        """The tiers that served each rank's objects so far (rank -> tier names)."""

    # ---------------------------------------------------------------- sources
    def _local(self, where: str, store: CheckpointStore) -> _Source:
        return _Source(where, store.list, lambda m: store.read_rank_state(m, OWN_RANK))

    def _served(self, host: int, owner: int, tiers: tuple[ServedTier, ...]) -> Iterator[_Source]:
        index = self._link.index(host, owner) or {}  # None: that node is out of reach
        for tier in tiers:
            found: builtins.list[Manifest] = []
            for e in index.get(tier, []):
                try:
                    found.append(parse_manifest(e["name"], e["manifest"].encode("utf-8")))
                except CheckpointError:
                    continue  # a damaged manifest there: that tier does not hold it
            where = f"partner:n{host}" if host != owner else f"n{owner}:{tier}"

            def read(m: Manifest, tier: ServedTier = tier) -> dict[str, Any] | None:
                if m.ranks is None:
                    return None
                raw = self._link.read(host, owner, rank_state_path(m.uid, OWN_RANK), tier=tier)
                return decode_rank_state(raw, name=m.name, index=m.ranks, uid=m.uid,
                                         step=m.step, rank=OWN_RANK)

            yield _Source(where, found.copy, read)

    def _sources(self, owner: int) -> Iterator[_Source]:
        """``owner``'s tiers, in the order a restore tries them; each is asked only
        when the ones before it did not serve (no index is fetched ahead)."""
        if owner == self.node:
            yield self._local("ram", self._ram)
            for host in self._hosts(owner):
                yield from self._served(host, owner, ("ram",))
            if self._disk is not None:
                yield self._local("disk", self._disk)
        else:
            yield from self._served(owner, owner, SERVED_TIERS)
            for host in self._hosts(owner):  # this node among them: its own server's copy
                yield from self._served(host, owner, ("ram",))
        remote = self._remote(owner)
        if remote is not None:
            yield self._local("remote", remote)

    # ---------------------------------------------------------------- reading
    def read(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s document of the checkpoint ``manifest`` (this node's),
        verified; None when that save carried no rank states."""
        if isinstance(manifest, Manifest) and manifest.world_size != 1:
            raise CheckpointError(
                f"checkpoint {manifest.name} was written by {manifest.world_size} processes "
                "into one node's tier; a NodeTierStore's node is one rank (node r = rank r, "
                "each with a RamTierStore of its own)")
        if not 0 <= rank < self.nodes:
            raise IndexError(f"rank {rank} of checkpoint {manifest.name} has no node among "
                             f"the {self.nodes} tier servers of peers: name every node whose "
                             "tiers hold checkpoints, those that left the job too")
        if rank == self.node:
            def wanted(m: Manifest) -> bool:
                return m.name == manifest.name
        else:
            lineage = (manifest.step, restore_order(manifest)[:2])

            def wanted(m: Manifest) -> bool:
                return (m.step, restore_order(m)[:2]) == lineage
        failures: builtins.list[str] = []
        for source in self._sources(rank):
            try:
                candidates = [m for m in source.manifests() if wanted(m)]
            except (CheckpointError, OSError) as e:
                failures.append(f"{source.where}: {e}")
                continue
            for m in sorted(candidates, key=commit_order, reverse=True):
                try:
                    doc = source.read(m)
                except (CheckpointError, OSError) as e:
                    log.warning("node %s: the state object of rank %s of step %s on %s is not "
                                "usable (%s); trying the next tier", self.node, rank,
                                manifest.step, source.where, e)
                    failures.append(f"{source.where}: {e}")
                    continue
                seen = self.read_from.setdefault(rank, [])
                if source.where not in seen:
                    seen.append(source.where)
                return doc
        raise CorruptCheckpointError(
            f"node {self.node}: no tier holds a verified state object of rank {rank} for "
            f"checkpoint {manifest.name} (step {manifest.step}): "
            f"{'; '.join(failures) or 'none of its tiers has that checkpoint'}; the "
            "checkpoint is incomplete: restore an earlier one")
