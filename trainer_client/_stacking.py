"""Decoding and stacking: a batch's entries, straight from the Redis reply, into the
tensor or the list of records the training loop receives.

Works on the flat field lists redis-py returns (``[name, value, name, value, ...]``),
never on a dict per entry: per-entry Python work is what a fast read path cannot
afford.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trainguard.core import streams

__all__ = ["Segment", "decode_records", "positions", "shared_empty", "stack_arrays", "take"]

Segment = tuple[int, list[str], list[list[bytes]]]
"""Consecutive entries of one partition: ``(partition, IDs, flat field lists)``, the
flat lists exactly as Redis sent them (``[name, value, name, value, ...]``)."""


def _fields(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    it = iter(flat)
    return dict(zip(it, it))



def decode_records(flats: list[list[bytes]]) -> list[Any]:
    """Each entry decoded by the stream contract (bytes, msgpack value or NumPy view)."""
    return [streams.decode_record(_fields(f)) for f in flats]


def positions(flats: list[list[bytes]]) -> list[str] | None:
    """Each entry's source position (``pos`` field), or None when any has none.

    Entries of one source share their field layout: one C-level pass checks that
    ``pos`` sits where the first entry has it, else each entry is looked up."""
    first = flats[0]
    names = first[0::2]
    if streams.F_POS not in names:
        return None
    at = 2 * names.index(streams.F_POS)
    if list(map(operator.itemgetter(at), flats)).count(streams.F_POS) == len(flats):
        return list(map(bytes.decode, map(operator.itemgetter(at + 1), flats)))
    found = [_fields(f).get(streams.F_POS) for f in flats]
    return None if None in found else [b.decode() for b in found if b is not None]


def take(segments: deque[Segment], n: int) -> list[Segment]:
    """The first ``n`` entries of ``segments`` (removed from it), still in segments."""
    out: list[Segment] = []
    while n > 0:
        p, ids, flats = segments.popleft()
        if len(ids) > n:
            segments.appendleft((p, ids[n:], flats[n:]))
            ids, flats = ids[:n], flats[:n]
        out.append((p, ids, flats))
        n -= len(ids)
    return out


def _nd_layout(first: list[bytes]) -> tuple[int, Callable[[Any], Any], tuple[bytes, ...]] | None:
    """Where an ``nd`` record keeps its payload, and what every entry of a stackable
    batch must share with ``first`` (field names in order, kind, dtype, shape), as a
    getter and its value; None when ``first`` is no ``nd`` record with unique names."""
    names = first[0::2]
    if len(first) % 2 or len(set(names)) != len(names):
        return None
    where = {name: 2 * i + 1 for i, name in enumerate(names)}
    if not {streams.F_KIND, streams.F_DATA, streams.F_DTYPE} <= where.keys():
        return None
    if first[where[streams.F_KIND]] != streams.KIND_NDARRAY:
        return None
    shared = [*range(0, len(first), 2), where[streams.F_KIND], where[streams.F_DTYPE]]
    if streams.F_SHAPE in where:
        shared.append(where[streams.F_SHAPE])
    get = operator.itemgetter(*shared)
    return where[streams.F_DATA], get, get(first)


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory from the start. ``share_memory_()`` on a
    fresh tensor would allocate it twice and copy the garbage across (and for a ~1 MiB
    batch that costs as much as filling it); a DataLoader worker's batch then reaches
    the main process without torch copying it into shared memory when it pickles it."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None or nbytes == 0:  # not in every torch: the plain way
        return torch.empty(shape, dtype=dtype).share_memory_()
    storage: torch.UntypedStorage = new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def stack_arrays(flats: list[list[bytes]], in_worker: bool) -> torch.Tensor | None:
    """One tensor for same-shaped NumPy records, or None when they are not all that.

    Works on the flat field lists straight from the reply (no dict per entry): one
    C-level pass checks that every entry has the first one's field names, kind, dtype
    and shape; the payloads are then copied once, by one join, into the tensor's
    memory. A DataLoader worker copies them into shared memory instead, so the trip
    to the main process copies nothing more."""
    first = flats[0]
    layout = _nd_layout(first)
    if layout is None:
        return None
    data_at, shared, expected = layout
    if set(map(len, flats)) != {len(first)} or list(map(shared, flats)).count(expected) != len(flats):
        return None
    names = first[0::2]
    dt = first[2 * names.index(streams.F_DTYPE) + 1]
    sh = first[2 * names.index(streams.F_SHAPE) + 1] if streams.F_SHAPE in names else b""
    dtype = np.dtype(dt.decode())
    shape = tuple(int(n) for n in sh.decode().split(",")) if sh else ()
    try:
        tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):  # no torch dtype (object, non-native byte order)
        return None
    step = dtype.itemsize * math.prod(shape)
    payloads = list(map(operator.itemgetter(data_at), flats))
    sizes = set(map(len, payloads))
    if sizes != {step}:
        bad = next(s for s in sizes if s != step)
        raise streams.ContractError(
            f"record of {bad} bytes does not match its dtype {dtype} and shape {shape}"
        )
    n = len(payloads)
    if step == 0:  # zero-sized records: nothing to copy (and no byte view exists)
        return torch.empty((n, *shape), dtype=tdtype)
    if in_worker:
        out = shared_empty((n, *shape), tdtype)
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        for i, data in enumerate(payloads):
            view[i * step : (i + 1) * step] = data
        return out
    # The joined bytearray is the tensor's memory (torch keeps it alive): one copy.
    return torch.frombuffer(bytearray().join(payloads), dtype=tdtype).view(n, *shape)

