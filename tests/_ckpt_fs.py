"""A real fsspec filesystem for fault tests: in-memory, with a byte limit that raises
ENOSPC part-way through a write (like a full disk), and an optional gate that holds
every write until the test opens it (a slow store, to catch a save in flight)."""

from __future__ import annotations

import errno
import io
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

PROTOCOL = "tglimited"


class _LimitedWriter(io.BytesIO):
    def __init__(self, fs: LimitedMemoryFS, path: str):
        super().__init__()
        self.fs, self.path = fs, path

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        limit = self.fs.limit_bytes
        if limit is not None and self.fs.stored_bytes() + self.tell() + n > limit:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return super().write(data)

    def close(self) -> None:
        if not self.closed:
            # Published only when complete, like an object-store PUT.
            self.fs.store[self.path] = MemoryFile(self.fs, self.path, self.getvalue())
        super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            super().close()  # an aborted upload leaves nothing behind
        else:
            self.close()


class LimitedMemoryFS(MemoryFileSystem):
    protocol = PROTOCOL

    def __init__(self, *args: Any, limit_bytes: int | None = None,
                 gate: threading.Event | None = None, **kwargs: Any):
        super().__init__(*args, global_store=False, **kwargs)
        self.limit_bytes = limit_bytes
        self.gate = gate

    def stored_bytes(self) -> int:
        return sum(f.getbuffer().nbytes for f in self.store.values())

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode in ("wb", "xb"):
            path = self._strip_protocol(path)
            if mode == "xb" and self.exists(path):
                raise FileExistsError(path)
            if self.gate is not None and not self.gate.wait(timeout=120):
                raise TimeoutError("the test never opened the write gate")
            writer = _LimitedWriter(self, path)
            if kwargs.get("data") is not None:
                # MemoryFileSystem.pipe_file hands the whole content to open().
                writer.write(kwargs["data"])
                writer.close()
            return writer
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(PROTOCOL, LimitedMemoryFS, clobber=True)


def limited_store_options(**kwargs: Any) -> dict[str, Any]:
    return {"skip_instance_cache": True, **kwargs}


def can_mount_tmpfs(tmp_path: Path) -> bool:
    """Whether this machine lets an unprivileged user namespace mount a tmpfs (the real
    full disk of the ENOSPC tests): a probe mount under ``tmp_path``."""
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    result = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
        capture_output=True, timeout=30,
    )
    return result.returncode == 0
