"""Test helper: per-node tier servers (``python -m checkpoint_store.partner``) as real
processes, each with its own root in /dev/shm; a node's loss is a SIGKILL of its
server and the removal of its memory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]


class TierServers:
    """``nodes`` tier servers; node ``r`` keeps its memory under ``shm/node<r>``."""

    def __init__(self, shm: Path, nodes: int, *, budget_bytes: int = 256 << 20,
                 keep_copies: int = 2) -> None:
        self.shm = shm
        self.budget_bytes = budget_bytes
        self.keep_copies = keep_copies
        self.ports = [free_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen[str] | None] = [None] * nodes
        for node in range(nodes):
            self.start(node)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def node_shm(self, node: int) -> Path:
        return self.shm / f"node{node}"

    def start(self, node: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint_store.partner", "--root",
             str(self.node_shm(node)), "--node", str(node), "--port", str(self.ports[node]),
             "--budget-bytes", str(self.budget_bytes), "--keep-copies", str(self.keep_copies)],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("SERVING"), f"tier server {node} did not start: {line!r}"
        self.procs[node] = proc

    def kill(self, node: int) -> None:
        proc = self.procs[node]
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            self.procs[node] = None

    def lose(self, node: int) -> None:
        """The node is gone: its server killed, its memory (own tier and the copies it
        kept for others) wiped."""
        self.kill(node)
        shutil.rmtree(self.node_shm(node), ignore_errors=True)

    def close(self) -> None:
        for node in range(len(self.procs)):
            self.kill(node)


@contextlib.contextmanager
def tier_servers(shm: Path, nodes: int, *, keep_copies: int = 2) -> Iterator[TierServers]:
    servers = TierServers(shm, nodes, keep_copies=keep_copies)
    try:
        yield servers
    finally:
        servers.close()
