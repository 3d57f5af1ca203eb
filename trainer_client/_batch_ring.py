"""A DataLoader worker's batches in a shared-memory ring that the main process maps once.

torch moves a worker's batch tensor to the main process by putting its storage in a
new shared-memory segment, handing the segment's file descriptor over a Unix socket
(a connection to the worker's resource-sharer thread per batch) and mapping it afresh
in the main process; the segment is unmapped when the batch dies. Per ~1 MiB batch
that is a segment created, faulted in, passed and torn down.

Here each worker process keeps one ring of preallocated slots in a ``memfd``. The
worker copies a batch's record payloads straight from the Redis reply into a free
slot; the batch that crosses to the main process carries only ``(ring, slot, shape,
dtype)``, and the main process maps the ring once (its descriptor travels with the
first batches, until the main process says it has it) and views the slot in place:
no copy, no new segment, no descriptor per batch.

Contract of a slot (what keeps a batch from being overwritten while held):

- a slot's state byte (in the ring's header) is set by the worker when it fills the
  slot, and cleared by the main process when the last tensor viewing the slot is
  freed (a finalizer on the NumPy array under the tensor: views, slices and ``pin_memory``
  sources all keep it alive);
- the worker only fills a slot whose state is clear; when none is (the training loop
  holds more batches than the ring has slots, or the main process died), it builds the
  batch the way torch does (a fresh shared tensor), so holding batches never blocks or
  corrupts anything: it only loses the ring's speed.

A batch that never reaches the main process (a worker killed mid-send) leaves its slot
set; the ring then has one slot less for the rest of that worker's life.

States are single bytes written by one side and cleared by the other; the payload is
written before the batch is sent through a pipe (a system call, so a full barrier), and
read before the state is cleared, so no lock is needed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from trainguard.core.process import pid_alive

__all__ = ["RING_SLOTS", "Slot", "claim", "is_ring_tensor", "reduce_data", "slot_of", "stats"]

RING_SLOTS = 12
"""Slots per worker ring: DataLoader's default prefetch (2 per worker) plus the batch
being built, the one the pin-memory thread holds and those a training loop keeps (the
current one, a previous one for logging), with room to spare."""

_HEADER = 4096
"""Header: the attached flag at byte 0, the slots' state bytes from byte 64. The
slots start page-aligned after it."""
_ATTACHED = 0
_STATE = 64
_ALIGN = 4096
_FREE, _HELD = 0, 1
_ATTR = "_trainguard_ring_slot"
_VIEW_ATTR = "_trainguard_ring_view"


@dataclass(frozen=True)
class Slot:
    """Where a worker batch lives: ring, slot index, and the tensor's layout."""

    ring: str
    index: int
    offset: int
    shape: tuple[int, ...]
    dtype: str


class _Ring:
    """The worker side: one memfd of ``slots`` slots of ``slot_bytes`` each."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.slots = slots
        self.pid = os.getpid()
        self.name = f"{self.pid}-{secrets.token_hex(6)}"
        self.fd = os.memfd_create(f"trainguard-batches-{self.name}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, _HEADER + slots * self.slot_bytes)
        self.mm = mmap.mmap(self.fd, _HEADER + slots * self.slot_bytes)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = self.buf.ctypes.data

    def attached(self) -> bool:
        return self.mm[_ATTACHED] != 0

    def claim(self) -> int | None:
        i = self.mm.find(b"\x00", _STATE, _STATE + self.slots)
        if i < 0:
            return None
        self.mm[i] = _HELD
        return i - _STATE


_rings: dict[int, _Ring] = {}
"""This worker's rings by slot size (one per batch size in practice)."""
_by_name: dict[str, _Ring] = {}
_stats = {"ring": 0, "fallback": 0}


def claim(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised tensor in a free ring slot of this worker, or None when no slot
    is free (build the batch another way). Only for DataLoader workers."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return None
    size = -(-nbytes // _ALIGN) * _ALIGN
    ring = _rings.get(size)
    if ring is None or ring.pid != os.getpid():  # a ring inherited through fork is not ours
        ring = _rings[size] = _Ring(size, RING_SLOTS)
        _by_name[ring.name] = ring
    index = ring.claim()
    if index is None:
        _stats["fallback"] += 1
        return None
    _stats["ring"] += 1
    offset = _HEADER + index * ring.slot_bytes
    t = torch.from_numpy(ring.buf[offset : offset + nbytes]).view(dtype).view(shape)
    # Plain data on the tensor (pickle and copy carry it along harmlessly): what
    # counts is that the tensor's memory is the slot's, checked by _owned.
    setattr(t, _ATTR, Slot(ring.name, index, offset, tuple(shape), str(dtype)))
    return t


def _owned(t: Any) -> tuple[_Ring, Slot] | None:
    """The ring and slot whose memory ``t`` is; None for any other tensor (a copy of
    a ring tensor carries its attribute, not its memory)."""
    slot = getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None
    ring = _by_name.get(slot.ring) if slot is not None else None
    if ring is None or slot is None or ring.pid != os.getpid():
        return None
    if t.data_ptr() != ring.base + slot.offset or tuple(t.shape) != slot.shape:
        return None
    return ring, slot


def is_ring_tensor(t: Any) -> bool:
    return _owned(t) is not None


def stats() -> dict[str, int]:
    """Batches this process built in a ring slot and beside it (no slot free)."""
    return dict(_stats)


def reduce_data(data: Any) -> Any:
    """What crosses to the main process in place of ``data``: a slot's handle for a
    tensor in a ring slot, ``data`` itself otherwise."""
    got = _owned(data)
    if got is None:
        return data
    ring, slot = got
    # The descriptor goes with every batch until the main process says it mapped the
    # ring: batches of one worker arrive in order, so the first one always has it.
    return _Handle(slot, None if ring.attached() else DupFd(ring.fd))


class _Handle:
    """A slot in transit; unpickles into the tensor viewing it."""

    def __init__(self, slot: Slot, fd: Any) -> None:
        self.slot = slot
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (self.slot, self.fd))


_mapped: dict[str, mmap.mmap] = {}
"""Main process: rings mapped so far, by name. A ring is dropped from here once its
worker has exited (it sends nothing more); tensors still viewing it keep it mapped."""


def _worker_alive(name: str) -> bool:
    return pid_alive(int(name.split("-", 1)[0]))


def _map(slot: Slot, fd: Any) -> mmap.mmap:
    mm = _mapped.get(slot.ring)
    if fd is not None:
        own = fd.detach()  # always taken, so the worker's sharer lets go of it
        try:
            if mm is None:
                for name in [n for n in _mapped if not _worker_alive(n)]:
                    del _mapped[name]
                mm = _mapped[slot.ring] = mmap.mmap(own, 0)
                mm[_ATTACHED] = 1
        finally:
            os.close(own)
    if mm is None:
        raise RuntimeError(
            f"batch ring {slot.ring!r} is not mapped in this process: its batches were "
            "expected through one DataLoader, in order, first batch first"
        )
    return mm


def _release(mm: mmap.mmap, index: int) -> None:
    with contextlib.suppress(ValueError):  # the mapping is being torn down at exit
        mm[_STATE + index] = _FREE


def _attach(slot: Slot, fd: Any) -> torch.Tensor:
    mm = _map(slot, fd)
    dtype = getattr(torch, slot.dtype.removeprefix("torch."))
    nbytes = torch.empty(0, dtype=dtype).element_size()
    for n in slot.shape:
        nbytes *= n
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=slot.offset)
    # The slot is free again once the last tensor viewing it is gone.
    weakref.finalize(arr, _release, mm, slot.index)
    t = torch.from_numpy(arr).view(dtype).view(slot.shape)
    setattr(t, _VIEW_ATTR, (slot.ring, slot.index))
    return t


def slot_of(t: Any) -> tuple[str, int] | None:
    """Main process: the (ring, slot) a batch tensor views, None when it is no ring
    slot's (a batch built beside the ring, or in this process)."""
    return getattr(t, _VIEW_ATTR, None) if isinstance(t, torch.Tensor) else None
