"""What ``trainguard demo`` starts and tears down around its trainer: its children
(each in its own process group, dying with the demo on Linux), its ``redis-server``,
the dataset of token records it writes and registers, and the ingest service; and
how many records the service ingested. The run itself is :mod:`trainguard.ops.demo`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from trainguard.core.process import free_port, http_ready, wait_until
from trainguard.ops.errors import DemoError

__all__ = ["DATASET", "LENGTH", "STORE_NAME", "VOCAB", "Children", "DemoError",
           "records_ingested", "register_dataset", "start_redis", "start_service",
           "write_dataset"]

DATASET, STORE_NAME = "demo", "demo"
VOCAB, LENGTH = 64, 16


def _die_with_parent() -> None:
    """In the child: own process group, and SIGKILL when the demo dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Children:
    """Every process the demo started; ``kill_all`` leaves none behind."""

    def __init__(self, log: IO[str]):
        self.procs: list[tuple[str, subprocess.Popen[Any]]] = []
        self.log = log

    def start(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, **kwargs)
        self.procs.append((name, proc))
        print(f"started {name} pid={proc.pid}", file=self.log, flush=True)
        return proc

    @staticmethod
    def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def kill_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                self.kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            # Whatever is left in the group (the process or its children) goes now.
            self.kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


# --------------------------------------------------------------------------- pieces


def write_dataset(path: Path, records: int, seed: int) -> None:
    """Token sequences from a few affine rules with some noise: learnable, not trivial."""
    rng = random.Random(seed)
    rules = [(rng.randrange(1, VOCAB, 2), rng.randrange(VOCAB)) for _ in range(4)]
    with path.open("w") as f:
        for i in range(records):
            a, b = rules[rng.randrange(len(rules))]
            tok = [rng.randrange(VOCAB)]
            while len(tok) < LENGTH:
                nxt = (a * tok[-1] + b) % VOCAB
                tok.append(nxt if rng.random() > 0.1 else rng.randrange(VOCAB))
            f.write(json.dumps({"id": i, "tokens": tok}) + "\n")


def start_redis(children: Children, workdir: Path) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise DemoError("redis-server is not on PATH: run `make demo` (it installs it) or "
                        "install it (Debian/Ubuntu: apt-get install redis-server)")
    port = free_port()
    (workdir / "redis").mkdir()
    children.start("redis-server", [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir / "redis"),
        "--save", "", "--appendonly", "no", "--daemonize", "no",
        "--logfile", str(workdir / "redis" / "redis.log"),
    ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    _wait(lambda: _redis_ping(url), 15, f"redis-server on port {port}")
    return url


def _redis_ping(url: str) -> bool:
    import redis

    from trainer_client import redis_client

    client = redis_client.client(url, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    if not wait_until(check, timeout_s):
        raise DemoError(f"{what} was not up within {timeout_s} s")


def register_dataset(redis_url: str, source: Path, partitions: int) -> None:
    from ingest_service import redis_client
    from ingest_service.datasets import create_dataset
    from trainguard.core.streams import DatasetSpec

    async def go() -> None:
        r = redis_client.client(redis_url)
        try:
            await create_dataset(r, DatasetSpec(name=DATASET, partitions=partitions,
                                                source=str(source), format="jsonl", seed=7))
        finally:
            await r.aclose()

    asyncio.run(go())


def start_service(children: Children, workdir: Path, redis_url: str, store: Path,
                  token: str, port: int) -> str:
    env = {**os.environ, "TRAINGUARD_ADMIN_TOKEN": token,
           "TRAINGUARD_CHECKPOINT_STORES": f"{STORE_NAME}={store}"}
    log = (workdir / "service.log").open("w")
    proc = children.start("ingest service", [
        sys.executable, "-m", "trainguard", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--redis-url", redis_url,
    ], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise DemoError(f"the ingest service exited with {proc.returncode}; "
                            f"see {workdir / 'service.log'}")
        return http_ready(f"{url}/readyz")

    _wait(up, 60, f"the ingest service on {url}")
    return url


def records_ingested(redis_url: str) -> tuple[int, bool, int]:
    """(records the producer appended, producer finished, dead letters)."""
    from ingest_service import inspection, redis_client

    async def go() -> dict[str, Any]:
        r = redis_client.client(redis_url)
        try:
            return await inspection.show_dataset(r, DATASET)
        finally:
            await r.aclose()

    info = asyncio.run(go())
    total = sum(p["producer_position"]["records"] for p in info["partitions"]
                if p["producer_position"])
    return total, bool(info["producer"]["finished"]), int(info["dead_letters"])
