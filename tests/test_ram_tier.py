"""The RAM tier (``checkpoint_store.ram_tier``): checkpoints in /dev/shm that outlive
the process, under a byte budget that no save ever exceeds."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore
from checkpoint_store.ram_tier import RamTierFullError, RamTierStore, memory_backed, tree_bytes
from tests import _client_fill as cf
from tests import _client_ledger as ledger
from trainguard.core.checkpoints import CheckpointError, CheckpointStoreAPI
from trainguard.core.record import RECORD_VERSION

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _state(seed: int, mb: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mb * MB // 4, generator=g)}


_SAVER = """
import os, sys, torch
from checkpoint_store.ram_tier import RamTierStore
store = RamTierStore(sys.argv[1], budget_bytes=64 << 20)
g = torch.Generator().manual_seed(7)
store.save({"w": torch.randn(1 << 18, generator=g)}, step=5, extra={"o": 1}).wait()
print("COMMITTED", flush=True)
os.kill(os.getpid(), 9)  # no close, no atexit: the process dies as a crash does
"""


def test_restarted_process_restores_from_shared_memory(shm: Path) -> None:
    """A process SIGKILLs itself after committing to the RAM tier; a new process finds
    the checkpoint in shared memory (tmpfs, no disk) bit for bit, with its extra."""
    out = subprocess.run([sys.executable, "-c", _SAVER, str(shm)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9 and "COMMITTED" in out.stdout, out.stderr
    assert memory_backed(shm) in ("tmpfs", "ramfs")
    store = RamTierStore(shm, budget_bytes=64 << 20)
    state = {"w": torch.zeros(1 << 18)}
    m = store.load(state)
    assert m is not None and m.step == 5 and dict(m.extra) == {"o": 1}
    assert torch.equal(state["w"], torch.randn(1 << 18, generator=torch.Generator().manual_seed(7)))
    store.close()


def test_budget_is_never_exceeded_drop_oldest(shm: Path) -> None:
    """Budget for ~2.5 checkpoints of 1 MiB, keep_last far above it: after every one of
    8 saves the tier holds at most the budget, and the newest checkpoint loads exactly."""
    budget = int(2.5 * MB) + 600_000
    store = RamTierStore(shm, budget_bytes=budget, keep_last=10)
    for step in range(8):
        store.save(_state(step), step=step, blocking=step % 2 == 0).wait()
        assert tree_bytes(shm) <= budget, f"step {step}: {tree_bytes(shm)} > {budget}"
    steps = [m.step for m in store.list()]
    assert steps[-1] == 7 and len(steps) < 8, steps
    got = {"w": torch.zeros(MB // 4)}
    store.load(got)
    assert torch.equal(got["w"], _state(7)["w"])
    store.close()


def test_wait_policy_waits_until_a_copy_may_be_dropped(shm: Path) -> None:
    """on_full='wait': while may_drop refuses, a save that does not fit waits and writes
    nothing; once allowed, it drops the oldest and commits, within the budget."""
    budget = 2 * MB + 700_000
    store = RamTierStore(shm, budget_bytes=budget, keep_last=10, on_full="wait",
                         full_timeout_s=120.0)
    allowed: set[str] = set()
    store.may_drop = allowed.__contains__
    store.save(_state(0), step=0).wait()
    store.save(_state(1), step=1).wait()
    before = [m.name for m in store.list()]
    done = threading.Event()
    errors: list[BaseException] = []

    def third() -> None:
        try:
            store.save(_state(2), step=2).wait()
        except BaseException as e:  # reported by the assert below
            errors.append(e)
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(1.0), "the save did not wait for room"
    assert [m.name for m in store.list()] == before
    allowed.add(before[0])
    store.notify()
    assert done.wait(60.0) and not errors, errors
    t.join()
    assert [m.step for m in store.list()] == [1, 2]
    assert tree_bytes(shm) <= budget
    store.close()


def test_wait_policy_times_out_with_a_clear_error(shm: Path) -> None:
    """on_full='wait' with nothing droppable: RamTierFullError after the timeout, the
    message says what to do, and the committed checkpoints are untouched."""
    store = RamTierStore(shm, budget_bytes=MB + 400_000, on_full="wait", full_timeout_s=0.3)
    store.may_drop = lambda _name: False
    store.save(_state(0), step=0).wait()
    with pytest.raises(RamTierFullError, match="raise budget_bytes"):
        store.save(_state(1), step=1)
    assert [m.step for m in store.list()] == [0]
    store.close()


def test_state_larger_than_the_budget_is_refused_and_nothing_written(shm: Path) -> None:
    """A state bigger than the whole budget: a clear error, no bytes written."""
    store = RamTierStore(shm, budget_bytes=MB // 2)
    with pytest.raises(RamTierFullError, match="does not fit the RAM tier's budget"):
        store.save(_state(0), step=0)
    assert store.list() == [] and tree_bytes(shm) == 0
    store.close()


def test_a_root_on_disk_is_refused(tmp_path: Path) -> None:
    """A root that is not memory-backed is refused, naming what to do (unless asked)."""
    if memory_backed(tmp_path) is not None:
        pytest.skip("tmp_path is itself on tmpfs here")
    with pytest.raises(CheckpointError, match="not on a memory-backed file system"):
        RamTierStore(tmp_path / "ram", budget_bytes=MB)
    RamTierStore(tmp_path / "ram", budget_bytes=MB, require_memory=False).close()


def test_ram_tier_has_the_disk_format_and_the_shared_api(shm: Path) -> None:
    """Same FORMAT.md layout: a plain CheckpointStore reads the RAM tier's checkpoint
    and verifies its checksums; the class has every CheckpointStoreAPI method."""
    store = RamTierStore(shm, budget_bytes=8 * MB)
    store.save(_state(3), step=3).wait()
    plain = CheckpointStore(shm)
    assert plain.verify(3).step == 3
    plain.close()
    for name in [n for n in dir(CheckpointStoreAPI) if not n.startswith("_")]:
        assert hasattr(store, name), name
    store.close()


def test_ledger_with_the_ram_tier_as_store_survives_kills(redis_server, shm: Path,
                                                         tmp_path: Path) -> None:
    """8 SIGKILLs of a job whose store= is a RamTierStore (budget for 3 checkpoints):
    every record trained exactly once, per the final checkpoint's ledger, on the
    per-rank layout (session record 3: offsets in the rank's state object)."""
    n, p = 1500, 4
    spec = cf.create(redis_server.url, "tok", partitions=p)
    cf.fill(redis_server.url, spec, n)
    args = ["--redis", redis_server.url, "--dataset", "tok", "--run", "exp",
            "--store", str(shm), "--n", str(n), "--batch-size", "8", "--ckpt-every", "8",
            "--sleep-ms", "2", "--ram-tier-budget", str(3 * 256 << 10)]
    kills = ledger.run_until_done(args, kills=8, seed=3, log=tmp_path / "job.log")
    assert kills == 8
    counts, extra = ledger.final_counts(f"file://{shm}", n)
    ledger.assert_each_once(counts)
    assert extra["trainguard"]["version"] == RECORD_VERSION and len(extra["trainguard"]["offsets"]) == p
    assert tree_bytes(shm) <= 3 * 256 << 10
