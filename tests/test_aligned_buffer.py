"""``backends.aligned_buffer``, the buffer a staged load reads each run of chunks into:
private anonymous memory, so the huge-page advice it gives can take effect (shared
anonymous memory is shmem, which the default ``shmem_enabled=never`` keeps on 4 KiB
pages: one fault per 4 KiB of a load)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from checkpoint_store.backends import aligned_buffer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the mapping from /proc/self/maps")


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping holding ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    raise AssertionError(f"no mapping holds {address:#x}")


def test_load_buffer_is_private_zeroed_page_aligned_memory() -> None:
    """A 4 MiB buffer: its mapping is private (``p`` in the permissions, not ``s``),
    anonymous (no file, not /dev/zero's shmem), page-aligned, writable and zeroed."""
    size = 4 << 20
    buf = aligned_buffer(size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    fields = _mapping_of(address).split()
    assert fields[1] == "rw-p", fields
    assert len(fields) == 5, f"an anonymous mapping has no path: {fields}"
    assert address % 4096 == 0
    assert len(buf) == size and bytes(buf[:: 1 << 16]) == bytes(size >> 16)
    buf[size - 1] = 7
    assert buf[size - 1] == 7
