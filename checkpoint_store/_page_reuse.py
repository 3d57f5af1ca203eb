"""The RAM tier's chunk files kept mapped, so that a save rewrites pages that exist.

An async RAM-tier save copies the state into chunk files on tmpfs before it returns
(``_file_staging``). Into a new file that copy costs what the kernel charges for new
pages: each 4 KiB page allocated, zeroed and mapped on first touch, 26-29 ms for 64
MiB where a copy into a buffer allocated once takes 3.6 ms (docs/guides/ram-tier.md).
Writing over an existing file's pages with ``pwrite`` still walks the page cache page
by page (9.7 ms), and a new mapping of a populated file faults every page in again.
A shared mapping that stays open across saves does not: once its page-table entries
exist and are writable, a copy into it is a plain memory copy (1.0x a host copy).

So this process keeps each chunk file it sealed mapped (:meth:`ChunkMaps.hold`).
When the RAM tier drops a checkpoint right before a save (its budget, or
``overwrite_oldest``), it retires the manifest first (from there the files are no
checkpoint's) and moves the mapped chunk files aside as spares (:meth:`recycle`);
the save takes a spare of the right size for each chunk and copies into its mapping
(the inode's pages, whatever its name); when every chunk has one (:meth:`claim`), the
renames into the new data directory wait for the writer thread (:meth:`place`), with
the uid and the in-flight marker, so that the caller's thread only copies; otherwise
each spare is renamed, then written (:meth:`write`). The spares live under the
tier's root (``.spare/``), so they count in its budget, and only between the drop and
the save's seal: none is kept between saves.

What this costs: one mapping (and one descriptor, which Python's mmap keeps) per
chunk file of the newest checkpoints, and their page tables (2 MiB per GiB of
state). The mapped pages are the tier's files, not a second copy, but the kernel
counts them in the process's RSS (``RssShmem``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from checkpoint_store.backends import LocalBackend
from trainguard.core.process import pid_alive

__all__ = ["SPARE_DIR", "ChunkMaps", "copy_into"]

SPARE_DIR = ".spare"
"""Under the tier's root: chunk files between the drop of their checkpoint and the save
that rewrites them; ``<pid>-<n>``, so a dead process's are known as debris."""
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault every page in, writable, in one call
_PAGE = mmap.PAGESIZE


def _populate(m: mmap.mmap) -> None:
    """Make every page of ``m`` present and writable now (in the writer's thread), so
    that the next save's copy into it takes no page fault."""
    if len(m) == 0:
        return
    buf = ctypes.c_char.from_buffer(m)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(len(m)),
                        _MADV_POPULATE_WRITE) == 0:
            return
    finally:
        del buf
    for pos in range(0, len(m), _PAGE):  # an older kernel: one write fault a page
        m[pos] = m[pos]


def _close(m: mmap.mmap) -> None:
    # A tensor still viewing the mapping (a copy that raised half-way) keeps it open
    # until it is freed; the file goes either way.
    with contextlib.suppress(BufferError):
        m.close()


def copy_into(m: mmap.mmap, pieces: Sequence[Any]) -> None:
    """``pieces`` one after the other into the mapping ``m``, from its start."""
    # torch's copy, not the mmap's slice assignment: it runs on the intra-op threads,
    # as the host copy it is measured against does (1.5x faster on 2 cores). Each run
    # of writable pieces is one ``torch.cat`` into its place: per piece, a loop's Python
    # (a slice, views, a call) cost 9 us warm and 3-4x that right after a copy of the
    # state has flushed the caches; that is where a save's stall over a plain copy went.
    pos = 0
    dst = torch.frombuffer(m, dtype=torch.uint8)
    run: list[memoryview] = []
    start = 0
    for p in pieces:
        view = memoryview(p).cast("B")
        if view.readonly:  # zeros of the padding and the trailer (torch wants writable)
            _cat_into(dst, start, run)
            m[pos:pos + len(view)] = view
            start = pos + len(view)
        elif len(view):
            run.append(view)
        pos += len(view)
    _cat_into(dst, start, run)
    del dst  # the mapping can be closed once no tensor views it


def _cat_into(dst: torch.Tensor, start: int, run: list[memoryview]) -> None:
    """Copy the pieces of ``run`` end to end into ``dst`` from ``start``; empties it."""
    if not run:
        return
    n = sum(len(v) for v in run)
    # As words where every piece allows it: torch splits a copy by elements, and bytes
    # would split the small ones.
    words = start % 8 == 0 and all(len(v) % 8 == 0 for v in run)
    dtype = torch.int64 if words else torch.uint8
    sources = [torch.frombuffer(v, dtype=dtype) for v in run]
    torch.cat(sources, out=dst[start:start + n].view(dtype))
    run.clear()


class ChunkMaps:
    """This process's open mappings of a tier's chunk files (module doc), by the
    file's path relative to the tier's root. Thread-safe: the seal's I/O threads
    hold files while the caller's thread may recycle or write others."""

    def __init__(self, backend: LocalBackend):
        self._backend = backend
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._spares: dict[int, list[tuple[str, mmap.mmap]]] = {}
        self._serial = 0
        self._remove_dead_spares()

    # -------------------------------------------------------------- after a seal
    def mapped(self, rel: str) -> mmap.mmap | None:
        with self._lock:
            return self._maps.get(rel)

    def hold(self, rel: str, fd: int) -> mmap.mmap:
        """Map the chunk file open at ``fd`` (written whole) and keep the mapping."""
        m = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
        _populate(m)
        with self._lock:
            old = self._maps.pop(rel, None)
            self._maps[rel] = m
        if old is not None:
            _close(old)
        return m

    # -------------------------------------------------------------- drop, then save
    def recycle(self, data_dir: str) -> int:
        """Move the mapped chunk files under ``data_dir`` (a retired checkpoint's)
        aside as spares; returns their bytes. Unmapped files stay for the caller to
        delete with the directory."""
        moved = 0
        with self._lock:
            for rel in [r for r in self._maps if r.startswith(data_dir + "/")]:
                m = self._maps.pop(rel)
                self._serial += 1
                spare = f"{SPARE_DIR}/{os.getpid()}-{self._serial}"
                try:
                    self._move(rel, spare)
                except OSError:
                    _close(m)  # gone or unmovable: deleted with its directory
                    continue
                self._spares.setdefault(len(m), []).append((spare, m))
                moved += len(m)
        return moved

    def _move(self, src_rel: str, dst_rel: str) -> None:
        """Rename a chunk file (a spare aside, or into a save's data directory),
        creating the target's directory only when the rename finds none: a
        ``makedirs`` per file cost a syscall and an exception on the loop's path."""
        src, dst = self._backend.local_path(src_rel), self._backend.local_path(dst_rel)
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)

    def spare_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for group in self._spares.values() for _, m in group)

    def fit(self, sizes: Sequence[int]) -> None:
        """Delete the spares that files of these sizes will not take (before the save
        writes new files: the spares are inside the budget only if they are used)."""
        want: dict[int, int] = {}
        for s in sizes:
            want[s] = want.get(s, 0) + 1
        with self._lock:
            extra = []
            for size, group in self._spares.items():
                keep = want.get(size, 0)
                extra.extend(group[keep:])
                del group[keep:]
        for spare, m in extra:
            _close(m)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._backend.local_path(spare))

    def write(self, rel: str, pieces: Sequence[Any]) -> bool:
        """Write a new chunk file ``rel`` from ``pieces`` into a spare of its size, if
        one is left (renamed into place first, then copied into its mapping); False:
        none, the caller creates the file."""
        size = sum(len(memoryview(p).cast("B")) for p in pieces)
        with self._lock:
            group = self._spares.get(size)
            if not group:
                return False
            spare, m = group.pop()
        self.place([(spare, rel, m)])
        copy_into(m, pieces)
        return True

    def claim(self, sizes: Sequence[int]) -> list[tuple[str, mmap.mmap]] | None:
        """A spare for each of ``sizes``, in order, out of the pool; None, and nothing
        taken, when some size has too few (the caller then writes files as usual)."""
        want: dict[int, int] = {}
        for s in sizes:
            want[s] = want.get(s, 0) + 1
        with self._lock:
            if any(len(self._spares.get(s, ())) < n for s, n in want.items()):
                return None
            return [self._spares[s].pop() for s in sizes]

    def place(self, moves: Sequence[tuple[str, str, mmap.mmap]]) -> None:
        """Rename each claimed spare to its chunk path (``(spare, rel, mapping)``) and
        keep its mapping under that path. A spare that cannot be moved is closed and
        deleted with the rest not yet moved, and the error raised: the save fails,
        and what was moved is its data directory's, debris for ``gc``."""
        for i, (spare, rel, m) in enumerate(moves):
            try:
                self._move(spare, rel)
            except BaseException:
                self.discard([(s, m2) for s, _, m2 in moves[i:]])
                raise
            with self._lock:
                self._maps[rel] = m

    def give_back(self, claimed: Sequence[tuple[str, mmap.mmap]]) -> None:
        """Claimed spares that no save placed (it failed first) return to the pool."""
        with self._lock:
            for spare, m in claimed:
                self._spares.setdefault(len(m), []).append((spare, m))

    def discard(self, claimed: Sequence[tuple[str, mmap.mmap]]) -> None:
        """Close claimed spares and delete their files."""
        for spare, m in claimed:
            _close(m)
            with contextlib.suppress(OSError):
                os.remove(self._backend.local_path(spare))

    # -------------------------------------------------------------- housekeeping
    def forget(self, data_dir: str) -> None:
        """Close the mappings of the files under ``data_dir`` (being deleted): a mapping
        left open would hold a deleted file's pages outside the budget."""
        with self._lock:
            doomed = [self._maps.pop(r) for r in list(self._maps) if r.startswith(data_dir + "/")]
        for m in doomed:
            _close(m)

    def prune(self) -> None:
        """Close the mappings whose files are gone (deleted by another path: ``gc``,
        ``delete``, another process)."""
        with self._lock:
            gone = [r for r in self._maps if not os.path.exists(self._backend.local_path(r))]
            doomed = [self._maps.pop(r) for r in gone]
        for m in doomed:
            _close(m)

    def close(self) -> None:
        self.fit([])
        with self._lock:
            doomed, self._maps = list(self._maps.values()), {}
        for m in doomed:
            _close(m)

    def _remove_dead_spares(self) -> None:
        for name in self._backend.listdir(SPARE_DIR):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._backend.local_path(f"{SPARE_DIR}/{name}"))

