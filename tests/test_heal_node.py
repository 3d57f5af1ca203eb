"""Bad nodes stay out: a CRITICAL GPU decided by every rank at one step boundary, the
bad node leaving its torchrun job, and its quarantine record in Redis.

Real parts: two real torchrun agents (``python -m torch.distributed.run``, c10d
rendezvous, gloo), a real redis-server, real checkpoints on disk; the one fake is the
bad node's NVML (tests/_fake_nvml.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from torch.distributed import TCPStore

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests import _guard_train as gt
from tests._client_ledger import assert_each_once, zygote
from tests.servers import free_port
from trainer_client.health import EXIT_GPU_CRITICAL, EXIT_PEER_CRITICAL
from trainguard.core import quarantine as qr

ROOT = Path(__file__).resolve().parents[1]
N, P, CRITICAL_AT = 320, 4, 6
# last_call_timeout: how long a round waits for more nodes once the minimum joined;
# keep-alive: how soon a node that stopped heartbeating is dropped from the state.
RDZV_CONF = "is_host=false,last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=2"


def _agent(node: str, *, bad: bool, rdzv_port: int, redis_url: str, store: str, log: Path,
           nnodes: str = "1:2", n: int = N, critical_at: int = CRITICAL_AT,
           workers: int = 0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TRAINGUARD_NODE_ID": node,
           "HEAL_BAD": "1" if bad else "0", "LOGLEVEL": "INFO"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-id=heal",
           f"--rdzv-conf={RDZV_CONF}", "--max-restarts=2", "--monitor-interval=0.2",
           "-m", "tests._heal_train", "--redis", redis_url, "--store", store,
           "--records", str(n), "--critical-at", str(critical_at), "--workers", str(workers)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _lines(log: Path, word: str) -> list[list[str]]:
    return [line.split() for line in log.read_text(errors="replace").splitlines()
            if line.startswith(word + " ")]


def _run_job(tmp_path: Path, redis_url: str, store: str, nodes: dict[str, bool], *,
             n: int, critical_at: int, workers: int = 0,
             partitions: int = P) -> tuple[dict[str, int], dict[str, Path]]:
    """One torchrun agent per node (``{name: bad}``), all started at once; their exit
    codes and logs once all ended."""
    cf.fill(redis_url, cf.create(redis_url, gt.DATASET, partitions=partitions), n)
    rdzv_port = free_port()
    # The rendezvous store's host: this test process (it outlives every node).
    rdzv = TCPStore("127.0.0.1", rdzv_port, is_master=True, multi_tenant=True,
                    wait_for_workers=False)
    logs = {name: tmp_path / f"{name}.log" for name in nodes}
    agents = {name: _agent(name, bad=bad, rdzv_port=rdzv_port, redis_url=redis_url,
                           store=store, log=logs[name], nnodes=f"1:{len(nodes)}", n=n,
                           critical_at=critical_at, workers=workers)
              for name, bad in nodes.items()}
    try:
        codes = {name: a.wait(timeout=300) for name, a in agents.items()}
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
                a.wait()
        del rdzv
    return codes, logs


def _check_healed(redis_url: str, store: str, codes: dict[str, int], logs: dict[str, Path],
                  *, bad: str, n: int, critical_at: int) -> None:
    """The bad node trained steps 1..critical_at, was never restarted, and is
    quarantined by its trainer; every other node ran once with everyone and once
    without it, and finished; the checkpoint of critical_at was taken by every rank;
    the final one, without the bad node, has each of the n records trained once."""
    text = {name: log.read_text(errors="replace")[-4000:] for name, log in logs.items()}
    world = len(logs)
    assert codes[bad] != 0, text[bad]  # its agent was stopped, not finished
    starts = {name: [(int(w), int(r)) for _, _, _, w, r, *_ in _lines(log, "START")]
              for name, log in logs.items()}
    assert starts[bad] == [(world, 0)], text[bad]  # never restarted on the bad node
    steps = [int(s) for _, s, *_ in _lines(logs[bad], "STEP")]
    assert steps == list(range(1, critical_at + 1)), text[bad]
    done = []
    for name in logs.keys() - {bad}:
        assert codes[name] == 0, text[name]
        assert starts[name] == [(world, 0), (world - 1, 1)], text[name]
        done += [int(d) for _, d, *_ in _lines(logs[name], "DONE")]
    assert len(set(done)) == 1 and len(done) == world - 1

    client = redis.Redis.from_url(redis_url)
    try:
        records = qr.list_quarantined(client)
    finally:
        client.close()
    assert [(r.node, r.source) for r in records] == [(bad, "trainer")]
    assert "uncorrected ECC" in records[0].reason
    assert records[0].report is not None and records[0].report["status"] == "CRITICAL"

    cs = CheckpointStore(store)
    try:
        by_step = {int(m.step): m.extra["trainguard"]["world_size"] for m in cs.list()}
        state, model, _ = gt.make_state(n)
        final = cs.load(state)
    finally:
        cs.close()
    assert by_step[critical_at] == world  # the checkpoint every rank took together
    assert final is not None and int(final.step) == done[0]
    assert final.extra["trainguard"]["world_size"] == world - 1
    assert_each_once(model.counts.detach())


def test_critical_gpu_is_decided_by_all_ranks_and_the_healthy_node_finishes_alone(
    redis_server, tmp_path: Path
) -> None:
    """Two torchrun agents (one worker each; the rendezvous store on neither node, the
    healthy node not its host). The bad node's GPU turns CRITICAL after step 6: both
    ranks stop at the same step boundary and checkpoint step 6 together (world size
    2); the bad rank writes its node's quarantine record and stops its own agent, so
    its worker is never restarted there; the healthy agent restarts its worker, which
    rendezvous alone (world size 1), resumes from step 6 and finishes the dataset.
    The final checkpoint's ledger: every record trained exactly once."""
    store = f"file://{tmp_path}/ckpt"
    codes, logs = _run_job(tmp_path, redis_server.url, store, {"good": False, "bad": True},
                           n=N, critical_at=CRITICAL_AT)
    _check_healed(redis_server.url, store, codes, logs, bad="bad", n=N,
                  critical_at=CRITICAL_AT)


def test_a_rank_out_of_data_still_takes_part_in_the_critical_verdict(redis_server,
                                                                    tmp_path: Path) -> None:
    """Two ranks with uneven data under GuardedTraining (3 partitions: rank 1 runs out
    after step 6 and steps on join mode's empty batches). Rank 1's GPU turns CRITICAL
    after step 9, while it has no data: both ranks raise at the same step boundary,
    checkpoint step 9 together, rank 1 exits 75 (its node quarantined), rank 0 exits
    76. A one-rank restart resumes at step 9 and finishes: every record once."""
    n, store = 144, f"file://{tmp_path}/ckpt"
    cf.fill(redis_server.url, cf.create(redis_server.url, gt.DATASET, partitions=3), n)
    args = ["--redis", redis_server.url, "--store", store, "--records", str(n),
            "--critical-at", "9"]
    with zygote(tmp_path / "job.log", "tests._heal_train") as z:
        job = z.spawn([*args, "--bad-rank", "1"], 2)
        while len(job.exits) < 2:
            assert job.next_line(120) is not None, job.seen[-20:]
        assert job.exits == {0: EXIT_PEER_CRITICAL, 1: EXIT_GPU_CRITICAL}
        cs = CheckpointStore(store)
        try:
            assert {int(m.step): m.extra["trainguard"]["world_size"] for m in cs.list()}[9] == 2
        finally:
            cs.close()
        job = z.spawn(args, 1)
        while not job.exits:
            assert job.next_line(120) is not None, job.seen[-20:]
        assert job.exits == {0: 0}, (tmp_path / "job.log").read_text()[-3000:]
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert [(r.node, r.source) for r in qr.list_quarantined(client)] == [("node1", "trainer")]
    finally:
        client.close()
    cs = CheckpointStore(store)
    try:
        state, model, _ = gt.make_state(n)
        final = cs.load(state)
    finally:
        cs.close()
    assert final is not None and final.extra["trainguard"]["world_size"] == 1
    assert_each_once(model.counts.detach())


@pytest.mark.chaos
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_nodes_one_turns_critical_at_a_random_step(redis_server, tmp_path: Path,
                                                         seed: int) -> None:
    """Three torchrun agents with two DataLoader workers each; a node picked at random
    turns CRITICAL after a random step: the other two checkpoint with it, rendezvous
    again as two and finish; every record trained exactly once. (12 partitions: every
    rank and worker owns some, with three ranks and with two, so no rank runs out of
    data before the others; GuardedTraining does not take join-mode empty batches.)"""
    rng = random.Random(seed)
    names = ["n0", "n1", "n2"]
    bad = rng.choice(names)
    n, critical_at = 480, rng.randint(1, 12)
    store = f"file://{tmp_path}/ckpt"
    codes, logs = _run_job(tmp_path, redis_server.url, store,
                           {name: name == bad for name in names}, n=n,
                           critical_at=critical_at, workers=2, partitions=12)
    _check_healed(redis_server.url, store, codes, logs, bad=bad, n=n, critical_at=critical_at)
