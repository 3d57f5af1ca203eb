"""Partner copies of the RAM tier (``checkpoint_store.partner``, ``node_tiers``): a
node's checkpoints survive its loss on another node's tier server, torn and damaged
copies are never used, and a job whose node was lost trains every record once."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_store.layout import DATA_DIR
from checkpoint_store.node_tiers import NodeTierStore, TierIntervals
from checkpoint_store.partner import node_root, partners_of
from checkpoint_store.ram_tier import RamTierFullError, RamTierStore
from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests._tier_servers import TierServers, tier_servers
from trainguard.core.checkpoints import CheckpointStoreAPI
from trainguard.core.rank_record import checkpoint_offsets
from trainguard.core.record import RECORD_VERSION

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(MB // 4, generator=g), "b": torch.randn(17, generator=g)}


def _node_store(servers: TierServers, node: int, disk: Path | None = None,
                disk_every: int = 0, remote: str | None = None,
                options: dict[str, Any] | None = None) -> NodeTierStore:
    ram = RamTierStore(node_root(servers.node_shm(node), node), budget_bytes=64 * MB)
    return NodeTierStore(ram, node=node, peers=servers.urls, disk_root=disk,
                         remote_url=remote, storage_options=options,
                         intervals=TierIntervals(partner_every=1, disk_every=disk_every,
                                                 remote_every=1 if remote else 0))


def _saves_of_node(servers: TierServers, node: int, steps: list[int]) -> None:
    """The other node of the job checkpoints the same steps (its own part)."""
    store = _node_store(servers, node)
    for step in steps:
        store.save(_state(100 + step), step=step).wait()
    store.wait_copies()
    assert store.copy_failures == 0
    store.close()


def _final_ledger(servers: TierServers, node: int, n: int, partitions: int) -> torch.Tensor:
    """Node ``node``'s final checkpoint, as a restart would load it through its
    NodeTierStore: the ledger, after checking that it is of the per-rank layout (session
    record 3, this node's state object in its RAM tier) and that the objects of all its
    ranks, read from their nodes' tiers, place every partition."""
    from tests._client_train import make_state

    state, model, _ = make_state(n)
    store = _node_store(servers, node)
    try:
        manifest = store.load(state)
        assert manifest is not None, "no checkpoint was committed"
        assert manifest.extra["trainguard"]["version"] == RECORD_VERSION
        assert (store.ram.root / DATA_DIR / manifest.uid / "ranks" / "0.json").is_file()
        assert sorted(checkpoint_offsets(store, manifest)) == list(range(partitions))
    finally:
        store.close()
    return model.counts.clone()


def _objects_from(seen: list[str]) -> dict[str, set[str]]:
    """The tiers each rank's state objects came from, over a job's ``OBJECTS_FROM``
    lines (rank -> tiers)."""
    import json

    found: dict[str, set[str]] = {}
    for line in seen:
        _rank, _, rest = line.partition(": OBJECTS_FROM ")
        if rest:
            for rank, tiers in json.loads(rest).items():
                found.setdefault(rank, set()).update(tiers)
    return found


def _ready(seen: list[str]) -> int:
    """The step a job's rank 0 restored (its ``READY`` line)."""
    return next(int(line.split()[-1]) for line in seen if line.startswith("0: READY"))


def test_partners_are_a_pure_function_of_the_ranks() -> None:
    """The next node in the ring keeps a node's copy, and a partner is never in the
    node's failure domain while another domain has a node."""
    assert [partners_of(r, 3)[0] for r in range(3)] == [1, 2, 0]
    assert partners_of(0, 4, copies=2) == [1, 2]
    racks = ["a", "a", "b", "b"]
    assert [partners_of(r, 4, domains=racks)[0] for r in range(4)] == [2, 2, 0, 0]
    with pytest.raises(ValueError, match="copies must be"):
        partners_of(0, 3, copies=3)


def test_lost_node_restores_its_part_from_the_partner(shm: Path) -> None:
    """Node 0 saves twice; node 0 is lost (server killed, memory wiped); its replacement
    restores the newest step bit for bit from node 1's copy, and says so."""
    with tier_servers(shm, 2) as servers:
        store = _node_store(servers, 0)
        for name in [n for n in dir(CheckpointStoreAPI) if not n.startswith("_")]:
            assert hasattr(store, name), name
        for step in (1, 2):
            store.save(_state(step), step=step, extra={"s": step}).wait()
        store.wait_copies()
        assert store.copy_failures == 0
        assert sorted(store.catalog().values()) == [["ram", "partner:n1"]] * 2
        store.close()
        _saves_of_node(servers, 1, [1, 2])
        servers.lose(0)
        servers.start(0)
        again = _node_store(servers, 0)
        assert [m.step for m in again.list()] == [1, 2]
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        manifest = again.load(target)
        assert manifest is not None and manifest.step == 2 and manifest.extra == {"s": 2}
        assert again.restored_from == "partner:n1"
        for k, v in _state(2).items():
            assert torch.equal(target[k], v), k
        # The copy comes back into node 0's RAM tier after the restore (in the
        # background; wait_copies waits for it): the next restore needs no network.
        again.wait_copies()
        assert again.load(target) is not None and again.restored_from == "ram"
        again.close()


def test_hold_until_copied_never_drops_a_checkpoint_without_copies(shm: Path) -> None:
    """hold_until_copied: with the partner's server gone, the RAM tier refuses a save
    that would drop an uncopied checkpoint (RamTierFullError), and keeps both."""
    with tier_servers(shm, 2) as servers:
        servers.kill(1)
        ram = RamTierStore(node_root(servers.node_shm(0), 0), budget_bytes=2 * MB + MB // 2,
                           keep_last=10)
        store = NodeTierStore(ram, node=0, peers=servers.urls, hold_until_copied=True,
                              timeout_s=2.0)
        for step in (1, 2):
            store.save(_state(step), step=step).wait()
        store.wait_copies()
        assert store.copy_failures == 2
        with pytest.raises(RamTierFullError, match="may_drop"):
            store.save(_state(3), step=3)
        assert [m.step for m in ram.list()] == [1, 2]
        store.close()


def test_damaged_partner_copy_falls_back_to_disk(shm: Path, tmp_path: Path) -> None:
    """A byte flipped in the partner's copy: the fetch refuses it (SHA-256), the load
    falls back to local disk and returns the saved state exactly."""
    with tier_servers(shm, 2) as servers:
        store = _node_store(servers, 0, disk=tmp_path / "disk", disk_every=1)
        store.save(_state(5), step=5).wait()
        store.wait_copies()
        store.close()
        _saves_of_node(servers, 1, [5])
        copy = node_root(servers.node_shm(1), 0) / DATA_DIR
        victim = max((p for p in copy.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
        shutil.rmtree(node_root(servers.node_shm(0), 0))  # node 0's RAM is gone
        again = _node_store(servers, 0, disk=tmp_path / "disk", disk_every=1)
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        manifest = again.load(target)
        assert manifest is not None and manifest.step == 5
        assert again.restored_from == "disk"
        for k, v in _state(5).items():
            assert torch.equal(target[k], v), k
        again.close()


def test_two_nodes_lost_at_once_fall_back_to_remote(shm: Path, tmp_path: Path, moto_server,
                                                    s3_bucket,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Both nodes of a 2-node job are lost (RAM, partner copies, servers): each node's
    part is restored from remote storage (moto S3) bit for bit, and the log says that
    the restore came from remote. Each node's state object went to every tier with its
    checkpoint (the same bytes in RAM, on disk, in the partner copy), and after the loss
    both nodes' objects are read back from remote."""
    remote, options = f"s3://{s3_bucket}/run", moto_server.storage_options()
    docs = [{"offsets": {str(node): f"1-{node + 4}"}, "rank": node} for node in (0, 1)]
    with tier_servers(shm, 2) as servers:
        for node in (0, 1):
            disk = tmp_path / f"disk{node}"
            store = _node_store(servers, node, disk=disk, disk_every=1, remote=remote,
                                options=options)
            m = store.save(_state(10 * node + 3), step=3, rank_state=docs[node]).wait()
            store.wait_copies()
            assert store.copy_failures == 0
            rel = Path(DATA_DIR) / m.uid / "ranks" / "0.json"
            copies = [store.ram.root / rel, disk / rel,
                      node_root(servers.node_shm(1 - node), node) / rel]
            assert len({p.read_bytes() for p in copies}) == 1, copies
            store.close()
            shutil.rmtree(disk)
        for node in (0, 1):
            servers.lose(node)
        for node in (0, 1):
            servers.start(node)
        for node in (0, 1):
            again = _node_store(servers, node, remote=remote, options=options)
            assert [m.step for m in again.list()] == [3]
            target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="checkpoint_store.node_tiers"):
                manifest = again.load(target)
            assert manifest is not None and manifest.step == 3
            assert again.restored_from == "remote"
            assert "from REMOTE storage" in caplog.text
            assert [again.read_rank_state(manifest, r) for r in (0, 1)] == docs
            assert again.rank_objects_from == {0: ["remote"], 1: ["remote"]}
            for k, v in _state(10 * node + 3).items():
                assert torch.equal(target[k], v), k
            again.close()


_TORN_SENDER = """
import os, sys, torch
from checkpoint_store.node_tiers import NodeTierStore
from checkpoint_store.partner import node_root
from checkpoint_store.ram_tier import RamTierStore
shm, urls = sys.argv[1], sys.argv[2].split(",")
ram = RamTierStore(node_root(shm, 0), budget_bytes=64 << 20)
store = NodeTierStore(ram, node=0, peers=urls)
def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn((1 << 20) // 4, generator=g), "b": torch.randn(17, generator=g)}
store.save(state(1), step=1).wait()
store.wait_copies()
print("COPIED 1", flush=True)
os.environ["TRAINGUARD_CKPT_CRASH_AT"] = "partner-mid-send"  # SIGKILL mid-transfer
store.save(state(2), step=2).wait()
store.wait_copies()
print("NOT KILLED", flush=True)
"""


def test_kill_during_a_partner_transfer_leaves_no_usable_torn_copy(shm: Path) -> None:
    """The sender is SIGKILLed after one file of step 2's copy reached the partner: the
    partner lists step 1 only, and the lost node's replacement restores step 1 exactly,
    never the torn step 2."""
    with tier_servers(shm, 2) as servers:
        out = subprocess.run(
            [sys.executable, "-c", _TORN_SENDER, str(servers.node_shm(0)),
             ",".join(servers.urls)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=300)
        assert out.returncode == -9 and "COPIED 1" in out.stdout, out.stdout + out.stderr
        staged = node_root(servers.node_shm(1), 0) / ".incoming"
        assert any(p.is_file() for p in staged.rglob("*")), "the kill came before any file"
        _saves_of_node(servers, 1, [1, 2])  # node 1 holds step 2 whole: node 0 does not
        servers.lose(0)
        servers.start(0)
        again = _node_store(servers, 0)
        assert [m.step for m in again.list()] == [1]
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        manifest = again.load(target)
        assert manifest is not None and manifest.step == 1
        assert again.restored_from == "partner:n1"
        for k, v in _state(1).items():
            assert torch.equal(target[k], v), k
        again.close()


@pytest.mark.parametrize("every", [["--ckpt-every", "6"],
                                   ["--ckpt-every", "auto", "--tier-mtbf-s", "2,40,400,4000"]],
                         ids=["every-6", "auto"])
def test_three_nodes_one_lost_every_record_trained_once(redis_server, shm: Path,
                                                        tmp_path: Path, every: list[str]) -> None:
    """A 3-node job (3 processes, gloo, each node its own RAM tier and tier server) is
    SIGKILLed after node 1's copies were made; node 1 is lost (server killed, memory and
    disk wiped); the relaunched job restores node 1 from its partner (node 2) and
    finishes: every record trained exactly once per the final checkpoint's ledger.
    With checkpoint_every="auto" too: the multi-level plan copies only some saves to
    the partners and disk, and the ledger still holds."""
    n, p = 1200, 6
    spec = cf.create(redis_server.url, "tok", partitions=p)
    cf.fill(redis_server.url, spec, n)
    with tier_servers(shm, 3) as servers:
        args = ["--redis", redis_server.url, "--dataset", "tok", "--run", "exp",
                "--store", str(shm), "--n", str(n), "--batch-size", "8",
                *every, "--sleep-ms", "2", "--keep-last", "3", "--tier-peers", ",".join(servers.urls),
                "--tier-disk", str(tmp_path / "disk"), "--ram-tier-budget", str(16 * MB)]
        with ledger.zygote(tmp_path / "job.log") as z:
            job = z.spawn(args, 3)
            _wait_copies(job, node=1)
            job.kill()
            servers.lose(1)
            shutil.rmtree(tmp_path / "disk" / "node1", ignore_errors=True)
            servers.start(1)
            job = z.spawn(args, 3)
            job.finish(300)
        assert "1: RESTORED_FROM partner:n2" in job.seen, job.seen[:10]
        for node in (0, 1):  # node 1's own final checkpoint too: its restore was whole
            ledger.assert_each_once(_final_ledger(servers, node, n, p))


def _wait_copies(job: Any, *, node: int, count: int = 2) -> None:
    """Wait until ``node`` reported ``count`` copies made (its partners hold them);
    any process exiting first fails the test."""
    copied = 0
    while copied < count:
        got = job.next_line(120)
        assert got is not None and not job.exits, job.seen[-20:]
        if got[0] == node and got[1].startswith("COPIED"):
            copied += 1


def test_world_shrinks_after_a_node_loss_reading_its_state_from_a_partner(
        redis_server, shm: Path, tmp_path: Path) -> None:
    """A 3-node job is SIGKILLed once node 2's copies were made; node 2 is lost (server
    killed, memory and disk wiped; an empty server takes its place) and the job goes on
    with 2 ranks: the lost rank's state object (its partitions' offsets) is read from
    its partner's copy (node 0). That 2-rank job is SIGKILLed in turn once its own
    copies were made, and its restart resumes from them (not the 3-rank checkpoint
    again): every record is trained exactly once per the final checkpoint's ledger."""
    n, p = 1200, 6
    spec = cf.create(redis_server.url, "tok", partitions=p)
    cf.fill(redis_server.url, spec, n)
    with tier_servers(shm, 3) as servers:
        args = ["--redis", redis_server.url, "--dataset", "tok", "--run", "exp",
                "--store", str(shm), "--n", str(n), "--batch-size", "8",
                "--ckpt-every", "6", "--sleep-ms", "2", "--keep-last", "3",
                "--tier-peers", ",".join(servers.urls), "--tier-disk", str(tmp_path / "disk"),
                "--ram-tier-budget", str(16 * MB)]
        with ledger.zygote(tmp_path / "job.log") as z:
            job = z.spawn(args, 3)
            _wait_copies(job, node=2)
            job.kill()
            servers.lose(2)
            shutil.rmtree(tmp_path / "disk" / "node2", ignore_errors=True)
            servers.start(2)
            job = z.spawn(args, 2)
            _wait_copies(job, node=1)
            job.kill()
            shrunk = job.seen
            job = z.spawn(args, 2)
            job.finish(300)
        assert {"0: RESTORED_FROM ram", "1: RESTORED_FROM ram"} <= set(shrunk), shrunk[:10]
        assert _objects_from(shrunk).get("2") == {"partner:n0"}, _objects_from(shrunk)
        assert _ready(job.seen) > _ready(shrunk), (shrunk[:6], job.seen[:6])
        for node in (0, 1):
            ledger.assert_each_once(_final_ledger(servers, node, n, p))


def test_damaged_state_object_in_a_partner_copy_falls_back_to_disk(shm: Path,
                                                                   tmp_path: Path) -> None:
    """One byte flipped in the rank state object of node 1's copy of node 0's
    checkpoint (node 0's RAM lost): the fetch refuses the copy and the load falls back to
    local disk; reading the object falls back from the damaged copy to disk too, and
    returns the document saved."""
    doc = {"offsets": {"0": "1-7"}, "rank": 0}
    with tier_servers(shm, 2) as servers:
        store = _node_store(servers, 0, disk=tmp_path / "disk", disk_every=1)
        assert store.supports_rank_state
        store.save(_state(5), step=5, rank_state=doc).wait()
        store.wait_copies()
        assert store.copy_failures == 0
        store.close()
        _saves_of_node(servers, 1, [5])
        (obj,) = (node_root(servers.node_shm(1), 0) / DATA_DIR).glob("*/ranks/0.json")
        raw = bytearray(obj.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        obj.write_bytes(bytes(raw))
        shutil.rmtree(node_root(servers.node_shm(0), 0))  # node 0's RAM is gone
        again = _node_store(servers, 0, disk=tmp_path / "disk", disk_every=1)
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        manifest = again.load(target)
        assert manifest is not None and manifest.step == 5
        assert again.restored_from == "disk"
        assert again.read_rank_state(manifest, 0) == doc
        assert again.rank_objects_from == {0: ["disk"]}
        with pytest.raises(IndexError, match="no node among the 2 tier servers of peers"):
            again.read_rank_state(manifest, 2)
        for k, v in _state(5).items():
            assert torch.equal(target[k], v), k
        again.close()


def test_v2_checkpoint_restores_from_a_partner_copy(redis_server, shm: Path) -> None:
    """A checkpoint of session record version 2 (offsets in the manifest: the committed
    fixture of tests/test_format_v2_fixture.py) held only as node 1's partner copy of
    node 0 restores through node 0's NodeTierStore: step 5, its weights, and the 20
    records after its offsets, so each of the 40 records exactly once."""
    import json

    from torch.utils.data import DataLoader

    from trainer_client import TrainingSession

    fixture = ROOT / "tests" / "fixtures" / "ckpt_v2"
    (name,) = (m.name for m in (fixture / "manifests").glob("*.json"))
    doc = json.loads((fixture / "manifests" / name).read_bytes())
    assert doc["extra"]["trainguard"]["version"] == 2
    spec = cf.create(redis_server.url, "tok", partitions=4)
    cf.fill(redis_server.url, spec, 40)
    torch.manual_seed(7)
    saved = torch.nn.Linear(4, 2).state_dict()
    with tier_servers(shm, 2) as servers:
        shutil.copytree(fixture, node_root(servers.node_shm(1), 0))  # only the partner has it
        store = _node_store(servers, 0)
        state = {"model": torch.nn.Linear(4, 2)}
        s = TrainingSession(redis_server.url, dataset="tok", run="exp", block_ms=100,
                            store=store)
        try:
            assert s.restore(state) == 5
            assert store.restored_from == "partner:n1"
            for k, v in saved.items():
                assert torch.equal(state["model"].state_dict()[k], v)
            after = [int(i) for b in s.batches(DataLoader(s.dataset(batch_size=4),
                                                          batch_size=None))
                     for i in b.data[:, 0].tolist()]
        finally:
            s.close()
            store.close()
    offsets = {int(q): int(i.split("-")[1]) for q, i in doc["extra"]["trainguard"]["offsets"].items()}
    before = [i for i in range(40) if i // 4 <= offsets[i % 4]]
    assert len(before) == 20 and sorted(before + after) == list(range(40))


def test_tier_server_refuses_an_unknown_tier_instead_of_serving_ram(tmp_path: Path) -> None:
    """A ``?tier=`` outside ServedTier is a 400 that names the tiers served, not the
    RAM root's file: a typo never reads the wrong tier's bytes."""
    import http.client

    from checkpoint_store.partner import TierServer

    server = TierServer(tmp_path / "ram", node=0, budget_bytes=MB).start()
    try:
        owner = node_root(server.root, 0)
        owner.mkdir(parents=True)
        (owner / "probe.bin").write_bytes(b"ram bytes")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/raw/0/probe.bin?tier=ram")
        ok = conn.getresponse()
        assert (ok.status, ok.read()) == (200, b"ram bytes")
        conn.request("GET", "/v1/raw/0/probe.bin?tier=rma")
        bad = conn.getresponse()
        body = bad.read().decode()
        assert bad.status == 400
        assert "tier must be one of ('ram', 'disk'), got 'rma'" in body
        conn.close()
    finally:
        server.close()


def _file_reads(pid: int | str = "self") -> int:
    """Bytes the process has read with read(2) so far (``rchar``: files, and pipes; the
    HTTP of the copy protocol arrives by recv(2), which it does not count)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/io has no rchar line")


def test_a_copy_reads_each_file_once_on_its_way(shm: Path, tmp_path: Path) -> None:
    """Sending a checkpoint to a partner reads each of its files from disk once, in
    all (sender and receiver together: hashed as it passes, never read back to be
    hashed again); fetching it back reads each file once (the partner serving it), and
    the fetched copy is still the checkpoint, byte for byte."""
    from checkpoint_store._copies import checkpoint_files
    from checkpoint_store._partner_link import PartnerLink

    with tier_servers(shm, 2) as servers:
        ram = RamTierStore(node_root(servers.node_shm(0), 0), budget_bytes=64 * MB)
        for step in (1, 2):
            ram.save(_state(step), step=step).wait()
        first, second = (m.name for m in sorted(ram.list(), key=lambda m: m.step))
        link = PartnerLink(servers.urls)
        server = servers.procs[1]
        assert server is not None
        link.send(1, 0, ram.root, first)  # imports, connections: warmed outside the count
        link.fetch(1, 0, first, tmp_path / "warm")
        files = checkpoint_files(ram.root, second)
        size = sum((ram.root / rel).stat().st_size for rel in files)
        assert size >= MB

        before = _file_reads() + _file_reads(server.pid)
        link.send(1, 0, ram.root, second)
        sent = _file_reads() + _file_reads(server.pid) - before

        back = tmp_path / "back"
        before = _file_reads() + _file_reads(server.pid)
        link.fetch(1, 0, second, back)
        fetched = _file_reads() + _file_reads(server.pid) - before
        ram.close()

    # Once is ``size``; the slack is the small reads of manifests and digests.
    assert sent < 1.25 * size, f"a send read {sent / size:.2f}x the checkpoint's bytes"
    assert fetched < 1.25 * size, f"a fetch read {fetched / size:.2f}x the checkpoint's bytes"
    assert checkpoint_files(back, second) == files
