"""Storage ports: a handful of primitives over a local directory or any fsspec URL.

All paths are relative to the checkpoint root and use ``/``. The local backend talks
to the OS directly so that every file and directory is fsync'd (zarr's and fsspec's
local stores do not fsync); the fsspec backend serves object stores and ``memory://``,
where a finished PUT is durable and ``exclusive_create`` is a conditional write
(``If-None-Match: *`` via mode ``"xb"``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import shutil
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlparse

from checkpoint_store import _faults
from checkpoint_store.layout import TMP_PREFIX
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["Backend", "FsspecBackend", "LocalBackend", "aligned_buffer", "open_backend",
           "open_chunk"]

Buffer = bytes | bytearray | memoryview


class Backend(Protocol):
    """What the store needs from storage. Call order of a save: ``write_file`` for
    every data file, ``sync_dirs`` for their directories, ``exclusive_create`` for the
    manifest (the commit point), ``replace`` for LATEST."""

    url: str

    def write_file(self, path: str, pieces: Sequence[Buffer]) -> None:
        """Create ``path`` (must not exist) from ``pieces``; durable on return."""

    def sync_dirs(self, paths: Sequence[str]) -> None:
        """Make the entries of these directories durable (no-op on object stores)."""

    def exclusive_create(self, path: str, data: bytes) -> None:
        """Publish a complete file under ``path``; FileExistsError if it exists."""

    def replace(self, path: str, data: bytes) -> None:
        """Atomically set the whole content of ``path`` (overwrite allowed)."""

    def read(self, path: str) -> bytes: ...

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        """Fill ``parts``, in order, with the file's bytes from its start and return
        the file's size. Nothing is read when the size differs from the parts' total
        (the caller reports the damage), so a chunk lands in the caller's buffer
        without an intermediate copy."""

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``; empty if it does not exist."""

    def mtime(self, path: str) -> float | None: ...

    def remove(self, path: str) -> None:
        """Remove a file; missing is fine."""

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything under it; missing is fine."""


def aligned_buffer(size: int) -> memoryview:
    """A writable, page-aligned (so 64-byte aligned) buffer of zeros. Anonymous memory
    asks for huge pages: filling a fresh buffer of hundreds of MiB otherwise costs one
    page fault per 4 KiB, a large part of a load's time. Private, not ``mmap``'s
    default shared mapping: anonymous shared memory is shmem, which takes huge pages
    only where ``shmem_enabled`` says so (by default never), so the advice did
    nothing and a 32 MiB chunk paid 8,192 faults."""
    if size == 0:
        return memoryview(bytearray())
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(m)


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


_IOV_MAX = 512
"""Pieces per ``writev``: a chunk of a packed array has one piece per small tensor
(and one per alignment gap), and a syscall per piece costs as much as its bytes."""


def _write_pieces(fd: int, pieces: Sequence[Buffer]) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        while n and i < len(views):  # drop what was written; a short write resumes
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


class LocalBackend:
    """A local directory; every write is fsync'd, directories included."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def local_path(self, path: str) -> str:
        """The OS path of ``path`` (for readers that use the file descriptor)."""
        return self._abs(path)

    def _makedirs(self, dirpath: str) -> None:
        """Create missing parents and fsync each new entry's parent directory, so a
        directory created for a save survives a power cut along with its files."""
        missing: list[str] = []
        d = dirpath
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d)
            _fsync_dir(os.path.dirname(d))

    def write_file(self, path: str, pieces: Sequence[Buffer]) -> None:
        full = self._abs(path)
        self._makedirs(os.path.dirname(full))
        fd = os.open(full, _CREATE_FLAGS, 0o644)
        try:
            _write_pieces(fd, pieces)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dirs(self, paths: Sequence[str]) -> None:
        for p in paths:
            _fsync_dir(self._abs(p))

    def _write_temp(self, path: str, data: bytes, *, phase: str | None) -> str:
        full = self._abs(path)
        directory = os.path.dirname(full)
        self._makedirs(directory)
        # A random part, and a create that neither reuses an existing file nor follows a
        # planted symlink; the pid stays last (gc reads it to spare live writers).
        tmp = os.path.join(
            directory, f"{TMP_PREFIX}{os.path.basename(full)}.{secrets.token_hex(8)}.{os.getpid()}"
        )
        fd = os.open(tmp, _CREATE_FLAGS, 0o644)
        try:
            half = len(data) // 2
            _write_all(fd, data[:half])
            if phase is not None:
                os.fsync(fd)
                _faults.reached(phase)
            _write_all(fd, data[half:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def exclusive_create(self, path: str, data: bytes) -> None:
        # link() refuses an existing target, so the complete file appears under its
        # final name at once or not at all; the temp name is then dropped.
        full = self._abs(path)
        tmp = self._write_temp(path, data, phase="mid-manifest")
        try:
            os.link(tmp, full)
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(full))

    def replace(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        tmp = self._write_temp(path, data, phase=None)
        os.replace(tmp, full)
        _fsync_dir(os.path.dirname(full))

    def read(self, path: str) -> bytes:
        with open(self._abs(path), "rb") as f:
            return f.read()

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        fd = open_chunk(self._abs(path))
        try:
            size = os.fstat(fd).st_size
            if size != sum(len(p) for p in parts):
                return size
            pos = 0
            for part in parts:
                got = 0
                while got < len(part):
                    n = os.preadv(fd, [part[got:]], pos + got)
                    if n == 0:
                        # Shrunk since fstat: report the size actually read.
                        return pos + got
                    got += n
                pos += got
            return size
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except FileNotFoundError:
            return []

    def mtime(self, path: str) -> float | None:
        try:
            return os.stat(self._abs(path)).st_mtime
        except FileNotFoundError:
            return None

    def remove(self, path: str) -> None:
        full = self._abs(path)
        try:
            os.unlink(full)
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(full))

    def remove_tree(self, path: str) -> None:
        full = self._abs(path)
        shutil.rmtree(full, ignore_errors=False, onerror=_ignore_missing)
        with contextlib.suppress(FileNotFoundError):
            _fsync_dir(os.path.dirname(full))


def _ignore_missing(func: Any, path: str, exc_info: Any) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def open_chunk(full: str) -> int:
    """A chunk file opened for reading, never through a symlink: a link planted in a
    save's data directory must not let a reader (``/verify``) report on another file.
    Raises CorruptCheckpointError for a link, FileNotFoundError for a missing file."""
    try:
        return os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise CorruptCheckpointError(
            f"{os.path.basename(full)} in a checkpoint's data directory is a symbolic link, "
            "which no save writes: the checkpoint is damaged or tampered with; load an "
            "earlier one") from None


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""Create a new file only: never an existing one, never through a symlink."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecBackend:
    """Any fsspec filesystem (s3://, gs://, memory://, ...). A finished write is one
    PUT, durable and atomic; directories do not exist, so ``sync_dirs`` is a no-op."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write_file(self, path: str, pieces: Sequence[Buffer]) -> None:
        with self.fs.open(self._abs(path), "wb") as f:
            for piece in pieces:
                f.write(piece)

    def sync_dirs(self, paths: Sequence[str]) -> None:
        return None

    def exclusive_create(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        try:
            with self.fs.open(full, "xb") as f:
                half = len(data) // 2
                f.write(data[:half])
                # A crash here aborts the upload: nothing appears under the name.
                _faults.reached("mid-manifest")
                f.write(data[half:])
        except FileExistsError:
            raise
        except OSError as e:
            if _is_precondition_failed(e):
                raise FileExistsError(errno.EEXIST, f"{full} already exists") from e
            raise
        self._invalidate(full)

    def replace(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        self.fs.pipe_file(full, data)
        self._invalidate(full)

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(self._abs(path)))

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        raw = memoryview(self.fs.cat_file(self._abs(path)))
        if len(raw) == sum(len(p) for p in parts):
            pos = 0
            for part in parts:
                part[:] = raw[pos : pos + len(part)]
                pos += len(part)
        return len(raw)

    def listdir(self, path: str) -> list[str]:
        full = self._abs(path)
        self._invalidate(full)
        try:
            entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def mtime(self, path: str) -> float | None:
        try:
            info = self.fs.info(self._abs(path))
        except FileNotFoundError:
            return None
        for key in ("LastModified", "mtime", "created"):
            value = info.get(key)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            return float(value)
        return None

    def remove(self, path: str) -> None:
        full = self._abs(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(full)
        self._invalidate(full)

    def remove_tree(self, path: str) -> None:
        full = self._abs(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(full, recursive=True)
        self._invalidate(full)

    def _invalidate(self, path: str) -> None:
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(path)


def _is_precondition_failed(e: BaseException) -> bool:
    # s3fs maps HTTP 412 to an OSError whose args carry the botocore error; walk the
    # cause chain for an error code instead of matching message text.
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def open_backend(url: str, storage_options: dict[str, Any] | None = None) -> Backend:
    """``file:///abs/path`` or a plain path -> :class:`LocalBackend`; any other
    protocol -> :class:`FsspecBackend`."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URL must be file:///abs/path, got {url!r}")
            return LocalBackend(parsed.path)
        return LocalBackend(url)
    return FsspecBackend(url, storage_options)
