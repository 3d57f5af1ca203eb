"""The job of bench/chaos.py: 3 torchrun agents (tests/_elastic_agents.py) on the
trainguard rendezvous training the ledger job (tests/_heal_job.py), the faults' means
of injection, and the ledger's verdict."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import redis

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests._client_train import make_state
from tests._elastic_agents import FAST_CONF, Agent, agent_command, read_incidents
from tests._tcp_proxy import TcpProxy
from tests.servers import MotoServer, RedisCluster, RedisServer
from trainer_client import redis_client
from trainguard.core import quarantine as qr

__all__ = ["FIRST_CKPT", "Agent", "Job", "crash_loop", "fault_free_rate"]

NODES, P, BATCH, SLEEP_MS = 3, 6, 4, 50
FIRST_CKPT = 5  # the job checkpoints every 5 steps (blocking)
MAX_RECORDS_S = NODES * BATCH * 1000 / SLEEP_MS  # the job cannot train faster
RESUME_TIMEOUT_S = 240.0
AHEAD = int(MAX_RECORDS_S * 10)  # records filled ahead of the job: 10 s at top speed
# A step slower than this, once steps were measured, is a hang (the job's default,
# 1.5 s, is for a quiet machine; this one is shared).
WATCHDOG_FLOOR_S = 5.0
# A peer that beat nothing for this long, while the job made no progress, is stopped
# (heartbeats every 0.2 s): found without waiting for k x p99 of a loaded machine's steps.
WATCHDOG_PEER_SILENCE_S = 3.0
# The job's first round waits for all its nodes (it closes once the last one joined):
# with the default 3 s, a node started late on a loaded machine began a 2-node job
# that re-formed at once to take it in, 34 s lost in one run before any fault.
CONF = f"{FAST_CONF},last_call_timeout=30"
_CHUNK = re.compile(r"^\d+(\.\d+)*$")  # zarr v2-style chunk keys ("0", "0.0")


def _ledger(store_url: str, n: int, storage_options: dict[str, Any] | None = None
            ) -> tuple[Any, int]:
    """The newest checkpoint's ``counts`` and step."""
    state, model, _ = make_state(n)
    store = CheckpointStore(store_url, storage_options=storage_options)
    try:
        manifest = store.load(state)
    finally:
        store.close()
    assert manifest is not None, f"no checkpoint was committed under {store_url}"
    return model.counts.clone(), int(manifest.step)


class Job:
    """One elastic job of ``NODES`` agents; ``live`` are the nodes meant to be up. Its
    Redis is one redis-server, or with ``cluster`` a Redis Cluster of 3 masters with a
    replica each (``self.cluster``; ``self.redis`` is None then). Checkpoints go to a
    local directory, or with ``s3`` to a bucket of moto's S3 server reached through
    ``self.proxy`` (a :class:`TcpProxy` that ``stop()`` takes away). Each node's
    ``TRAINGUARD_NODE_ID`` is its name (quarantine records name it)."""

    def __init__(self, work: Path, name: str, *, reps: int, gap_s: float,
                 persistence: str = "none", records: int | None = None,
                 extra: tuple[str, ...] = (), max_restarts: int = 100,
                 cluster: bool = False, s3: bool = False, warm: bool = False) -> None:
        self.work, self.name = work, name
        self.moto: MotoServer | None = None
        self.proxy: TcpProxy | None = None
        self.store_url, self.store_options = f"file://{work}/ckpt", None
        self._env: dict[str, str] = {}
        if s3:
            self.moto = MotoServer().start()
            self.moto.create_bucket("chaos")
            self.proxy = TcpProxy(self.moto.port).start()
            self.store_url = "s3://chaos/ckpt"
            self.store_options = {**self.moto.storage_options(), "client_kwargs": {
                "endpoint_url": self.proxy.url, "region_name": "us-east-1"}}
            # The workers' s3fs finds the endpoint in fsspec's environment config.
            self._env = {"FSSPEC_S3_ENDPOINT_URL": self.proxy.url, "FSSPEC_S3_KEY": "testing",
                         "FSSPEC_S3_SECRET": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self.redis: RedisServer | None = None
        self.cluster: RedisCluster | None = None
        if cluster:
            self.cluster = RedisCluster(work / "cluster").start()
            url = self.cluster.url
        else:
            self.redis = RedisServer(work / "redis", persistence=persistence).start()
            url = self.redis.url
        self.url = url
        # The ledger's size: every fault's gap (at most 1.5 gap_s) and its recovery at
        # the job's top speed; what is not filled stays 0 and is not counted.
        self.n = records or int(MAX_RECORDS_S * (reps * (1.5 * gap_s + 90) + 60))
        self.spec = cf.create(url, "heal", partitions=P)
        self.filled = min(self.n, AHEAD)
        cf.fill(url, self.spec, self.filled, finish=records is not None)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._filler = threading.Thread(target=self._keep_ahead, daemon=True)
        if records is None:
            self._filler.start()
        self.spike_file = work / "spike"
        self.critical_file = work / "critical"
        self.run_id = f"chaos-{name}-{time.time_ns()}"
        self.command = agent_command(
            "trainguard", url, self.run_id, f"1:{NODES}",
            ["--redis", url, "--store", self.store_url, "--records", str(self.n),
             "--batch-size", str(BATCH), "--sleep-ms", str(SLEEP_MS),
             "--ckpt-every", str(FIRST_CKPT), "--spike-file", str(self.spike_file),
             "--critical-file", str(self.critical_file),
             "--watchdog-floor-s", str(WATCHDOG_FLOOR_S),
             "--watchdog-peer-silence-s", str(WATCHDOG_PEER_SILENCE_S), *extra],
            max_restarts=max_restarts, conf=CONF, entry=("-m", "tests._heal_job"),
            warm=warm)
        self.every: list[Agent] = []
        self.live: list[Agent] = []
        for i in range(NODES):
            self.start_agent(f"n{i}")

    def start_agent(self, name: str, *, node: str | None = None, live: bool = True) -> Agent:
        """Start node ``name`` (its node id ``node``, default the name); ``live``: one
        meant to join and train (not one expected to be refused)."""
        agent = Agent(name, self.command, self.work / f"{name}.log",
                      env={**self._env, "TRAINGUARD_NODE_ID": node or name})
        self.every.append(agent)
        if live:
            self.live.append(agent)
        return agent

    # ---------------------------------------------------------------- reading the lines
    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(x.rsplit(" ", 1)[1])) for a in self.every for t, x in a.seen(": STEP ")]

    def max_step(self) -> int:
        return max((s for _, s in self.steps()), default=0)

    def wait_trained(self, min_step: int) -> None:
        deadline = time.monotonic() + RESUME_TIMEOUT_S
        while self.max_step() < min_step:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no step {min_step} in time:\n"
                                     + "\n".join(a.tail() for a in self.live))
            time.sleep(0.1)

    def readies_after(self, live: list[Agent], after: float) -> int:
        return sum(1 for a in live for t, _ in a.seen(": READY ") if t > after)

    def resumed(self, live: list[Agent], after: float, via: str) -> float | None:
        """When the first step was trained after ``after``, once every ``live`` node
        printed ``via`` (READY: restarted and restored; ROLLBACK) past it; None if not
        within RESUME_TIMEOUT_S."""
        deadline = time.monotonic() + RESUME_TIMEOUT_S
        while time.monotonic() < deadline:
            marks = [[t for t, _ in a.seen(f": {via} ") if t > after] for a in live]
            if via == "STEP" or all(marks):
                since = after if via == "STEP" else max(min(m) for m in marks)
                firsts = [t for a in live for t, _ in a.seen(": STEP ") if t > since]
                if firsts:
                    return min(firsts)
            time.sleep(0.05)
        return None

    def rank0(self) -> Agent:
        """The live node whose newest worker is rank 0."""
        newest = [(a.seen(": READY ")[-1], a) for a in self.live if a.seen(": READY ")]
        return next(a for (_, x), a in newest if x.startswith("0:"))

    # ---------------------------------------------------------------- injecting
    def signal_worker(self, agent: Agent, sig: int) -> None:
        """``sig`` to the agent's newest worker (its ``PID`` line)."""
        pid = int(agent.seen(": PID ")[-1][1].rsplit(" ", 1)[1])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def spike(self, step: int, kind: str) -> None:
        tmp = self.spike_file.with_suffix(".tmp")
        tmp.write_text(f"{step} {kind}\n")
        os.replace(tmp, self.spike_file)

    def gpu_critical(self, agent: Agent, step: int) -> None:
        """``agent``'s (fake NVML) GPU reports CRITICAL once it trained ``step``."""
        tmp = self.critical_file.with_suffix(".tmp")
        tmp.write_text(f"{agent.name} {step}\n")
        os.replace(tmp, self.critical_file)

    def quarantined(self) -> list[str]:
        """The nodes a quarantine record keeps out now."""
        r = redis_client.client(self.url)
        try:
            return [rec.node for rec in qr.list_quarantined(r)]
        finally:
            r.close()

    def kill_master(self, key: str) -> float:
        """kill -9 of the cluster master serving ``key``, once every replica has what
        the stream was given (the filler is held meanwhile: an append a failover loses
        is one the producer would replay, which this filler does not); its replica
        takes over, then the killed node comes back as a replica. Returns when the kill
        was sent."""
        assert self.cluster is not None, "kill_master needs Job(cluster=True)"
        with self._lock:
            self.cluster.wait_replicated()
            at = time.time()
            victim = self.cluster.kill_master(key)
        victim.restart()
        self.cluster.wait_healthy()
        return at

    def restart_redis(self) -> None:
        """kill -9 of the redis-server, a restart on the same port a second later."""
        assert self.redis is not None
        self.redis.kill()
        time.sleep(1.0)
        self.redis.start()

    def corrupt_newest_chunk(self) -> Path:
        """Overwrite the first bytes of the newest chunk file under the store."""
        chunks = [p for p in (self.work / "ckpt").rglob("*") if p.is_file() and
                  _CHUNK.match(p.name)]
        assert chunks, f"no chunk file under {self.work / 'ckpt'}"
        newest = max(chunks, key=lambda p: p.stat().st_mtime)
        with open(newest, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            f.write(b"\xde\xad\xbe\xef" * max(1, min(size, 64) // 4))
        return newest

    def _keep_ahead(self) -> None:
        """Keep the stream AHEAD records ahead of what was trained (a full world's
        steps: an overestimate when fewer nodes train), until finish()."""
        while not self._done.wait(0.5):
            with self._lock:
                ahead = min(self.n, self.max_step() * NODES * BATCH + AHEAD)
                if ahead > self.filled:
                    with contextlib.suppress(redis.RedisError):  # Redis may be restarting
                        cf.fill(self.url, self.spec, ahead, start=self.filled,
                                finish=False)
                        self.filled = ahead

    # ---------------------------------------------------------------- the verdict
    def _progress(self) -> tuple[int, ...]:
        """What the job's workers said so far: grows while the job makes progress."""
        return tuple(len(a.seen(f": {w} ")) for a in self.every
                     for w in ("PID", "READY", "STEP", "ROLLBACK", "CRITICAL", "DONE"))

    def wait_ended(self, stall_s: float = RESUME_TIMEOUT_S) -> dict[str, int | None]:
        """Until every live node's agent exited: the job's real end, however long the
        drain of the stream takes on a loaded machine. Gives up (kills the agents
        left, their code None) only when no worker said anything for ``stall_s``: a
        job that stopped making progress, not a slow one."""
        seen, since = self._progress(), time.monotonic()
        while any(a.proc.poll() is None for a in self.live):
            now = self._progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > stall_s:
                break
            time.sleep(0.2)
        codes: dict[str, int | None] = {}
        for a in self.live:
            code = a.proc.poll()
            if code is None:
                print(f"{self.name}: agent {a.name} made no progress in {stall_s} s; "
                      f"killed:\n{a.tail()}", flush=True)
                a.kill()
            codes[a.name] = code
        return codes

    def finish(self) -> dict[str, Any]:
        """Publish the end, wait for the live nodes to end (``wait_ended``), read the
        ledger. ``finished`` is false unless every live node exited 0: then records
        counted lost may only not have been trained yet."""
        self._done.set()
        with self._lock:
            cf.fill(self.url, self.spec, self.filled, start=self.filled, finish=True)
        codes = self.wait_ended()
        counts, _ = _ledger(self.store_url, self.n, self.store_options)
        head, tail = counts[: self.filled], counts[self.filled:]
        steps = self.steps()
        first = min(t for t, _ in steps)
        done = max((t for a in self.live for t, _ in a.seen(": DONE ")), default=time.time())
        return {"finished": all(c == 0 for c in codes.values()), "exit_codes": codes,
                "records": self.filled, "once": int((head == 1).sum()),
                "lost": int((head == 0).sum()),
                "duplicated": int((head - 1).clamp(min=0).sum()) + int(tail.sum()),
                "wall_s": done - first, "incidents": read_incidents(self.url, "heal", "job")}

    def close(self) -> None:
        self._done.set()
        for a in self.every:
            a.close()
        if self.redis is not None:
            self.redis.kill()
        if self.cluster is not None:
            self.cluster.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            self.moto.stop()


def fault_free_rate(work: Path, steps: int = 120, *, warm: bool = False,
                    **shape: Any) -> float:
    """Records/s of a fault-free job of the campaign's shape (``shape``: Job's
    ``persistence``, ``cluster``, ``s3``): first step to DONE."""
    n = steps * NODES * BATCH
    job = Job(work, "fault-free", reps=0, gap_s=0, records=n, warm=warm, **shape)
    try:
        verdict = job.finish()
    finally:
        job.close()
    assert verdict["finished"] and verdict["once"] == n, verdict
    return n / verdict["wall_s"]


def crash_loop(work: Path, reps: int, *, warm: bool = False) -> dict[str, Any]:
    """A bug at one step in every attempt: handled when the breaker stops the job with
    exit 87, every agent leaving on the job stop, and a restart_loop incident, no record twice and none lost up to the newest
    checkpoint (every step of a full world consumed NODES x BATCH records)."""
    crash_at = 3 * FIRST_CKPT + 2
    job = Job(work, "crash_loop", reps=reps, gap_s=0, records=NODES * BATCH * 40,
              extra=("--crash-at", str(crash_at)), max_restarts=6, warm=warm)
    try:
        for a in job.live:
            with contextlib.suppress(AssertionError):
                a.wait(RESUME_TIMEOUT_S * 2)
        # Every agent saw its worker exit 87 and left on the job stop the workers wrote
        # (JobStoppedError) instead of restarting them: one decision stops the job.
        stopped = all(a.proc.returncode not in (None, 0)
                      and any("(exitcode: 87)" in x for _, x in a.lines)
                      and any("JobStoppedError" in x for _, x in a.lines) for a in job.live)
        found = read_incidents(job.url, "heal", "job")
        counts, step = _ledger(job.store_url, job.n)
    finally:
        job.close()
    trained = int(counts.sum())
    return {"handled": stopped and any(i.get("cause") == "restart_loop" for i in found),
            "lost": max(0, NODES * BATCH * step - int((counts == 1).sum())),
            "duplicated": int((counts - 1).clamp(min=0).sum()), "trained": trained,
            "newest_step": step, "incidents": found, "events": [], "once": trained,
            "wall_s": 0.0, "finished": stopped}

