"""A partner's copy restored straight from its tier server's HTTP responses.

The copy used to be fetched into the node's RAM root (each file hashed as it came),
then loaded from there (read into buffers, CRC-32C, copied into the state): the
state's bytes crossed memory four times after the socket, and the restore waited for
the whole fetch before the load began. Here each chunk file's response body is
received in pieces of ``_PIECE`` bytes straight into where its bytes belong: the
destination tensors' bytes (the scatter plan of :class:`~checkpoint_store.direct.
DirectLoad`), or, for a target that cannot be read in place and for a strict load,
the staged reader's buffer. A chunk's pieces are CRC-32C'd right after they land,
while still in the CPU cache, and the CRC checked against the chunk's trailer and
the manifest's record of it: the check every tier's load makes of every chunk. The
SHA-256 its sender recorded for the file is not computed again for a chunk: it
checked the same bytes a second time, for 40 % of a restore's CPU (0.05 of 0.13 s
for 64 MiB). Nothing is written to a file or read back on the way. The copy's other
files (the arrays' and groups' metadata, the rank state objects, which no CRC
covers) are fetched and checked against their SHA-256 first, before any byte of the
state changes: a copy with any damaged file is not used, as when copies were
fetched whole.

The copy still comes back into the node's RAM root (the next restore of that
checkpoint needs no network), but after the restore, by a background fetch
(:meth:`PartnerLink.fetch`), so the restore does not wait for tmpfs writes that
can take as long as the transfer itself.

A damaged or cut stream raises :class:`CorruptCheckpointError` (a checksum) or
:class:`PartnerCopyError` (the network): the node's tier store then tries its next
tier. An in-place restore has written bytes of the damaged copy into the state by
then; the next tier reloads every selected tensor (its loads are strict), as the
plain store's fallback does.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, urlsplit

import crc32c as _crc
import torch

from checkpoint_store._copies import PartnerCopyError, ServedTier
from checkpoint_store._partner_link import PartnerLink
from checkpoint_store.backends import Backend
from checkpoint_store.direct import DirectLoad, Piece
from checkpoint_store.flatten import decode_skeleton
from checkpoint_store.layout import data_dir, manifest_path, parse_manifest_name
from checkpoint_store.loading import Applier
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.reader import ChunkReader
from checkpoint_store.zarr_format import CRC_BYTES, check_crc, check_size
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError

__all__ = ["TierSource", "load_from_tier_server", "restore_from_partner"]

log = logging.getLogger("checkpoint_store.partner")

_PIECE = 256 << 10
"""Bytes received and checksummed at a time: small enough to stay in the L2 cache
between the two."""


class TierSource:
    """The read side of a storage backend (``read``, ``read_into``) over one node's
    tier server, for the files of one checkpoint of ``owner``: each file must be one
    of ``digests`` (the copy's files, with the SHA-256 its sender recorded); a small
    file read whole is checked against it, a chunk (``read_into``, ``stream``) by the
    CRC-32C its reader checks against the manifest. Connections are kept alive and
    shared by the reading threads."""

    def __init__(self, link: PartnerLink, node: int, owner: int, name: str,
                 digests: Mapping[str, str], *, tier: ServedTier = "ram"):
        parsed = parse_manifest_name(name)
        if parsed is None:
            raise PartnerCopyError(f"{name!r} is not a manifest name")
        self.url = link.urls[node]
        self.node, self.owner, self.name, self.uid = node, owner, name, parsed.uid
        self.digests = dict(digests)
        self.tier = tier
        self.timeout_s = link.timeout_s
        self.streamed: dict[str, str] = {}
        """Files received whole (rel -> the SHA-256 its sender recorded)."""
        self.received = 0
        """Bytes of file bodies received (each file counts each time it is read)."""
        self._small: dict[str, bytes] = {}  # files read whole, kept for a second reader
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ connections
    def _connect(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        url = urlsplit(self.url)
        return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                          timeout=self.timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------ the Backend read side
    def read(self, path: str) -> bytes:
        """A whole (small) file: an array's ``zarr.json``, a rank's state object."""
        digest = self._digest(path)
        if path in self._small:
            return self._small[path]
        conn = self._connect()
        try:
            resp = self._open(conn, path)
            data = resp.read()
            self._keep(conn, resp)
        except PartnerCopyError:
            conn.close()
            raise  # refused by the server: it says why
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self._lost(path, e) from e
        if hashlib.sha256(data).hexdigest() != digest:
            raise self._damaged(path)
        self._done(path, len(data))
        self._small[path] = data
        return data

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        """The Backend contract: ``parts`` filled in order from the file's start, its
        size returned, nothing read when the sizes differ."""
        return self.stream(path, parts, crc_parts=0)[0]

    def stream(self, path: str, parts: Sequence[Piece], *,
               crc_parts: int) -> tuple[int, int]:
        """``read_into`` that also returns the CRC-32C of the first ``crc_parts``
        parts (a chunk's payload), computed piece by piece as they arrive:
        ``(file size, CRC)``; the caller checks it (or, ``crc_parts=0``, its reader
        checks the CRC of what landed). A part given as a length (a gap: alignment,
        padding, bytes of no claimed tensor) is received into one ``_PIECE``-byte
        scratch buffer, checksummed, and dropped."""
        self._digest(path)  # one of the copy's files, or not read at all
        want = sum(p if isinstance(p, int) else len(p) for p in parts)
        scratch = memoryview(bytearray(min(_PIECE, max(
            (p for p in parts if isinstance(p, int)), default=0))))
        conn = self._connect()
        crc = 0
        try:
            resp = self._open(conn, path)
            length = resp.length if resp.length is not None else -1
            if length != want:
                conn.close()  # the body is left unread: this connection is done
                return length, 0
            for i, part in enumerate(parts):
                size = part if isinstance(part, int) else len(part)
                for pos in range(0, size, _PIECE):
                    piece = (scratch[: min(_PIECE, size - pos)] if isinstance(part, int)
                             else part[pos : pos + _PIECE])
                    _recv_full(resp, piece, path)
                    if i < crc_parts:
                        crc = _crc.crc32c(piece, value=crc)
            self._keep(conn, resp)
        except PartnerCopyError:
            conn.close()
            raise  # refused by the server (it says why), or cut short
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self._lost(path, e) from e
        except BaseException:
            conn.close()
            raise
        self._done(path, want)
        return want, crc

    # ------------------------------------------------------------ helpers
    def _digest(self, path: str) -> str:
        digest = self.digests.get(path)
        if digest is None:
            raise CorruptCheckpointError(
                f"node {self.node}'s copy of {self.name}: file {path} is not among the "
                "files its sender recorded (a damaged or foreign copy); not used")
        return digest

    def _open(self, conn: http.client.HTTPConnection, path: str) -> http.client.HTTPResponse:
        conn.request("GET", f"/v1/raw/{self.owner}/{quote(path)}?tier={self.tier}")
        resp = conn.getresponse()
        if resp.status != 200:
            body = resp.read()
            conn.close()
            try:
                why = json.loads(body).get("error", "")
            except ValueError:
                why = body[:200].decode("utf-8", "replace")
            raise PartnerCopyError(f"node {self.node}'s tier server refused GET {path}: "
                                   f"{resp.status} {why}")
        return resp

    def _keep(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        if resp.will_close:
            conn.close()
            return
        with self._lock:
            self._idle.append(conn)

    def _done(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.streamed[path] = self.digests[path]
            self.received += nbytes

    def _damaged(self, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"node {self.node}'s copy of {self.name}: file {path} differs from the SHA-256 "
            "its sender recorded (a damaged copy); not used")

    def _lost(self, path: str, e: BaseException) -> PartnerCopyError:
        return PartnerCopyError(f"node {self.node}'s tier server {self.url} failed while "
                                f"sending {path} of {self.name}: {e}")


def _recv_full(resp: http.client.HTTPResponse, view: memoryview, path: str) -> None:
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            raise PartnerCopyError(f"the response for {path} ended {len(view) - got} bytes "
                                   "early (the tier server went away?)")
        got += n


class _StreamedDirect(DirectLoad):
    """:class:`DirectLoad` over a :class:`TierSource`: a chunk's CRC is taken piece
    by piece as it arrives instead of in a second pass over its bytes."""

    def __init__(self, source: TierSource, data_dir: str,
                 arrays: Mapping[str, Mapping[str, Any]], *, io_threads: int):
        super().__init__(cast(Backend, source), data_dir, arrays, io_threads=io_threads)
        self.source = source

    def _read_other(self, path: str, pieces: list[Piece], expected_crc: int) -> None:
        trailer = memoryview(bytearray(CRC_BYTES))
        size, crc = self.source.stream(path, [*pieces, trailer], crc_parts=len(pieces))
        payload = sum(p if isinstance(p, int) else len(p) for p in pieces)
        check_size(size, payload + CRC_BYTES, path)
        check_crc(crc, trailer, expected_crc, path)


def load_from_tier_server(link: PartnerLink, node: int, owner: int, name: str,
                          state: Mapping[str, Any], keys: Iterable[str] | None, *,
                          in_place: bool, io_threads: int, tier: ServedTier = "ram",
                          manifest_raw: bytes | None = None) -> tuple[Manifest, TierSource]:
    """Load ``owner``'s checkpoint ``name`` from ``node``'s tier server into ``state``
    (module doc); ``in_place``: straight into its tensors (else every byte is verified
    before the state changes). ``manifest_raw``: its manifest as the server's index
    gave it (else it is fetched; either way it is parsed and checked). Returns the
    manifest and the source (what it received)."""
    digests = link.files(node, owner, name, tier=tier)
    if manifest_raw is None:
        manifest_raw = link.read(node, owner, manifest_path(name), tier=tier)
    manifest = parse_manifest(name, manifest_raw)
    source = TierSource(link, node, owner, name, digests, tier=tier)
    chunks = tuple(f"{data_dir(manifest.uid)}/{a}/" for a in manifest.arrays)
    try:
        for rel in sorted(digests):  # all but the chunks, before the state changes
            if not rel.startswith(chunks) or rel.rsplit("/", 1)[-1] == "zarr.json":
                source.read(rel)
        # The readers use a backend's read side only: read and read_into.
        reader = ChunkReader(cast(Backend, source), data_dir(manifest.uid), manifest.arrays,
                             io_threads=io_threads)
        direct = (_StreamedDirect(source, data_dir(manifest.uid), manifest.arrays,
                                  io_threads=io_threads) if in_place else None)
        applier = Applier(manifest.name, manifest.tensors, reader, direct)
        with torch.no_grad():
            applier.prepare(state, decode_skeleton(manifest.state),
                            list(keys) if keys is not None else None)
            if direct is not None:
                direct.run()
            applier.apply(state)
    finally:
        source.close()
    return manifest, source


def restore_from_partner(link: PartnerLink, node: int, owner: int, step: int,
                         state: Mapping[str, Any], keys: Iterable[str] | None, *,
                         ram_root: Path, in_place: bool, io_threads: int,
                         ) -> tuple[Manifest | None, threading.Thread | None]:
    """Restore ``owner``'s newest save of ``step`` from the copy on ``node`` (None: it
    has none), then fetch that copy into ``ram_root`` in the background unless the
    root holds data of it already. Returns the manifest and the fetch's thread."""
    index = link.index(node, owner) or {}  # None: that node is out of reach
    found = {e["name"]: e["manifest"] for e in index.get("ram", [])
             if (p := parse_manifest_name(e["name"])) is not None and p.step == step}
    if not found:
        return None, None
    name = max(found)
    manifest, _ = load_from_tier_server(link, node, owner, name, state, keys,
                                        in_place=in_place, io_threads=io_threads,
                                        manifest_raw=found[name].encode("utf-8"))
    if (ram_root / data_dir(manifest.uid)).exists():
        return manifest, None

    def fetch() -> None:
        try:
            link.fetch(node, owner, manifest.name, ram_root)
        except (OSError, CheckpointError) as e:
            log.warning("restored %s from node %s, but could not keep its copy in RAM (%s); "
                        "a later restore fetches it again", manifest.name, node, e)

    thread = threading.Thread(target=fetch, daemon=True, name=f"refetch-n{owner}")
    thread.start()
    return manifest, thread
