"""The per-node tier server: holds partner copies of other nodes' RAM-tier checkpoints
and serves every tier of this node to the others.

```
python -m checkpoint_store.partner --root /dev/shm/trainguard/run42 --port 7070 \
    --budget-bytes 17179869184 [--disk-root /local/ckpt/run42]
```

Node ``r``'s RAM tier is the checkpoint root ``<root>/n<r>``; the copies this node
keeps for node ``o`` are the root ``<root>/n<o>``, the same layout, byte for byte, so
a copy is an ordinary checkpoint root and the manifest names are the same on every
tier. The server is a separate process from the trainer: it outlives the trainer's
crashes and restarts (the files live in tmpfs anyway), and a trainer that is killed
while it sends a copy leaves only staged files, which are never read.

Who keeps whose copy is a pure function of the node ranks (:func:`partners_of`), so
a replacement node knows where to look without asking anybody.

HTTP routes (JSON unless said; ``<o>`` an owner node rank):

- ``GET  /v1/index/<o>``: the committed checkpoints of ``o`` here, per tier
  (``ram``: own tier or partner copy; ``disk``), each with its manifest text;
- ``PUT  /v1/stage/<o>/<uid>/<relpath>``: one data file of a copy, written as it
  arrives and hashed on the way (``X-Sha256``, optional, is checked when sent; the
  commit checks every file against the sender's list either way);
- ``POST /v1/commit/<o>/<manifest name>``: ``{"manifest": text, "files": {rel: sha}}``:
  checks every staged file, then commits the copy (data, then the manifest);
- ``GET  /v1/files/<o>/<manifest name>``: the copy's files and their SHA-256;
- ``GET  /v1/raw/<o>/<relpath>``: one file's bytes (``?tier=disk`` from the disk root).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from checkpoint_store._copies import (
    SERVED_TIERS,
    PartnerCopyError,
    ServedTier,
    checkpoint_files,
    clear_staging,
    commit_staged,
    staged_path,
)
from checkpoint_store.layout import MANIFEST_DIR, data_dir, parse_manifest_name
from checkpoint_store.ram_tier import tree_bytes

__all__ = ["TierServer", "main", "node_root", "partners_of"]

log = logging.getLogger("checkpoint_store.partner")
SUMS_DIR = "sums"
"""``<owner root>/sums/<manifest name>``: the sender's SHA-256 of each file of a copy,
written before the copy's manifest."""
_STAGED_PER_OWNER = 4  # copies of one owner that may be half-sent at once
RECEIVE_PIECE_BYTES = 1 << 20
"""What a staged file's transfer holds in memory at a time (per request)."""


def partners_of(node: int, nodes: int, *, copies: int = 1,
                domains: Sequence[str] | None = None) -> list[int]:
    """The nodes that keep copies of ``node``'s RAM tier: the next ones in the ring of
    ``nodes``, skipping those in ``node``'s failure domain (``domains[r]``, e.g. the
    rack) while others exist."""
    if not 0 <= node < nodes:
        raise ValueError(f"node {node} is outside 0..{nodes - 1}")
    if not 0 <= copies < nodes:
        raise ValueError(f"copies must be 0..{nodes - 1} with {nodes} nodes, got {copies}")
    ring = [(node + k) % nodes for k in range(1, nodes)]
    if domains is not None:
        if len(domains) != nodes:
            raise ValueError(f"domains names {len(domains)} nodes, expected {nodes}")
        ring = ([r for r in ring if domains[r] != domains[node]]
                + [r for r in ring if domains[r] == domains[node]])
    return ring[:copies]


def node_root(root: str | Path, node: int) -> Path:
    """The checkpoint root of node ``node``'s tier (or copy) under a tier root."""
    return Path(root) / f"n{node}"


def _committed(owner_root: Path) -> list[str]:
    d = owner_root / MANIFEST_DIR
    if not d.is_dir():
        return []
    names = [n for n in (p.name for p in d.iterdir()) if parse_manifest_name(n) is not None]
    return sorted(names, key=lambda n: parse_manifest_name(n))  # type: ignore[arg-type,return-value]


class TierServer:
    """Serves ``root`` (RAM: own tier and partner copies) and ``disk_root`` over HTTP.

    ``budget_bytes`` bounds what partner copies may hold here (the own tier has its
    own budget); ``keep_copies`` copies per owner are kept, the oldest dropped first.
    """

    def __init__(self, root: str | Path, *, node: int, host: str = "127.0.0.1", port: int = 0,
                 budget_bytes: int, keep_copies: int = 2, disk_root: str | Path | None = None):
        if keep_copies < 1:
            raise ValueError(f"keep_copies must be >= 1, got {keep_copies}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.node = node
        self.disk_root = Path(disk_root) if disk_root is not None else None
        self.budget_bytes = budget_bytes
        self.keep_copies = keep_copies
        self._lock = threading.Lock()  # commits and drops, one at a time
        # What each staged file was checked to be as it arrived, (owner, uid) -> rel ->
        # SHA-256, so a commit never reads a copy back to hash it again. Memory only:
        # a restarted server clears its staging, and with it what this would vouch for.
        self._staged: dict[tuple[int, str], dict[str, str]] = {}
        for entry in self.root.iterdir():
            clear_staging(entry)  # a sender that died before we restarted
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread: threading.Thread | None = None

    def owner_root(self, owner: int, tier: ServedTier = "ram") -> Path:
        if tier == "disk":
            if self.disk_root is None:
                raise PartnerCopyError(f"node {self.node} serves no disk tier")
            return node_root(self.disk_root, owner)
        return node_root(self.root, owner)

    # -------------------------------------------------------------- operations
    def index(self, owner: int) -> dict[str, Any]:
        tiers: dict[str, list[dict[str, str]]] = {}
        served: tuple[ServedTier, ...] = SERVED_TIERS if self.disk_root is not None else ("ram",)
        for tier in served:
            base = self.owner_root(owner, tier)
            entries = []
            for name in _committed(base):
                try:
                    text = (base / MANIFEST_DIR / name).read_text("utf-8")
                except FileNotFoundError:
                    continue  # dropped while we listed
                entries.append({"name": name, "manifest": text})
            tiers[tier] = entries
        return {"node": self.node, "owner": owner, "tiers": tiers}

    def hosted_bytes(self) -> int:
        return sum(tree_bytes(p) for p in self.root.iterdir()
                   if p.is_dir() and p.name != f"n{self.node}")

    def make_room(self, owner: int, need: int) -> None:
        """Drop this owner's oldest copies until ``need`` more bytes fit the budget."""
        if owner == self.node:
            raise PartnerCopyError(f"node {self.node} keeps no partner copy of itself")
        with self._lock:
            while self.hosted_bytes() + need > self.budget_bytes:
                names = _committed(self.owner_root(owner))
                if len(names) < 1:
                    raise PartnerCopyError(
                        f"a copy file of {need} bytes does not fit node {self.node}'s partner "
                        f"budget of {self.budget_bytes} bytes ({self.hosted_bytes()} held); "
                        "raise --budget-bytes")
                self._drop(owner, names[0])

    def commit(self, owner: int, name: str, manifest: str, files: dict[str, str]) -> None:
        base = self.owner_root(owner)
        with self._lock:
            sums = base / SUMS_DIR
            sums.mkdir(parents=True, exist_ok=True)
            (sums / name).write_text(json.dumps(files), "utf-8")
            parsed = parse_manifest_name(name)  # None: commit_staged refuses the name
            verified = self._staged.pop((owner, parsed.uid), {}) if parsed else {}
            commit_staged(base, name, manifest.encode("utf-8"), files, verified=verified)
            for old in _committed(base)[:-self.keep_copies]:
                self._drop(owner, old)
        log.info("node %s committed node %s's copy %s", self.node, owner, name)

    def _drop(self, owner: int, name: str) -> None:
        base = self.owner_root(owner)
        parsed = parse_manifest_name(name)
        assert parsed is not None
        (base / MANIFEST_DIR / name).unlink(missing_ok=True)  # the commit record goes first
        shutil.rmtree(base / data_dir(parsed.uid), ignore_errors=True)
        (base / SUMS_DIR / name).unlink(missing_ok=True)

    def staged(self, owner: int, uid: str, rel: str, body: io.BufferedIOBase, length: int,
               digest: str | None = None) -> str:
        """Stage file ``rel`` of ``owner``'s copy ``uid`` as it arrives (``length`` bytes
        of ``body``): written piece by piece into a ``.part`` file and hashed on the way,
        then renamed to its name (a torn transfer leaves only the ``.part`` file, which no
        commit takes). A ``digest`` sent ahead is checked before the rename; either way
        the SHA-256 seen here is what the commit compares with the sender's list, so no
        staged file is read back. Returns it."""
        out = staged_path(self.owner_root(owner), uid, rel)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        h = hashlib.sha256()
        piece = memoryview(bytearray(max(1, min(length, RECEIVE_PIECE_BYTES))))
        try:
            with open(tmp, "wb", buffering=0) as f:
                got = 0
                while got < length:
                    n = body.readinto(piece[:min(len(piece), length - got)])
                    if not n:
                        raise PartnerCopyError(f"file {rel} cut short: {got} of {length} "
                                               "bytes arrived; send it again")
                    h.update(piece[:n])
                    done = 0
                    while done < n:
                        done += f.write(piece[done:n]) or 0
                    got += n
            seen = h.hexdigest()
            if digest is not None and seen != digest:
                raise PartnerCopyError(f"file {rel} arrived damaged (SHA-256 differs)")
            tmp.replace(out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            if (owner, uid) not in self._staged:
                # A sender that died before its commit leaves its entry behind: keep the
                # newest few per owner. A commit whose entry went is hashed from disk.
                mine = [k for k in self._staged if k[0] == owner]
                for k in mine[:max(0, len(mine) - _STAGED_PER_OWNER + 1)]:
                    del self._staged[k]
            self._staged.setdefault((owner, uid), {})[rel] = seen
        return seen

    def files(self, owner: int, name: str, tier: ServedTier) -> dict[str, str]:
        base = self.owner_root(owner, tier)
        sums = base / SUMS_DIR / name
        if sums.is_file():
            return dict(json.loads(sums.read_text("utf-8")))
        return checkpoint_files(base, name)  # the own tier: hashed as it is now

    # -------------------------------------------------------------- lifecycle
    def start(self) -> TierServer:
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True,
                                        name=f"tier-server-n{self.node}")
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._http.serve_forever()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _served_tier(tier: str) -> ServedTier:
    # A query string is untyped: a tier name outside the type is a 400, not the RAM root.
    if tier not in SERVED_TIERS:
        raise ValueError(f"tier must be one of {SERVED_TIERS}, got {tier!r}")
    return cast(ServedTier, tier)


def _handler(server: TierServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY: a reply's headers and its body are two sends; with Nagle on, a
        # kept-alive connection holds the body until the client's delayed ACK (40 ms
        # per small file of a streamed restore).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

        def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send_file(self, path: Path) -> None:
            # sendfile(2): the file's pages go to the socket without a copy through
            # this process (a restore streams whole checkpoints through here).
            with open(path, "rb") as f:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                self.end_headers()
                self.connection.sendfile(f)

        def _json(self, status: int, doc: object) -> None:
            self._reply(status, json.dumps(doc).encode("utf-8"))

        def _route(self) -> tuple[list[str], dict[str, list[str]]]:
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) < 3 or parts[0] != "v1" or not parts[2].isdigit():
                raise PartnerCopyError(f"no route {url.path}; expected /v1/<op>/<owner>/...")
            return parts[1:], parse_qs(url.query)

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length", "0"))
            data = self.rfile.read(length)
            if len(data) != length:
                raise PartnerCopyError(f"body cut short: {len(data)} of {length} bytes")
            return data

        def _run(self, method: str) -> None:
            try:
                (op, owner_s, *rest), query = self._route()
                owner = int(owner_s)
                tier = _served_tier(query.get("tier", ["ram"])[0])
                if method == "GET" and op == "index":
                    return self._json(200, server.index(owner))
                if method == "GET" and op == "files" and len(rest) == 1:
                    return self._json(200, server.files(owner, rest[0], tier))
                if method == "GET" and op == "raw" and rest:
                    path = server.owner_root(owner, tier).joinpath(*rest)
                    if ".." in rest or not path.is_file():
                        return self._json(404, {"error": f"no file {'/'.join(rest)}"})
                    return self._send_file(path)
                if method == "PUT" and op == "stage" and len(rest) >= 2:
                    uid, rel = rest[0], "/".join(rest[1:])
                    staged_path(server.owner_root(owner), uid, rel)  # refuse a bad path first
                    length = int(self.headers.get("Content-Length", "0"))
                    # A refusal leaves the body unread: this connection cannot serve on.
                    self.close_connection = True
                    server.make_room(owner, length)
                    server.staged(owner, uid, rel, self.rfile, length,
                                  self.headers.get("X-Sha256"))
                    self.close_connection = False
                    return self._json(200, {"staged": rel})
                if method == "POST" and op == "commit" and len(rest) == 1:
                    doc = json.loads(self._body())
                    server.commit(owner, rest[0], doc["manifest"], doc["files"])
                    return self._json(200, {"committed": rest[0]})
                return self._json(404, {"error": f"no route {method} {self.path}"})
            except PartnerCopyError as e:
                return self._json(HTTPStatus.CONFLICT, {"error": str(e)})
            except (ValueError, KeyError) as e:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": f"bad request: {e}"})

        def do_GET(self) -> None:
            self._run("GET")

        def do_PUT(self) -> None:
            self._run("PUT")

        def do_POST(self) -> None:
            self._run("POST")

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoint_store.partner",
                                 description="the per-node tier server (partner copies)")
    ap.add_argument("--root", required=True, help="the node's RAM tier root (e.g. in /dev/shm)")
    ap.add_argument("--node", type=int, required=True, help="this node's rank")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--budget-bytes", type=int, required=True,
                    help="bytes the partner copies kept here may hold")
    ap.add_argument("--keep-copies", type=int, default=2)
    ap.add_argument("--disk-root", default=None, help="the node's local disk tier root")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = TierServer(args.root, node=args.node, host=args.host, port=args.port,
                        budget_bytes=args.budget_bytes, keep_copies=args.keep_copies,
                        disk_root=args.disk_root)
    print(f"SERVING {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
