"""The client side of the tier servers (``partner.py``): send a copy, read an index,
fetch a copy back. Standard library HTTP only, one short request per file."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from checkpoint_store import _faults
from checkpoint_store._copies import (
    PartnerCopyError,
    ServedTier,
    checkpoint_file_names,
    clear_staging,
    commit_staged,
    sha256_bytes,
    staged_path,
)
from checkpoint_store.layout import manifest_path, parse_manifest_name

__all__ = ["SEND_PIECE_BYTES", "PartnerLink"]

log = logging.getLogger("checkpoint_store.partner")
SEND_PIECE_BYTES = 1 << 20
"""What a send reads and sends at a time: a copy never holds a whole chunk file."""


def _early_answer(conn: http.client.HTTPConnection, node: int,
                  path: str) -> PartnerCopyError | None:
    """The refusal a server sent before it stopped reading a PUT's body, if any."""
    if conn.sock is None:  # never connected: nothing was answered
        return None
    try:
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException):
        return None
    return None if resp.status == 200 else _refusal(node, "PUT", path, resp.status, data)


def _refusal(node: int, method: str, path: str, status: int, data: bytes) -> PartnerCopyError:
    try:
        why = json.loads(data).get("error", "")
    except ValueError:
        why = data[:200].decode("utf-8", "replace")
    return PartnerCopyError(f"node {node}'s tier server refused {method} {path}: {status} {why}")


class PartnerLink:
    """Talks to the tier servers of a job's nodes (``urls[r]`` serves node ``r``)."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 30.0):
        self.urls = list(urls)
        self.timeout_s = timeout_s

    def _request(self, node: int, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> bytes:
        url = urlsplit(self.urls[node])
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                          timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
        except OSError as e:
            raise PartnerCopyError(f"node {node}'s tier server {self.urls[node]} is out of "
                                   f"reach ({method} {path}: {e})") from e
        finally:
            conn.close()
        if resp.status != 200:
            raise _refusal(node, method, path, resp.status, data)
        return data

    # ---------------------------------------------------------------- sending
    def send(self, to: int, owner: int, root: str | os.PathLike[str], name: str) -> None:
        """Copy committed checkpoint ``name`` of ``owner`` (its tier at ``root``) to node
        ``to``: every file, then the commit. A sender that dies half-way leaves only
        staged files there, which nothing reads."""
        parsed = parse_manifest_name(name)
        if parsed is None:
            raise PartnerCopyError(f"{name!r} is not a manifest name")
        base = Path(root)
        manifest = (base / manifest_path(name)).read_text("utf-8")
        files: dict[str, str] = {}
        piece = memoryview(bytearray(SEND_PIECE_BYTES))  # the sender's whole buffer
        for i, rel in enumerate(checkpoint_file_names(base, name)):
            files[rel] = self._put_file(to, f"/v1/stage/{owner}/{parsed.uid}/{quote(rel)}",
                                        base / rel, piece)
            if i == 0:
                _faults.reached("partner-mid-send")
        body = json.dumps({"manifest": manifest, "files": files}).encode("utf-8")
        self._request(to, "POST", f"/v1/commit/{owner}/{name}", body,
                      {"Content-Type": "application/json"})

    def _put_file(self, node: int, path: str, src: Path, piece: memoryview) -> str:
        """PUT file ``src`` to ``node`` in pieces of ``len(piece)`` bytes, read once and
        hashed as they pass; returns its SHA-256. The digest goes in the commit (it is
        known only once the last piece is sent): the partner hashes what it receives
        and commits only files whose digest matches."""
        url = urlsplit(self.urls[node])
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                          timeout=self.timeout_s)
        h = hashlib.sha256()
        try:
            with open(src, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                conn.putrequest("PUT", path, skip_accept_encoding=True)
                conn.putheader("Content-Type", "application/octet-stream")
                conn.putheader("Content-Length", str(size))
                conn.endheaders()
                sent = 0
                while sent < size:
                    n = f.readinto(piece[:min(len(piece), size - sent)])
                    if not n:
                        raise PartnerCopyError(f"{src} shrank to {sent} of {size} bytes while "
                                               "it was sent: the checkpoint was dropped; "
                                               "send a newer one")
                    h.update(piece[:n])
                    conn.send(piece[:n])
                    sent += n
            resp = conn.getresponse()
            data = resp.read()
        except PartnerCopyError:
            raise
        except OSError as e:
            # A server that refuses the file (its budget) answers before the body is in
            # and closes: its reason beats "connection reset".
            raise (_early_answer(conn, node, path) or PartnerCopyError(
                f"node {node}'s tier server {self.urls[node]} is out of reach (PUT {path}: "
                f"{e})")) from e
        finally:
            conn.close()
        if resp.status != 200:
            raise _refusal(node, "PUT", path, resp.status, data)
        return h.hexdigest()

    # ---------------------------------------------------------------- reading
    def index(self, node: int, owner: int) -> dict[str, list[dict[str, str]]] | None:
        """``{tier: [{"name", "manifest"}, ...]}`` of ``owner``'s checkpoints on ``node``;
        None when that node's server is out of reach (a lost node)."""
        try:
            doc: dict[str, Any] = json.loads(self._request(node, "GET", f"/v1/index/{owner}"))
        except PartnerCopyError as e:
            log.info("%s", e)
            return None
        return dict(doc["tiers"])

    def files(self, node: int, owner: int, name: str, *,
              tier: ServedTier = "ram") -> dict[str, str]:
        """The data files of ``owner``'s checkpoint ``name`` on ``node``'s ``tier``,
        each with the SHA-256 its copy's sender recorded (``rel -> digest``)."""
        doc = json.loads(self._request(node, "GET", f"/v1/files/{owner}/{name}?tier={tier}"))
        if not isinstance(doc, dict):
            raise PartnerCopyError(f"node {node}'s file list of {name} is not a JSON object")
        return {str(k): str(v) for k, v in doc.items()}

    def read(self, node: int, owner: int, rel: str, *, tier: ServedTier = "ram") -> bytes:
        """One file ``rel`` (relative to ``owner``'s root) from ``node``'s ``tier``: a
        per-rank state object, which the reader checks against its manifest's digest.
        Raises :class:`PartnerCopyError` when the node is out of reach or lacks it."""
        return self._request(node, "GET", f"/v1/raw/{owner}/{quote(rel)}?tier={tier}")

    def fetch(self, node: int, owner: int, name: str, root: str | os.PathLike[str],
              *, tier: ServedTier = "ram") -> None:
        """Copy ``owner``'s checkpoint ``name`` from ``node``'s ``tier`` into the root
        ``root``: each file checked against the sender's SHA-256, the manifest last.
        Raises :class:`PartnerCopyError` (and commits nothing) on any difference."""
        parsed = parse_manifest_name(name)
        if parsed is None:
            raise PartnerCopyError(f"{name!r} is not a manifest name")
        dst = Path(root)
        q = f"?tier={tier}"
        files = self.files(node, owner, name, tier=tier)
        try:
            for rel, digest in files.items():
                out = staged_path(dst, parsed.uid, rel)
                out.parent.mkdir(parents=True, exist_ok=True)
                data = self._request(node, "GET", f"/v1/raw/{owner}/{quote(rel)}{q}")
                if sha256_bytes(data) != digest:  # checked as it arrives, never re-read
                    raise PartnerCopyError(
                        f"node {node}'s copy of {name}: file {rel} differs from the SHA-256 "
                        "its sender recorded (a damaged copy); not used")
                out.write_bytes(data)
            raw = self._request(node, "GET", f"/v1/raw/{owner}/{manifest_path(name)}{q}")
            commit_staged(dst, name, raw, files, verified=files)
        finally:
            clear_staging(dst)
