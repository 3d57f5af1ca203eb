"""``RamTierStore``: checkpoints in the node's shared memory, under a byte budget.

```python
store = RamTierStore(run="run42", budget_bytes=8 << 30)     # /dev/shm/trainguard/run42
session = TrainingSession(redis_url, dataset="tok", run="run42", store=store)
```

The tier is a :class:`CheckpointStore` whose root is a directory on a memory-backed
file system (tmpfs, e.g. ``/dev/shm``). So it has the FORMAT.md layout, the same
manifest, CRC-32C checksums and commit order (data, then the manifest by exclusive
create, then LATEST) as the disk tiers, and every rule they keep holds here: a save
killed half-way commits nothing. The files belong to the kernel, not to the
process: a trainer restarted on the same node (after a crash, a SIGKILL, a watchdog
exit) loads them without touching a disk. A node's reboot or loss takes them away,
which is what partner copies (``partner.py``) are for.

Memory is bounded: ``budget_bytes`` caps what the tier's files may hold, the
checkpoint being written included. A save that would exceed it, by ``on_full``:

- ``"drop_oldest"``: deletes the oldest unpinned checkpoints until the new one fits;
- ``"wait"``: waits (up to ``full_timeout_s``) until checkpoints may be dropped,
  i.e. until ``may_drop`` allows it (the partner replicator allows a checkpoint once
  its copy is committed on a partner), then drops the oldest of those;

and raises :class:`RamTierFullError` when the state alone exceeds the budget, or when
the wait runs out. Nothing is ever written beyond the budget.

An asynchronous save (``blocking=False``) of CPU tensors copies them straight into the
new checkpoint's files before it returns (``_file_staging``), not into a host buffer:
the staged bytes are the checkpoint once committed, they count in the budget from the
start (room is made for them before the copy), and the node holds one copy of the
state beside the live one. A save killed while staging commits nothing (its files are
debris for ``gc``). CUDA tensors still go through the pinned staging buffer (the
device-to-host copy stays asynchronous).
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from checkpoint_store._wrapped import RankStateWrappedStore
from checkpoint_store.backends import LocalBackend
from checkpoint_store.dist import ONE_PROCESS
from checkpoint_store.flatten import TensorLeaf, flatten
from checkpoint_store.handle import SaveHandle
from checkpoint_store.layout import data_dir
from checkpoint_store.manifest import Manifest
from checkpoint_store.retention import choose_deletions, remove_data, retire
from checkpoint_store.store import DEFAULT_CHUNK_BYTES, CheckpointStore
from trainguard.core.checkpoints import CheckpointError

__all__ = ["MEMORY_FILESYSTEMS", "ON_FULL", "OnFull", "RamTierFullError", "RamTierPolicy", "RamTierStore", "default_ram_root",
           "memory_backed"]

log = logging.getLogger("checkpoint_store.ram_tier")

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
OnFull = Literal["drop_oldest", "wait"]
"""What a save that does not fit the budget does (module doc)."""
ON_FULL: tuple[OnFull, ...] = get_args(OnFull)
# A manifest, LATEST and the skeleton's chunk on top of the tensor bytes.
_OVERHEAD_BYTES = 256 << 10
_NO_LIMIT = 1 << 62


class RamTierFullError(CheckpointError, MemoryError):
    """A checkpoint does not fit the RAM tier's byte budget."""


@dataclass(frozen=True)
class RamTierPolicy:
    """How much the tier may hold and what a save that does not fit does (module doc);
    ``keep_last``/``keep_every`` are the tier's retention."""

    budget_bytes: int
    on_full: OnFull = "drop_oldest"
    full_timeout_s: float = 60.0
    keep_last: int = 2
    keep_every: int | None = None
    overwrite_oldest: bool = False

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, got {self.on_full!r}")
        if self.budget_bytes < 1:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


def default_ram_root(run: str) -> Path:
    """Where a run's RAM tier lives by default: ``$TRAINGUARD_RAM_TIER`` or
    ``/dev/shm/trainguard``, then the run's name."""
    base = os.environ.get("TRAINGUARD_RAM_TIER", "/dev/shm/trainguard")
    return Path(base) / run


def memory_backed(path: str | os.PathLike[str]) -> str | None:
    """The file system type of ``path`` if it is memory-backed (tmpfs, ramfs), else
    None. Read from /proc/mounts: the longest mount point above the path wins."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return None
    for _dev, point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind if kind in MEMORY_FILESYSTEMS else None


def tree_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes held by the files under ``root`` (what the tier costs in memory)."""
    total, dirs = 0, [os.fspath(root)]
    while dirs:  # scandir, not os.walk: each save's budget check walks the tier
        try:
            with os.scandir(dirs.pop()) as entries:
                for e in entries:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            dirs.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # removed by retention while we walked
        except FileNotFoundError:
            continue
    return total


def state_bytes(state: Mapping[str, Any]) -> int:
    """What a save of ``state`` writes, as an upper estimate."""
    leaves, skeleton = flatten(state)
    return written_bytes([leaf for leaf in leaves if leaf.writes], skeleton)


def written_bytes(leaves: Sequence[TensorLeaf], skeleton: bytes) -> int:
    """What a save of these (flattened) leaves writes, as an upper estimate."""
    return (sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves)
            + len(skeleton) + _OVERHEAD_BYTES)


class RamTierStore(RankStateWrappedStore):
    """A :class:`CheckpointStore` in shared memory with a byte budget (module doc).

    ``root`` defaults to :func:`default_ram_root` of ``run``; it must be on a
    memory-backed file system (``require_memory=False`` lifts that, for a tier
    on a node-local disk one wants the same budget on). ``keep_last`` is this tier's
    retention. ``may_drop(name)`` says whether retention or the budget may delete a
    checkpoint yet (default: always); ``on_dropped(names)`` is called after it does.
    The tier is one process's, with torch.distributed or without: in a multi-node job
    each rank has a root of its own (and ``node_tiers`` makes the copies)."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        budget_bytes: int,
        on_full: OnFull = "drop_oldest",
        full_timeout_s: float = 60.0,
        keep_last: int = 2,
        keep_every: int | None = None,
        overwrite_oldest: bool = False,
        require_memory: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int = 4,
    ):
        if root is None:
            if not run:
                raise ValueError("RamTierStore needs root= or run= (the run's name)")
            root = default_ram_root(run)
        self.policy = RamTierPolicy(budget_bytes=budget_bytes, on_full=on_full,
                                    full_timeout_s=full_timeout_s, keep_last=keep_last,
                                    keep_every=keep_every, overwrite_oldest=overwrite_oldest)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if require_memory and memory_backed(self.root) is None:
            raise CheckpointError(
                f"the RAM tier's root {self.root} is not on a memory-backed file system "
                f"({'/'.join(sorted(MEMORY_FILESYSTEMS))}); give a directory under "
                "/dev/shm, or require_memory=False for a tier on disk"
            )
        self.may_drop: Callable[[str], bool] = lambda _name: True
        # Whether nothing reads a dropped checkpoint's chunk files any more, so that the
        # next save may write into their pages (``_page_reuse``); else they are deleted.
        self.may_recycle: Callable[[str], bool] = lambda _name: True
        self.on_dropped: Callable[[builtins.list[str]], None] = lambda _names: None
        # The inner store keeps everything: this class decides what goes.
        # An async save stages straight into the tier's files (``_file_staging``): the
        # staged copy is the checkpoint, inside the budget, and no host buffer holds a
        # second copy of the state.
        self.store = CheckpointStore(self.root, keep_last=_NO_LIMIT, keep_every=keep_every,
                                     chunk_bytes=chunk_bytes, io_threads=io_threads,
                                     process_group=ONE_PROCESS, stage_in_files=True)
        # The budget is checked inside the save, on the state the save flattens anyway.
        self.store.before_stage = lambda leaves, skeleton: self._make_room(
            written_bytes(leaves, skeleton))
        self.url = self.store.url
        self._backend = LocalBackend(str(self.root))
        self._lock = threading.Lock()  # budget decisions and retention, one at a time
        self._freed = threading.Condition(self._lock)
        self._last: SaveHandle | None = None
        self._leftovers: builtins.list[Manifest] = []  # dropped before a save (``_drop``)

    # ---------------------------------------------------------------- budget
    def used_bytes(self) -> int:
        """Bytes the tier's files hold now."""
        return tree_bytes(self.root)

    def _wait_last(self) -> None:
        last = self._last
        if last is not None and not last.done():
            try:
                last.wait()
            except Exception:
                pass  # the inner store raises it on the next save

    def _droppable(self, keep: set[str]) -> builtins.list[Manifest]:
        return [m for m in self.store.list()
                if not m.pinned and m.name not in keep and self.may_drop(m.name)]

    def _make_room(self, need: int) -> None:
        """Drop checkpoints (oldest first, by policy) until ``need`` more bytes fit; the
        pages of what is dropped here are the save's to write into (``_page_reuse``)."""
        if need > self.policy.budget_bytes:
            raise RamTierFullError(
                f"a checkpoint of about {need} bytes does not fit the RAM tier's budget of "
                f"{self.policy.budget_bytes} bytes ({self.root}); raise budget_bytes or checkpoint "
                "to a disk tier"
            )
        deadline = time.monotonic() + self.policy.full_timeout_s
        maps = self.store.chunk_maps
        with self._lock:
            if self.policy.overwrite_oldest:
                self._overwrite_oldest()
            # Spares are the dropped checkpoints' files the save is about to rewrite.
            while (self.used_bytes() - (maps.spare_bytes() if maps else 0) + need
                   > self.policy.budget_bytes):
                victims = self._droppable(set())
                if self.policy.on_full == "drop_oldest" or victims:
                    if not victims:
                        raise self._full(need, "every checkpoint left is pinned or may not be "
                                                 "dropped yet (may_drop)")
                    self._drop([victims[0]], before_save=True)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._full(need, f"none could be dropped within "
                                           f"{self.policy.full_timeout_s} s (on_full='wait')")
                self._freed.wait(min(left, 0.05))

    def _overwrite_oldest(self) -> None:
        """Count the save about to start toward ``keep_last``: drop now what retention
        would drop once it commits, so that it writes into their pages and the tier
        never holds more than ``keep_last`` checkpoints, the one being written included."""
        manifests = self.store.list()
        keep = {m.name for m in manifests[max(0, len(manifests) - self.policy.keep_last + 1):]}
        every = self.policy.keep_every
        doomed = [m for m in manifests if m.name not in keep and not m.pinned
                  and not (every and m.step % every == 0) and self.may_drop(m.name)]
        if doomed:
            self._drop(doomed, before_save=True)

    def _full(self, need: int, why: str) -> RamTierFullError:
        return RamTierFullError(
            f"the RAM tier {self.root} holds {self.used_bytes()} of {self.policy.budget_bytes} bytes "
            f"and the next checkpoint needs about {need}: {why}; raise budget_bytes, unpin "
            "checkpoints, or use on_full='drop_oldest'"
        )

    def _drop(self, doomed: builtins.list[Manifest], *, before_save: bool = False) -> None:
        names = retire(self._backend, doomed)  # from here no reader opens their files
        maps, now = self.store.chunk_maps, builtins.list(doomed)
        for m in doomed:
            if maps is None:
                break
            if before_save and self.may_recycle(m.name) and maps.recycle(data_dir(m.uid)) >= m.nbytes:
                # Every chunk is a spare now; the metadata left is removed off the loop's
                # path, once the save commits (or by gc, if it never does).
                now.remove(m)
                self._leftovers.append(m)
            maps.forget(data_dir(m.uid))
        remove_data(self._backend, now)
        log.info("RAM tier %s dropped %s", self.root, names)
        self.on_dropped(names)

    def notify(self) -> None:
        """Wake a save waiting for room (``may_drop`` may answer differently now)."""
        with self._lock:
            self._freed.notify_all()

    def _retain(self, protect: str) -> None:
        with self._lock:
            manifests = self.store.list()
            doomed = [m for m in choose_deletions(manifests, keep_last=self.policy.keep_last,
                                                  keep_every=self.policy.keep_every)
                      if m.name != protect and self.may_drop(m.name)]
            if doomed:
                self._drop(doomed)

    # ---------------------------------------------------------------- save / load
    def _before_save(self, state: Mapping[str, Any]) -> None:
        """Waits for the save in flight (its bytes count, and its retention runs
        first); the save then makes room in the budget (``before_stage``)."""
        self._wait_last()

    def _after_save(self, handle: SaveHandle) -> None:
        self._last = handle
        handle.add_done_callback(self._on_commit)

    def _on_commit(self, handle: SaveHandle) -> None:
        with self._lock:
            leftovers, self._leftovers = self._leftovers, []
        remove_data(self._backend, leftovers)
        if handle.manifest is not None:
            self._retain(protect=handle.manifest.name)

    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> Manifest | None:
        return self.store.load(state, step=step, keys=keys, strict=strict)

    def delete(self, step: int) -> builtins.list[str]:
        deleted = self.store.delete(step)
        if self.store.chunk_maps is not None:
            self.store.chunk_maps.prune()
        self.notify()
        return deleted

    def close(self) -> None:
        """Waits for the save in flight; the checkpoints stay in shared memory."""
        self.store.close()

    def wipe(self) -> None:
        """Remove the tier's files (the node is being given back; its memory with it)."""
        self.close()
        self._backend.remove_tree("")

    def __repr__(self) -> str:
        return f"RamTierStore({str(self.root)!r}, budget_bytes={self.policy.budget_bytes})"
