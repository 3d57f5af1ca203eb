"""Format 4: a multi-rank save's tensor index lives in the ranks' own objects.

A rank's ``arrays`` (chunk sizes, CRCs) and its tensor blocks (where each of its
blocks lies) grow with what that rank saves; in format 3 every rank sent them to rank
0, which merged them into the manifest: O(W) payload into one rank at every commit,
and an O(W) manifest read back by every rank. From format 4 on, a save of several
ranks keeps them in each rank's state object (``data/<uid>/ranks/<r>.json``, version
2, :mod:`checkpoint_store.rank_state`); the manifest keeps the objects' digests.

No rank sees another's entries at commit time. What the commit must still know about
them, that the ranks' blocks agree on each tensor and tile it, is a fixed-size
reduction (:func:`check_blocks`): rank 0 broadcasts the tensor paths of its own
skeleton, and two all-reduces over one slot per path (summed volumes, counts, and the
maximum and minimum of a fingerprint of dtype, shape and layout) give every rank the
same verdict. Its size is set by the state's tensors, never by the world size.

A reader assembles the index on demand (:func:`with_content`): a manifest's
``tensors`` and ``arrays`` then read every rank's object once, verified against the
index, the first time they are used; a listing never reads them. A load reads only
the objects that hold the blocks it needs (:func:`load_content`): at the same world
size its own rank's, and rank 0's for what ranks replicate; every object only when
those do not cover a requested block.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from checkpoint_store._manifest_checks import check_content
from checkpoint_store.backends import Backend
from checkpoint_store.dist import Comm
from checkpoint_store.flatten import TensorRef, decode_skeleton
from checkpoint_store.manifest import Manifest, check_array_names
from checkpoint_store.rank_state import read_rank_doc
from checkpoint_store.reshard import unique_blocks
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError

__all__ = ["RankReads", "check_blocks", "holds_rank_content", "load_content",
           "merge_tensors", "rank_entries", "skeleton_paths", "with_content"]

log = logging.getLogger("checkpoint_store")

_NONE = -(2**63)
"""What a rank that holds no block of a tensor adds to a MAX reduction: nothing."""


def rank_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """A rank's tensor entries as its object stores them (no writer-only fields)."""
    out: dict[str, Any] = {}
    for path, e in entries.items():
        kept = {"dtype": e["dtype"], "shape": e["shape"], "shards": e["shards"]}
        if e.get("layout") is not None:
            kept["layout"] = e["layout"]
        out[path] = kept
    return out


def merge_tensors(per_rank: Sequence[dict[str, Any]], *, whole: bool = True
                  ) -> dict[str, Any]:
    """One entry per tensor with every rank's block; a block several ranks report
    (a replicated ``Shard``) is recorded once, from the lowest rank. ``whole``: the
    blocks are every rank's, so they must tile each tensor (else some ranks' only)."""
    merged: dict[str, Any] = {}
    for entries in per_rank:
        for path, e in entries.items():
            fresh = {"dtype": e["dtype"], "shape": e["shape"], "shards": []}
            if e.get("layout") is not None:
                fresh["layout"] = e["layout"]
            m = merged.setdefault(path, fresh)
            if (m["dtype"], m["shape"], m.get("layout")) != (e["dtype"], e["shape"],
                                                             e.get("layout")):
                raise CheckpointError(
                    f"ranks disagree on tensor {path!r}: {m['dtype']} {m['shape']} "
                    f"{m.get('layout')} vs {e['dtype']} {e['shape']} {e.get('layout')}; every "
                    "rank must save the same global tensors"
                )
            m["shards"].extend(e["shards"])
    for path, m in merged.items():
        if len(m["shards"]) > 1:  # one block is unique as it is (no new list and set)
            m["shards"] = unique_blocks(m["shards"])
        if whole:
            _check_cover(path, sum(math.prod(s["shape"]) for s in m["shards"]),
                         math.prod(m["shape"]))
    return merged


def _check_cover(path: str, covered: int, total: int) -> None:
    # In-bounds blocks (Shard checks that) tile the tensor exactly when their volumes
    # add up to it and none overlaps; a sum that differs means a block is missing or
    # overlaps another, and the loader could not use them.
    if covered != total:
        raise CheckpointError(
            f"the ranks' blocks of tensor {path!r} cover {covered} of its {total} "
            "elements: blocks overlap or are missing; every element must be saved by "
            "exactly one block (a whole-tensor block several ranks hold counts once)"
        )


def skeleton_paths(skeleton: bytes) -> list[str]:
    """Every tensor path the state skeleton references, sorted."""
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, TensorRef):
            found.add(v.path)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(decode_skeleton(skeleton))
    return sorted(found)


def _fingerprint(e: dict[str, Any]) -> int:
    text = json.dumps([e["dtype"], e["shape"], e.get("layout")], sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")  # < 2**56


def check_blocks(comm: Comm, paths: list[str], entries: dict[str, Any] | None) -> str | None:
    """Collective (every rank, with rank 0's ``paths``): the problem with the ranks'
    blocks, the same text on every rank, or None. ``entries``: this rank's tensor
    entries, None when it failed before writing (its blocks then count as none)."""
    slot = {p: i for i, p in enumerate(paths)}
    n = len(paths)
    sums = [0] * (3 * n + 1)  # partial volumes, whole blocks, holders; unknown paths
    maxes = [_NONE] * (4 * n)  # total, -total, fingerprint, -fingerprint
    unknown = ""
    for path, e in (entries or {}).items():
        i = slot.get(path)
        if i is None:
            unknown = unknown or path
            sums[3 * n] += 1
            continue
        total = math.prod(e["shape"])
        for s in e["shards"]:
            if list(s["shape"]) == list(e["shape"]):
                sums[n + i] = 1  # a whole block, counted once per rank
            else:
                sums[i] += math.prod(s["shape"])
        sums[2 * n + i] = 1
        f = _fingerprint(e)
        maxes[i], maxes[n + i] = total, -total
        maxes[2 * n + i], maxes[3 * n + i] = f, -f
    sums = comm.all_reduce_int64(sums, "sum")
    maxes = comm.all_reduce_int64(maxes, "max")
    if sums[3 * n]:
        return (f"{sums[3 * n]} tensor(s) saved by some rank are not in rank 0's state "
                f"(e.g. {unknown!r} on rank {comm.rank})" if unknown else
                f"{sums[3 * n]} tensor(s) saved by some rank are not in rank 0's state") + \
            ": every rank must save the same global tensors"
    for i, path in enumerate(paths):
        if not sums[2 * n + i]:
            continue  # no rank holds a block: as before, no entry
        total = maxes[i]
        if total != -maxes[n + i] or maxes[2 * n + i] != -maxes[3 * n + i]:
            return (f"ranks disagree on tensor {path!r}: its dtype, shape or layout differs "
                    "between the ranks that save it; every rank must save the same global "
                    "tensors")
        covered = sums[i] + (total if sums[n + i] else 0)
        try:
            _check_cover(path, covered, total)
        except CheckpointError as e:
            return str(e)
    return None


def holds_rank_content(manifest: Manifest) -> bool:
    """Whether ``manifest``'s arrays and tensors are in its ranks' objects (format 4,
    several ranks)."""
    return manifest.version >= 4 and manifest.world_size > 1


def _read_object(backend: Backend, manifest: Manifest, r: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank ``r``'s arrays and tensor entries, verified against the index."""
    doc = read_rank_doc(backend, manifest, r)
    a, t = doc.get("arrays"), doc.get("tensors")
    if not isinstance(a, dict) or not isinstance(t, dict) \
            or not all(str(k).startswith(f"r{r}/") for k in a):
        raise CorruptCheckpointError(
            f"the state object of rank {r} of checkpoint {manifest.name} holds no index "
            f"of rank {r}'s arrays and tensors: it is damaged; load an earlier checkpoint")
    check_array_names(manifest.name, a)
    return a, t


def _union(name: str, objects: Sequence[tuple[dict[str, Any], dict[str, Any]]], *,
           whole: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and merged tensors of ``objects`` (in rank order), checked; ``whole``:
    they are every rank's (else each tensor holds only the blocks of those read)."""
    arrays: dict[str, Any] = {}
    for a, _ in objects:
        arrays.update(a)
    try:
        tensors = merge_tensors([t for _, t in objects], whole=whole)
    except (CheckpointError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"checkpoint {name}: the ranks' objects do not "
                                     f"form one index ({e}): load an earlier checkpoint") from e
    check_content(name, arrays, tensors, whole=whole)
    return arrays, tensors


def _load(backend: Backend, manifest: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    return _union(manifest.name, [_read_object(backend, manifest, r)
                                  for r in range(manifest.world_size)])


class _Content:
    """The arrays and tensors of one manifest, read from its ranks' objects once."""

    def __init__(self, load: Callable[[], tuple[dict[str, Any], dict[str, Any]]]):
        self._load: Callable[[], tuple[dict[str, Any], dict[str, Any]]] | None = load
        self._lock = threading.Lock()
        self.value: tuple[dict[str, Any], dict[str, Any]] | None = None

    def get(self) -> tuple[dict[str, Any], dict[str, Any]]:
        with self._lock:
            if self.value is None:
                assert self._load is not None
                self.value = self._load()
                self._load = None  # the backend and manifest are no longer needed
            return self.value


class _Lazy(dict):  # type: ignore[type-arg]
    """A manifest's ``arrays`` or ``tensors``, filled from the ranks' objects on first
    use (a read error raises from that use: CorruptCheckpointError)."""

    def __init__(self, *args: Any, content: _Content | None = None, which: int = 0):
        # Called as dict(...) too (``dataclasses.asdict`` rebuilds a field by its
        # type): then it is a plain, filled dict.
        super().__init__(*args)
        self._content, self._which, self._filled = content, which, content is None

    def _fill(self) -> None:
        if not self._filled:
            assert self._content is not None
            dict.update(self, self._content.get()[self._which])
            self._filled = True

    def __getitem__(self, key: Any) -> Any:
        self._fill()
        return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        self._fill()
        return dict.__contains__(self, key)

    def __iter__(self) -> Iterator[Any]:
        self._fill()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._fill()
        return dict.__len__(self)

    def __eq__(self, other: object) -> bool:
        self._fill()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._fill()
        return dict.__repr__(self)

    def get(self, key: Any, default: Any = None) -> Any:
        self._fill()
        return dict.get(self, key, default)

    def keys(self) -> Any:
        self._fill()
        return dict.keys(self)

    def values(self) -> Any:
        self._fill()
        return dict.values(self)

    def items(self) -> Any:
        self._fill()
        return dict.items(self)

    def copy(self) -> dict[str, Any]:
        self._fill()
        return dict(dict.items(self))

    def __reduce__(self) -> Any:
        # Pickled or deep-copied as the plain dict it stands for (no lock, no backend).
        self._fill()
        return (dict, (dict(dict.items(self)),))


def with_content(backend: Backend, manifest: Manifest) -> Manifest:
    """``manifest`` whose ``arrays`` and ``tensors`` read its ranks' objects from
    ``backend`` when first used (format 4, several ranks); any other as it is."""
    if not holds_rank_content(manifest):
        return manifest
    content = _Content(lambda: _load(backend, manifest))
    return replace(manifest, arrays=_Lazy(content=content, which=0),
                   tensors=_Lazy(content=content, which=1))


def _covered(shards: Sequence[dict[str, Any]], offsets: tuple[int, ...],
             shape: tuple[int, ...]) -> int:
    """Elements of the block ``[offsets, offsets + shape)`` the (unique) ``shards`` hold."""
    total = 0
    for s in shards:
        n = 1
        for a, m, b, k in zip(offsets, shape, s["offsets"], s["shape"]):
            n *= max(0, min(a + m, b + k) - max(a, b))
        total += n
    return total


def _stages(rank: int, world: int, saved: int) -> list[list[int]]:
    """The rank objects a load on ``rank`` of ``world`` reads of a save of ``saved``
    ranks, stage by stage until the blocks it asks for are covered. At the same world
    size its own (each rank its shards: FSDP2, DTensor ``Shard``), at another the
    saved ranks whose share of an evenly split first axis overlaps this rank's
    (FSDP2's ``Shard(0)`` resharded); then rank 0's (the plain tensors only rank 0
    writes, the lowest holder of a replicated block); then all. Guesses, each checked
    (:meth:`_Needed.covering`)."""
    if world == saved:
        first = [rank]
    else:
        first = list(range(rank * saved // world, min(-(-(rank + 1) * saved // world), saved)))
    return [first, [0], list(range(saved))]


class RankReads:
    """What one rank's load needs of a format 4 checkpoint's index: ``arrays`` and
    ``tensors`` hold the entries of the rank objects read so far (the objects of
    ``read``), and grow, stage by stage (:func:`_stages`), when a tensor asked for is
    in none of them or :meth:`covering` finds a requested block not fully covered by
    the blocks found. Never a guess's bytes: a block is read only once the blocks
    found cover every element of it. The last stage reads every object and checks
    the whole index, as :func:`with_content` does."""

    def __init__(self, backend: Backend, manifest: Manifest, rank: int, world_size: int):
        self._backend, self._manifest, self._rank = backend, manifest, rank
        self._stages = iter(_stages(rank, world_size, manifest.world_size))
        self._objects: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.arrays: dict[str, Any] = {}
        self.tensors = _Needed(self)

    @property
    def read(self) -> list[int]:
        """The ranks whose objects were read, ascending."""
        return sorted(self._objects)

    def more(self, why: str) -> bool:
        """Read the next stage's objects (``why``: what the ones read lack); False
        when every object is read already."""
        world = self._manifest.world_size
        for stage in self._stages:
            todo = [r for r in stage if r not in self._objects]
            if not todo:
                continue
            complete = len(self._objects) + len(todo) == world
            if complete and self._objects:
                log.debug("rank %d reads all %d rank objects of %s: %s in those of ranks %s",
                          self._rank, world, self._manifest.name, why, self.read)
            for r in todo:
                self._objects[r] = _read_object(self._backend, self._manifest, r)
            # Merged in rank order, as a full read does: a block several ranks hold
            # comes from the lowest of them, whichever was read first.
            arrays, tensors = _union(self._manifest.name,
                                     [self._objects[r] for r in self.read], whole=complete)
            self.arrays.clear()
            self.arrays.update(arrays)
            dict.clear(self.tensors)
            dict.update(self.tensors, tensors)
            return True
        return False


class _Needed(dict):  # type: ignore[type-arg]
    """:class:`RankReads`' tensor entries: a lookup of a tensor not among them reads on."""

    def __init__(self, reads: RankReads):
        super().__init__()
        self._reads = reads

    def get(self, key: Any, default: Any = None) -> Any:
        while not dict.__contains__(self, key) and self._reads.more(
                f"tensor {key!r} is missing"):
            pass
        return dict.get(self, key, default)

    def __getitem__(self, key: Any) -> Any:
        found = self.get(key, _ABSENT)
        if found is _ABSENT:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def covering(self, path: str, offsets: tuple[int, ...], shape: tuple[int, ...]
                 ) -> dict[str, Any] | None:
        """``path``'s entry once its blocks cover the block ``[offsets, offsets +
        shape)`` or every object is read (then the loader reports what is missing)."""
        entry = self.get(path)
        while entry is not None and _covered(entry["shards"], offsets, shape) \
                < math.prod(shape) and self._reads.more(
                    f"the block of {path!r} at {offsets} of shape {shape} is not covered"):
            entry = dict.get(self, path)
        return entry


_ABSENT: Any = object()


def load_content(backend: Backend, manifest: Manifest, rank: int, world_size: int
                 ) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The ``arrays`` and ``tensors`` a load on ``rank`` of ``world_size`` walks:
    of a format 4 checkpoint of several ranks, those of the rank objects it needs
    (:class:`RankReads`); of any other, the manifest's own."""
    if not holds_rank_content(manifest):
        return manifest.arrays, manifest.tensors
    reads = RankReads(backend, manifest, rank, world_size)
    return reads.arrays, reads.tensors
