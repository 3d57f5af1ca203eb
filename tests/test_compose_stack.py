"""docker-compose.yml started for real: a private dockerd, every image built on a
debootstrap base, the stack up, the trainer SIGKILLed mid-run and restarted by its
restart policy, every record trained exactly once, the stack down with nothing left.

Under the ``compose`` marker (``make compose-test``): minutes, most of them builds.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests import _compose_stack as stack
from trainguard.core.process import free_port

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

RECORDS = 4000  # 125 steps of 50 ms: seconds between the first checkpoint and the end
CHECKPOINT_EVERY = 20  # the trainer's default; the kill comes after the first one


def _events(eng: stack.Engine, compose: list[str]) -> list[dict[str, Any]]:
    out = subprocess.run([*compose, "logs", "--no-log-prefix", "trainer"], env=eng.env,
                         capture_output=True, text=True, check=True).stdout
    events = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def _wait(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _admin(port: int, token: str, path: str) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.load(r))


def _ledger(mountpoint: str) -> list[int]:
    import torch

    from checkpoint_store import CheckpointStore

    with CheckpointStore(f"file://{mountpoint}/mlp") as cs:
        state = {"ledger": torch.zeros(RECORDS, dtype=torch.int32)}
        assert cs.load(state, keys=["ledger"], strict=True) is not None
        return list(state["ledger"].tolist())


def test_the_stack_trains_every_record_exactly_once_through_a_sigkill(tmp_path: Path):
    """Stack up on images built here; the trainer container's process SIGKILLed after
    its first checkpoint comes back by itself and resumes; the ledger in the
    checkpoint volume says every record was trained exactly once (0 lost, 0
    duplicated), and the service's producer ingested every record with no dead
    letter; after `down`, no container, no dockerd and no mount of it remain."""
    try:
        stack.require_tools()
    except stack.StackUnavailable as e:
        pytest.skip(str(e))
    project = f"tgtest{secrets.token_hex(3)}"
    port = free_port()
    with stack.engine(tmp_path) as eng:
        base = stack.build_base(eng)
        eng.env.update({
            "TRAINGUARD_BASE_IMAGE": base, "TRAINGUARD_REDIS_IMAGE": base,
            "TRAINGUARD_HOST_PORT": str(port), "TRAINGUARD_RECORDS": str(RECORDS),
            "REDIS_PASSWORD": secrets.token_hex(8), "MINIO_ROOT_USER": "tg",
            "MINIO_ROOT_PASSWORD": secrets.token_hex(8),
            "TRAINGUARD_ADMIN_TOKEN": secrets.token_hex(8),
        })
        compose = [str(stack.COMPOSE_BIN), "-f", str(stack.ROOT / "docker-compose.yml"),
                   "-p", project, "--profile", "trainer"]
        try:
            # trainguard, example-data and trainer are one image (trainguard:local):
            # built once here, which `up` then finds; Redis runs on the base itself.
            subprocess.run([*compose, "build", "trainguard"], env=eng.env, check=True,
                           timeout=3000)
            subprocess.run([*compose, "up", "-d", "--wait", "redis", "trainguard"],
                           env=eng.env, check=True, timeout=600)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
                assert r.status == 200
            subprocess.run([*compose, "up", "-d", "trainer"], env=eng.env, check=True,
                           timeout=600)

            def checkpointed() -> bool:
                return any(e["event"] == "checkpoint" for e in _events(eng, compose))

            _wait(checkpointed, 600, "the trainer's first checkpoint")
            cid = subprocess.run([*compose, "ps", "-q", "trainer"], env=eng.env, check=True,
                                 capture_output=True, text=True).stdout.strip()
            pid = int(eng.docker("inspect", "-f", "{{.State.Pid}}", cid,
                                 capture=True).stdout)
            assert pid > 0, "the trainer exited before the kill"  # pid 0: our own group
            os.kill(pid, signal.SIGKILL)  # a crash, not a stop: on-failure restarts it

            def finished() -> dict[str, Any] | None:
                done = [e for e in _events(eng, compose) if e["event"] == "done"]
                return done[-1] if done else None

            done = _wait(finished, 900, "the restarted trainer to finish")
            events = _events(eng, compose)
            restored = [e for e in events if e["event"] == "restored" and e["step"] > 0]
            assert restored, "the restarted trainer did not resume from a checkpoint"
            # Ingested through the service's producer: all of it, no dead letter.
            info = _admin(port, eng.env["TRAINGUARD_ADMIN_TOKEN"], "/admin/datasets/demo")
            ingested = sum(p["producer_position"]["records"] for p in info["partitions"]
                           if p["producer_position"])
            assert (ingested, info["producer"]["finished"], info["dead_letters"]) == \
                (RECORDS, True, 0)
            volume = f"{project}_checkpoints"
            mountpoint = eng.docker("volume", "inspect", "-f", "{{.Mountpoint}}", volume,
                                    capture=True).stdout.decode().strip()
            ledger = _ledger(mountpoint)
            assert sum(1 for c in ledger if c == 0) == 0, "records lost"
            assert sum(c - 1 for c in ledger if c > 1) == 0, "records duplicated"
            assert done["trained"] == RECORDS and done["duplicated"] == 0 == done["unseen"]
        finally:
            subprocess.run([*compose, "down", "-v", "--remove-orphans"], env=eng.env,
                           timeout=600)
        left = eng.docker("ps", "-aq", capture=True).stdout.decode().split()
        assert left == [], f"containers left after down: {left}"
        assert eng.proc is not None
        dockerd_pid = eng.proc.pid
    with open("/proc/self/mounts") as f:
        mounts = [line for line in f if str(tmp_path) in line or str(eng.data_root) in line]
    assert mounts == [], mounts
    assert eng.proc is None and not Path(f"/proc/{dockerd_pid}").exists(), "dockerd runs"
