"""Sending a partner copy in bounded pieces (``_partner_link.PartnerLink.send``, the
tier server's ``PUT /v1/stage``): the sender never holds a whole chunk file, the
receiver writes as it receives and hashes on the way, and a file damaged on the way
is never committed."""

from __future__ import annotations

import hashlib
import http.client
import json
import tracemalloc
from pathlib import Path
from urllib.parse import quote

import torch

from checkpoint_store import CheckpointStore
from checkpoint_store._copies import checkpoint_files
from checkpoint_store._partner_link import SEND_PIECE_BYTES, PartnerLink
from checkpoint_store.layout import MANIFEST_DIR, manifest_path, parse_manifest_name
from checkpoint_store.partner import TierServer, node_root
from checkpoint_store.ram_tier import RamTierStore
from tests._tier_servers import tier_servers

MB = 1 << 20


def test_a_send_holds_a_piece_not_a_chunk_file(shm: Path) -> None:
    """A copy of a checkpoint whose chunk file is 8 MiB is sent to a partner (a server
    process of its own) with at most a few pieces of SEND_PIECE_BYTES allocated in
    the sender at once (Python's allocations, traced: a whole file read would be 8
    MiB), and the partner's copy is the checkpoint, byte for byte."""
    with tier_servers(shm, 2) as servers:
        ram = RamTierStore(node_root(servers.node_shm(0), 0), budget_bytes=64 * MB)
        g = torch.Generator().manual_seed(3)
        manifest = ram.save({"w": torch.randn(2 * MB, generator=g)}, step=1).wait()
        files = checkpoint_files(ram.root, manifest.name)
        biggest = max((ram.root / rel).stat().st_size for rel in files)
        assert biggest >= 8 * MB
        link = PartnerLink(servers.urls)
        tracemalloc.start()
        try:
            link.send(1, 0, ram.root, manifest.name)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        ram.close()
        assert peak < 3 * SEND_PIECE_BYTES, f"the send held {peak / MB:.1f} MiB at once"
        copy = node_root(servers.node_shm(1), 0)
        assert checkpoint_files(copy, manifest.name) == files
        assert (copy / manifest_path(manifest.name)).read_bytes() == \
            (ram.root / manifest_path(manifest.name)).read_bytes()


def _put(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("PUT", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _commit(port: int, name: str, manifest: str, files: dict[str, str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/v1/commit/0/{name}",
                     body=json.dumps({"manifest": manifest, "files": files}).encode())
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_a_file_damaged_on_the_way_is_never_committed(tmp_path: Path) -> None:
    """A file whose bytes differ from the digest sent ahead (X-Sha256) is refused and
    leaves nothing staged; a file damaged without one is staged, but the commit
    compares what the server hashed on the way with the sender's list and refuses the
    copy (no manifest). Sent again intact, the copy commits and loads bit for bit."""
    src = CheckpointStore(tmp_path / "src")
    state = {"w": torch.randn(MB // 4, generator=torch.Generator().manual_seed(5))}
    m = src.save(state, step=1).wait()
    src.close()
    files = checkpoint_files(tmp_path / "src", m.name)
    manifest = (tmp_path / "src" / manifest_path(m.name)).read_text()
    parsed = parse_manifest_name(m.name)
    assert parsed is not None
    rel = max(files, key=lambda r: (tmp_path / "src" / r).stat().st_size)
    good = (tmp_path / "src" / rel).read_bytes()
    bad = bytes([good[0] ^ 1]) + good[1:]
    server = TierServer(tmp_path / "partner", node=1, budget_bytes=64 * MB).start()
    stage = f"/v1/stage/0/{parsed.uid}/{quote(rel)}"
    try:
        status, body = _put(server.port, stage, bad,
                            {"X-Sha256": hashlib.sha256(good).hexdigest()})
        assert status == 409 and "arrived damaged" in body
        staged = tmp_path / "partner" / "n0" / ".incoming"
        assert [p for p in staged.rglob("*") if p.is_file()] == []

        for r in files:  # every file, the damaged one without a digest ahead
            data = bad if r == rel else (tmp_path / "src" / r).read_bytes()
            assert _put(server.port, f"/v1/stage/0/{parsed.uid}/{quote(r)}", data, {})[0] == 200
        status, body = _commit(server.port, m.name, manifest, files)
        assert status == 409 and f"file {rel} differs from its SHA-256" in body
        assert not (tmp_path / "partner" / "n0" / MANIFEST_DIR / m.name).exists()

        assert _put(server.port, stage, good, {})[0] == 200
        assert _commit(server.port, m.name, manifest, files)[0] == 200
    finally:
        server.close()
    copy = CheckpointStore(tmp_path / "partner" / "n0")
    back = {"w": torch.zeros(MB // 4)}
    copy.load(back, step=1, strict=True)
    copy.close()
    assert torch.equal(back["w"], state["w"])
