"""A push body on its way to a decode worker, written as it arrives into an anonymous
in-memory file (:class:`SpooledBody`) whose descriptor the worker receives: the
body's bytes are never one buffer of the service's.

Why: a body read into a ``bytearray`` of its ``Content-Length`` cost the event loop
one step of O(body) work before its first byte (12 MiB allocated and zeroed: 8-10 ms
of CPU in a steps log beside the 12 MiB bombs, up to 24 ms at load), and then its
copy into the worker's pipe. Here each chunk is one ``write`` of that chunk into the
file (the kernel takes the pages as they fill), the worker gets the file itself over
a Unix socket (``SCM_RIGHTS``), and the service closes its descriptor as soon as it
is sent: the worker holds the last one, so freeing the pages (2-3 ms for 12 MiB) is
the worker's work too, not the loop's.

The file is a ``memfd`` (Linux), else an unlinked temporary file: nothing is left
behind when the service or the worker is killed.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["SpooledBody"]


def _anonymous_fd() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("trainguard-push-body", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as f:  # macOS: unlinked at once, only the fd stays
        return os.dup(f.fileno())


class SpooledBody:
    """A body's bytes in an anonymous file, appended a chunk at a time."""

    def __init__(self) -> None:
        self._fd: int | None = _anonymous_fd()
        self.size = 0

    @classmethod
    def of(cls, data: bytes | bytearray) -> SpooledBody:
        """A small body already in memory (at most ``inline_bytes`` reach the pool so)."""
        spool = cls()
        spool.write(data)
        return spool

    def __len__(self) -> int:
        return self.size

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("the spooled body was closed (handed to a worker already)")
        return self._fd

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk``: the loop's work is this chunk's copy into the kernel, no more."""
        fd = self.fileno()
        with memoryview(chunk) as view:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        self.size += len(chunk)

    def close(self) -> None:
        """Drop the service's descriptor (again: nothing). Once the worker has its own,
        the pages go with the worker's."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
