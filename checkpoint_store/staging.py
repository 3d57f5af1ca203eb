"""Host staging buffers, reused across saves.

An asynchronous save copies every tensor into one flat host buffer (pinned when CUDA
is available, so device-to-host copies are asynchronous DMA) and returns; the
background writer reads from the buffer. Only one save is in flight, so one buffer
that grows to the largest state seen is the whole pool: peak extra memory is one copy
of the state, and steady-state saves allocate nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from checkpoint_store.dtypes import raw_view
from checkpoint_store.flatten import TensorLeaf
from checkpoint_store.plan import RankPlan

__all__ = ["BufferPool", "Segment", "Staged", "direct_segments", "tensor_bytes"]

_ALIGN = 4096


@dataclass(frozen=True)
class Segment:
    """``data`` is the content of ``[offset, offset + len(data))`` of array ``array``."""

    array: str
    offset: int
    data: memoryview


@dataclass
class Staged:
    segments: list[Segment]
    ready: torch.cuda.Event | None
    """Set when device-to-host copies were queued; the writer waits on it."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, C-ordered (copies only if not contiguous)."""
    try:
        # One torch call instead of four (a save of 1,000 small tensors spent ~5 us per
        # tensor here). The view keeps the array, and the array the tensor, alive.
        # bfloat16/float8 (no numpy dtype), gradients, conj bits, strided or empty
        # tensors raise and take the general path below.
        return t.numpy().data.cast("B")
    except (TypeError, RuntimeError):
        pass
    flat = raw_view(t).contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def direct_segments(leaves: Sequence[TensorLeaf], plan: RankPlan) -> list[Segment]:
    """Write straight from CPU tensors (blocking save): no staging copy at all."""
    return [
        Segment(p.array, p.offset, tensor_bytes(leaves[p.leaf].tensor))
        for p in plan.placements
        if p.nbytes
    ]


class BufferPool:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.pinned = torch.cuda.is_available()

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # drop the old one first: at most one buffer alive
            size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        return self._buffer

    def stage(self, leaves: Sequence[TensorLeaf], plan: RankPlan) -> Staged:
        """Copy every placed tensor into the buffer. CPU copies are done on return;
        CUDA copies are queued on the current stream and ``ready`` records them, so
        later kernels on that stream cannot change the data before it is copied."""
        with self._lock:
            bases: dict[str, int] = {}
            total = 0
            for layout in plan.arrays:
                bases[layout.path] = total
                total += -(-layout.nbytes // _ALIGN) * _ALIGN
            buf = self._reserve(total)
            segments: list[Segment] = []
            any_cuda = False
            np_buf = buf.numpy()
            for p in plan.placements:
                if not p.nbytes:
                    continue
                src = leaves[p.leaf].tensor
                start = bases[p.array] + p.offset
                dst = buf[start : start + p.nbytes]
                dst_typed = raw_view(dst.view(src.dtype)).view(src.shape)
                if src.is_cuda:
                    any_cuda = True
                    dst_typed.copy_(raw_view(src), non_blocking=True)
                else:
                    dst_typed.copy_(raw_view(src))
                segments.append(
                    Segment(p.array, p.offset, np_buf[start : start + p.nbytes].data)
                )
            ready = None
            if any_cuda:
                ready = torch.cuda.Event()
                ready.record()
            return Staged(segments, ready)
