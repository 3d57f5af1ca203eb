"""Bad nodes stay out: a CRITICAL GPU decided by every rank at one step boundary, the
bad node leaving its torchrun job, and its quarantine record in Redis.

Real parts: two real torchrun agents (``python -m torch.distributed.run``, c10d
rendezvous, gloo), a real redis-server, real checkpoints on disk; the one fake is the
bad node's NVML (tests/_fake_nvml.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis
import torch
from torch.distributed import TCPStore

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests import _guard_train as gt
from tests._client_ledger import assert_each_once
from tests.servers import free_port
from trainguard.core import quarantine as qr

ROOT = Path(__file__).resolve().parents[1]
N, P, CRITICAL_AT = 320, 4, 6
# last_call_timeout: how long a round waits for more nodes once the minimum joined;
# keep-alive: how soon a node that stopped heartbeating is dropped from the state.
RDZV_CONF = "is_host=false,last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=2"


def _agent(node: str, *, bad: bool, rdzv_port: int, redis_url: str, store: str,
           log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TRAINGUARD_NODE_ID": node,
           "HEAL_BAD": "1" if bad else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-id=heal",
           f"--rdzv-conf={RDZV_CONF}", "--max-restarts=2", "--monitor-interval=0.2",
           "-m", "tests._heal_train", "--redis", redis_url, "--store", store,
           "--records", str(N), "--critical-at", str(CRITICAL_AT)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _lines(log: Path, word: str) -> list[list[str]]:
    return [line.split() for line in log.read_text(errors="replace").splitlines()
            if line.startswith(word + " ")]


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
    cf.fill(redis_server.url, cf.create(redis_server.url, gt.DATASET, partitions=P), N)
    store = f"file://{tmp_path}/ckpt"
    rdzv_port = free_port()
    # The rendezvous store's host: this test process (it outlives both nodes).
    rdzv = TCPStore("127.0.0.1", rdzv_port, is_master=True, multi_tenant=True,
                    wait_for_workers=False)
    logs = {"good": tmp_path / "good.log", "bad": tmp_path / "bad.log"}
    agents = {name: _agent(name, bad=name == "bad", rdzv_port=rdzv_port,
                           redis_url=redis_server.url, store=store, log=logs[name])
              for name in ("good", "bad")}
    try:
        codes = {name: a.wait(timeout=240) for name, a in agents.items()}
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
                a.wait()
        del rdzv
    text = {name: log.read_text(errors="replace")[-4000:] for name, log in logs.items()}
    assert codes["good"] == 0, text["good"]
    assert codes["bad"] != 0, text["bad"]  # its agent was stopped, not finished

    starts = {name: [(int(w), int(r)) for _, _, _, w, r, *_ in _lines(log, "START")]
              for name, log in logs.items()}
    assert starts["bad"] == [(2, 0)], text["bad"]  # never restarted on the bad node
    assert starts["good"] == [(2, 0), (1, 1)], text["good"]
    steps = {name: [int(s) for _, s in _lines(log, "STEP")] for name, log in logs.items()}
    assert steps["bad"] == list(range(1, CRITICAL_AT + 1)), text["bad"]
    done = _lines(logs["good"], "DONE")
    assert len(done) == 1

    client = redis.Redis.from_url(redis_server.url)
    try:
        records = qr.list_quarantined(client)
    finally:
        client.close()
    assert [(r.node, r.source) for r in records] == [("bad", "trainer")]
    assert "uncorrected ECC" in records[0].reason
    assert records[0].report is not None and records[0].report["status"] == "CRITICAL"

    cs = CheckpointStore(store)
    try:
        by_step = {int(m.step): m.extra["trainguard"]["world_size"] for m in cs.list()}
        state, model, _ = gt.make_state(N)
        final = cs.load(state)
    finally:
        cs.close()
    assert by_step[CRITICAL_AT] == 2  # the checkpoint both ranks took together
    assert final is not None and int(final.step) == int(done[0][1])
    assert final.extra["trainguard"]["world_size"] == 1
    assert_each_once(model.counts.detach())
    assert torch.equal(model.counts.detach(), torch.ones(N))
