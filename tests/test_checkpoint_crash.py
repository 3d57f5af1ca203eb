"""Crash consistency: a saving process SIGKILLed at each step of the commit protocol
leaves the last committed checkpoint loadable, and gc removes exactly the debris."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore
from checkpoint_store._faults import CRASH_ENV, PHASES, STOP_ENV
from tests._ckpt_helpers import empty_state, state_for

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_ckpt_worker.py"
CHUNK = 4096  # the 64x64 float32 weight becomes 4 chunk files: "mid-data" is real
COMMITTED_AFTER = {"before-pointer", "after-pointer", "retired"}


def _spawn(url: str, step: int, env_extra: dict[str, str], options: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    args = [sys.executable, str(WORKER), url, str(step), str(CHUNK)]
    if options is not None:
        args.append(json.dumps(options))
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _assert_loads_step(store: CheckpointStore, step: int) -> None:
    target = empty_state(width=64)
    manifest = store.load(target, strict=True)
    assert manifest is not None and manifest.step == step
    expected = state_for(step, width=64)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])
    assert target["step"] == step and manifest.extra == {"offsets": {"p0": f"1-{step}"}}


def _local_debris(root: Path, store: CheckpointStore) -> set[str]:
    kept = {m.uid for m in store.list()}
    data = {p.name for p in (root / "data").iterdir()} - kept
    inflight = {p.name for p in (root / "inflight").iterdir()} if (root / "inflight").exists() else set()
    temps = {p.name for p in root.rglob(".tmp-*")}
    return data | inflight | temps


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_at_each_phase_keeps_last_committed(tmp_path, phase):
    """SIGKILL at ``phase`` of saving step 2 over a committed step 1: before the
    manifest exists, step 1 loads (strict, so nothing damaged is seen); from the
    manifest on, step 2 loads. gc then leaves only committed data behind."""
    root = tmp_path / "ckpt"
    url = f"file://{root}"
    store = CheckpointStore(url, chunk_bytes=CHUNK)
    store.save(state_for(1, width=64), step=1, extra={"offsets": {"p0": "1-1"}})

    proc = _spawn(url, 2, {CRASH_ENV: phase})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert b"saved" not in out

    committed = 2 if phase in COMMITTED_AFTER else 1
    _assert_loads_step(store, committed)
    assert [m.step for m in store.list()] == ([1, 2] if committed == 2 else [1])

    report = store.gc()
    assert _local_debris(root, store) == set()
    if phase in ("mid-data", "after-data", "mid-manifest"):
        assert len(report.removed_data) == 1
    assert report.in_flight == []
    _assert_loads_step(store, committed)


def test_kill_9_between_retiring_and_removing_data_leaves_debris_for_gc(tmp_path):
    """keep_last=2, steps 1 and 2 committed; the save of step 3 is SIGKILLed after its
    commit and after retention deleted step 1's manifest, before step 1's data went
    (that removal runs after the save returned). Step 1 is no checkpoint any more, its
    data is debris that gc removes, and step 3 loads."""
    root = tmp_path / "ckpt"
    url = f"file://{root}"
    store = CheckpointStore(url, chunk_bytes=CHUNK, keep_last=2)
    first = store.save(state_for(1, width=64), step=1, extra={"offsets": {"p0": "1-1"}})
    store.save(state_for(2, width=64), step=2, extra={"offsets": {"p0": "1-2"}})

    proc = _spawn(url, 3, {CRASH_ENV: "retired"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]

    assert [m.step for m in store.list()] == [2, 3]
    assert (root / "data" / first.manifest.uid).is_dir()  # the data outlived the kill
    report = store.gc()
    assert report.removed_data == [f"data/{first.manifest.uid}"]
    assert _local_debris(root, store) == set()
    _assert_loads_step(store, 3)


@pytest.mark.parametrize("phase", [
    "mid-manifest",
    pytest.param("mid-data", marks=pytest.mark.chaos),
    pytest.param("before-pointer", marks=pytest.mark.chaos),
])
def test_kill_9_on_s3(moto_server, s3_bucket, phase):
    """The same on S3 (moto over HTTP): an unfinished manifest upload publishes
    nothing; a finished one is the commit even without LATEST."""
    url, options = f"s3://{s3_bucket}/run", moto_server.storage_options()
    store = CheckpointStore(url, storage_options=options, chunk_bytes=CHUNK)
    store.save(state_for(1, width=64), step=1, extra={"offsets": {"p0": "1-1"}})
    proc = _spawn(url, 2, {CRASH_ENV: phase}, options)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    committed = 2 if phase in COMMITTED_AFTER else 1
    _assert_loads_step(store, committed)
    store.gc()
    data = store._backend.listdir("data")
    assert sorted(data) == sorted(m.uid for m in store.list())


def _wait_stopped(pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} did not reach the stop phase")


def test_gc_leaves_a_live_save_in_flight_alone(tmp_path):
    """A writer stopped mid-data (alive, not crashed) keeps its data through gc;
    once resumed it commits and its checkpoint loads."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(f"file://{root}", chunk_bytes=CHUNK)
    store.save(state_for(1, width=64), step=1, extra={"offsets": {"p0": "1-1"}})
    proc = _spawn(f"file://{root}", 2, {STOP_ENV: "mid-data"})
    try:
        _wait_stopped(proc.pid)
        report = store.gc()
        assert len(report.in_flight) == 1 and report.removed_data == []
        assert (root / "data" / report.in_flight[0]).is_dir()
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"saved" in out, err.decode()[-2000:]
    _assert_loads_step(store, 2)
    assert store.gc().removed_data == []


@pytest.mark.chaos
def test_kill_9_at_random_moments(tmp_path):
    """50 times: a process saving continuously (keep_last=2, blocking and async) is
    SIGKILLed at a random moment; each time a strict load returns a committed step
    whose data is exact, the newest step never goes back, and gc leaves no debris."""
    import random

    root = tmp_path / "ckpt"
    url = f"file://{root}"
    store = CheckpointStore(url, chunk_bytes=CHUNK)
    rng = random.Random(1234)
    newest, next_step = 0, 1
    for _ in range(50):
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), url, str(next_step), str(CHUNK), "loop"],
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE)
        time.sleep(rng.uniform(1.0, 4.0))
        proc.kill()
        proc.communicate(timeout=60)
        latest = store.latest()
        if latest is None:
            continue
        assert latest.step >= newest
        newest = latest.step
        _assert_loads_step(store, newest)
        store.gc()
        assert _local_debris(root, store) == set()
        next_step = newest + 1


def test_error_after_the_manifest_landed_keeps_the_committed_save(tmp_path, monkeypatch,
                                                                  caplog):
    """An error raised after the manifest is in place (an injected I/O error at
    "before-pointer", as a PUT whose response is lost would raise): the manifest is
    the commit, so the save succeeds, keeps its data, updates LATEST and loads
    bit-exact with strict=True, instead of failing with its data deleted."""
    from checkpoint_store._faults import FAIL_ENV

    store = CheckpointStore(tmp_path, chunk_bytes=CHUNK)
    monkeypatch.setenv(FAIL_ENV, "before-pointer")
    manifest = store.save(state_for(1, width=64), step=1,
                          extra={"offsets": {"p0": "1-1"}}).wait()
    monkeypatch.delenv(FAIL_ENV)
    assert manifest.step == 1 and "although the commit reported OSError" in caplog.text
    assert json.loads((tmp_path / "LATEST").read_text())["manifest"] == manifest.name
    _assert_loads_step(CheckpointStore(tmp_path), 1)
    store.close()
