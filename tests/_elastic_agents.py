"""Test helper: torchrun agents as "nodes" of one elastic job, on this machine.

Each :class:`Agent` is a ``python -m torch.distributed.run --nproc-per-node=1``
process in a session of its own; ``kill()`` is kill -9 of the whole node: the
agent's process group and its worker's (torchrun gives each worker a session). The agents run
the ledger job (tests/_client_train.py) and their lines are collected per agent.

The trainguard backend is found through the ``torchrun.handlers`` entry point, as
torchrun finds any: installed by ``make setup`` (pyproject.toml); a checkout that was
not installed can put a ``*.dist-info`` with that entry point on PYTHONPATH
(``TRAINGUARD_EXTRA_PYTHONPATH`` is added to the agents' PYTHONPATH for that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainguard.core import incidents as inc

ROOT = Path(__file__).resolve().parents[1]

FAST_CONF = "join_timeout=120,close_timeout=10"


def agent_command(backend: str, endpoint: str, run_id: str, nnodes: str, job_args: list[str],
                  *, max_restarts: int = 3, conf: str | None = FAST_CONF,
                  entry: tuple[str, ...] = ("-m", "tests._client_train"),
                  warm: bool = False) -> list[str]:
    """torchrun's command line for one node; ``conf`` None: torch's defaults. ``warm``:
    the workers start through ``trainguard.elastic.warm`` (forked by the node's zygote)."""
    # "--": torchrun would read the job's --run as an abbreviation of its --run-path;
    # warm, the one "--" goes before the entry (torchrun would read its -m as its own).
    run = ["-m", "trainguard.elastic.warm", "--", *entry] if warm else [*entry, "--"]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
        "--nproc-per-node=1", f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}", f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        *([f"--rdzv-conf={conf}"] if conf else []), *run, *job_args,
    ]


def agent_env() -> dict[str, str]:
    extra = os.environ.get("TRAINGUARD_EXTRA_PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(ROOT), extra) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1"}


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: Linux)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue
            out += children
            todo += children
    return out


class Agent:
    """One node: a torchrun agent and its worker. ``lines`` holds what both print
    (the ledger job's ``<rank>: WORD step`` lines and the agent's log), each with
    the wall-clock time it was read (bench/rdzv_recovery.py lays phases on it)."""

    def __init__(self, name: str, command: list[str], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(command, cwd=ROOT, env={**agent_env(), **(env or {})},
                                     text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.time()
            self.log.write(line)
            self.log.flush()
            with self._lock:
                self.lines.append((now, line.rstrip("\n")))

    def seen(self, needle: str) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, x) for t, x in self.lines if needle in x]

    def kill(self) -> None:
        """kill -9 of the node: the agent's process group and its workers' (torchrun
        starts each worker in a session of its own). The agent is stopped first, so
        it neither reacts nor starts another worker while the groups are killed."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)
        groups = {self.proc.pid}
        for pid in _descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agent {self.name} did not finish in {timeout_s} s: "
                                 f"{self.tail()}") from None

    def tail(self, n: int = 30) -> str:
        with self._lock:
            return "\n".join(x for _, x in self.lines[-n:])

    def close(self) -> None:
        self.kill()
        self._pump.join(5)
        self.log.close()


def wait_for(agents: list[Agent], needle: str, *, count: int = 1, timeout_s: float = 120.0
             ) -> None:
    """Until ``count`` lines containing ``needle`` were printed across ``agents``."""
    deadline = time.monotonic() + timeout_s
    while sum(len(a.seen(needle)) for a in agents) < count:
        if time.monotonic() > deadline:
            tails = "\n---\n".join(f"{a.name}:\n{a.tail()}" for a in agents)
            raise AssertionError(f"no {count}x {needle!r} within {timeout_s} s:\n{tails}")
        if all(a.proc.poll() is not None for a in agents):
            tails = "\n---\n".join(f"{a.name}:\n{a.tail()}" for a in agents)
            raise AssertionError(f"every agent exited before {needle!r}:\n{tails}")
        time.sleep(0.02)


def read_incidents(url: str, dataset: str, run: str) -> list[dict[str, Any]]:
    """The incidents a job recorded in Redis (one server or a cluster), by attempt."""
    from trainer_client import redis_client

    r = redis_client.client(url)
    try:
        docs = inc.documents(r.hgetall(inc.incidents_key(dataset, run))).values()
    finally:
        r.close()
    return sorted(docs, key=lambda d: int(d.get("attempt") or 0))


def rank0_agent(agents: list[Agent]) -> Agent:
    """The agent whose worker trained as rank 0 first (c10d would host its store)."""
    firsts = [(a.seen("0: READY")[0][0], a) for a in agents if a.seen("0: READY")]
    assert firsts, "no worker printed READY as rank 0"
    return min(firsts, key=lambda x: x[0])[1]


def worker_store_rounds(url: str, run_id: str) -> dict[tuple[int, str], int]:
    """The workers' process-group stores of rendezvous ``run_id`` found in the Redis at
    ``url``: how many keys each (round, members) prefix holds."""
    from trainer_client import redis_client
    from trainguard.elastic import keys

    pattern = f"{keys.PREFIX}:\\{{{run_id}\\}}:k:{keys.WORKER_STORE_PREFIX}/*"
    r = redis_client.client(url)
    try:
        names = [k.decode() if isinstance(k, bytes) else k
                 for k in r.scan_iter(match=pattern, count=1000)]
    finally:
        r.close()
    out: dict[tuple[int, str], int] = {}
    for name in names:
        _, _, rest = name.partition(f":k:{keys.WORKER_STORE_PREFIX}/")
        round_, members, _ = rest.split("/", 2)
        out[(int(round_), members)] = out.get((int(round_), members), 0) + 1
    return out
