"""A partner restore streamed from the tier server into the state
(``checkpoint_store._partner_stream``): each byte of the copy crosses the network
once and lands where it belongs, nothing is staged in a file or read back, and a
copy damaged mid-stream is never what a restore returns."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_store._copies import STAGING_DIR, checkpoint_files
from checkpoint_store._partner_link import PartnerLink
from checkpoint_store._partner_stream import load_from_tier_server
from checkpoint_store.layout import DATA_DIR
from checkpoint_store.node_tiers import NodeTierStore, TierIntervals
from checkpoint_store.partner import node_root
from checkpoint_store.ram_tier import RamTierStore
from tests._tier_servers import TierServers, tier_servers
from trainguard.core.checkpoints import CorruptCheckpointError

MB = 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Two chunk files (chunk_bytes below), the second shared by two tensors.
    return {"w": torch.randn(MB // 4, generator=g), "v": torch.randn(MB // 8, generator=g),
            "b": torch.randn(17, generator=g)}


def _store(servers: TierServers, node: int, disk: Path | None = None) -> NodeTierStore:
    ram = RamTierStore(node_root(servers.node_shm(node), node), budget_bytes=64 * MB,
                       chunk_bytes=MB)
    return NodeTierStore(ram, node=node, peers=servers.urls, disk_root=disk,
                         intervals=TierIntervals(partner_every=1, disk_every=1 if disk else 0))


def _saved(servers: TierServers, step: int, disk: Path | None = None) -> str:
    """Node 0 saves ``step`` (copied to node 1, and to ``disk``), then loses its RAM;
    node 1 saves the same step. Returns node 0's manifest name."""
    store = _store(servers, 0, disk)
    name = store.save(_state(step), step=step).wait().name
    store.wait_copies()
    assert store.copy_failures == 0
    store.close()
    other = _store(servers, 1)
    other.save(_state(100 + step), step=step).wait()
    other.wait_copies()
    other.close()
    shutil.rmtree(node_root(servers.node_shm(0), 0))  # node 0's RAM is gone
    return name


def _io(field: str, pid: int | str = "self") -> int:
    """``rchar`` (bytes read by read, pread, sendfile: not recv) or ``wchar`` (written by
    write: not send) of a process so far."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/io has no {field} line")


def _flip_in_a_chunk(servers: TierServers) -> None:
    """One byte flipped in the middle of the first chunk of node 1's copy of node 0."""
    copy = node_root(servers.node_shm(1), 0) / DATA_DIR
    (chunk,) = copy.glob("*/r0/pack/0")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))


def test_streamed_restore_reads_each_byte_of_the_copy_once(shm: Path) -> None:
    """Restoring from the partner: the bytes received are exactly the copy's files,
    once each; the partner's server reads each file once (sendfile); the restoring
    process reads and writes no file on the way (nothing staged, nothing read back);
    and the state is the checkpoint, bit for bit."""
    with tier_servers(shm, 2) as servers:
        name = _saved(servers, 3)
        copy = node_root(servers.node_shm(1), 0)
        files = checkpoint_files(copy, name)
        size = sum((copy / rel).stat().st_size for rel in files)
        assert sum(rel.rsplit("/", 1)[-1].isdigit() for rel in files) == 2  # two chunks
        server = servers.procs[1]
        assert server is not None
        link = PartnerLink(servers.urls)
        warm = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        load_from_tier_server(link, 1, 0, name, warm, None, in_place=True, io_threads=2)

        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        before = (_io("rchar"), _io("wchar"), _io("rchar", server.pid))
        manifest, source = load_from_tier_server(link, 1, 0, name, target, None,
                                                 in_place=True, io_threads=2)
        read, wrote = _io("rchar") - before[0], _io("wchar") - before[1]
        served = _io("rchar", server.pid) - before[2]
    assert manifest.name == name
    assert source.streamed == files
    assert source.received == size
    # The slack: the manifest and the digests the server reads beside the files.
    assert size <= served < size + (64 << 10), served
    assert read < 64 << 10, f"the restoring process read {read} bytes of files"
    assert wrote < 64 << 10, f"the restoring process wrote {wrote} bytes to files"
    for k, v in _state(3).items():
        assert torch.equal(target[k], v), k


def test_copy_damaged_mid_stream_falls_back_and_is_never_kept(shm: Path,
                                                              tmp_path: Path) -> None:
    """A byte flipped mid-chunk in the partner's copy: the in-place restore finds it
    (its CRC-32C, against the manifest) after bytes of it landed, the disk tier reloads every tensor,
    the state is the checkpoint bit for bit, and node 0's RAM keeps nothing of the
    damaged copy (no commit, no staged debris)."""
    with tier_servers(shm, 2) as servers:
        _saved(servers, 5, disk=tmp_path / "disk")
        _flip_in_a_chunk(servers)
        again = _store(servers, 0, disk=tmp_path / "disk")
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        manifest = again.load(target)
        again.wait_copies()
        assert manifest is not None and manifest.step == 5
        assert again.restored_from == "disk"
        for k, v in _state(5).items():
            assert torch.equal(target[k], v), k
        ram_root = again.ram.root
        assert again.ram.list() == []
        assert not (ram_root / STAGING_DIR).exists() or not os.listdir(ram_root / STAGING_DIR)
        again.close()


def test_damaged_copy_without_another_tier_says_the_state_holds_its_bytes(
        shm: Path) -> None:
    """With no tier after the damaged partner copy, the in-place restore's error says
    the state may hold bytes of that copy; a strict load of the same copy changes nothing
    in the state before it refuses."""
    with tier_servers(shm, 2) as servers:
        _saved(servers, 7)
        _flip_in_a_chunk(servers)
        again = _store(servers, 0)
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CorruptCheckpointError,
                           match=r"may hold bytes of partner:n1's damaged copy \(read in place\)"):
            again.load(target, step=7)
        strict = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CorruptCheckpointError) as e:
            again.load(strict, step=7, strict=True)
        assert "read in place" not in str(e.value)
        for k, v in strict.items():
            assert torch.equal(v, torch.zeros_like(v)), k
        again.close()
