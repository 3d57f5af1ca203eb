"""The RAM tier's async save stages straight into its own files (``_file_staging``):
no second copy of the state in the trainer, the staged bytes inside the budget from
the start, and a save killed while staging commits nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore
from checkpoint_store._file_staging import STAGING_PHASE
from checkpoint_store._page_reuse import SPARE_DIR
from checkpoint_store.layout import DATA_DIR, INFLIGHT_DIR, MANIFEST_DIR
from checkpoint_store.ram_tier import RamTierStore, state_bytes, tree_bytes
from checkpoint_store.zarr_format import CRC_BYTES

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _state(seed: int, mb: int) -> dict[str, torch.Tensor]:
    """``mb`` MiB of float32 in four tensors, a non-contiguous one among them."""
    g = torch.Generator().manual_seed(seed)
    per = mb * MB // 4 // 4
    out = {f"t{i}": torch.randn(per, generator=g) for i in range(3)}
    out["t3"] = torch.randn(per // 64, 64, generator=g).t()  # a transposed view
    return out


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {key}")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _PrivatePeak:
    """The peak of the process's private memory (``RssAnon``: not the tier's tmpfs
    pages, which the store keeps mapped and the kernel counts in ``VmRSS`` and
    ``VmHWM``), sampled every 0.5 ms by a thread while the block runs."""

    def __enter__(self) -> _PrivatePeak:
        self.before = self.peak = _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))


def test_async_save_makes_no_second_copy_of_the_state(shm: Path) -> None:
    """An async RAM-tier save of a 32 MiB state allocates no staging buffer (the
    store's buffer pool stays empty, where a plain store's async save of the same state
    on the same tmpfs grows it to the whole state), the process's private memory during
    the save rises by under half the state (a second copy would be all of it; the
    writer's own buffers measured 2-8 MiB, 8 under load), and the committed checkpoint
    is the state as it was when save() returned, not as the loop changed it after.
    The first save into new files and the next ones, into the pages of the checkpoint
    each drops (``overwrite_oldest``), alike."""
    state = _state(1, 32)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ram = RamTierStore(shm / "ram", budget_bytes=4 * nbytes, keep_last=1, overwrite_oldest=True)
    ram.save(_state(0, 1), step=0, blocking=False).wait()  # imports, threads: warmed
    for step in (1, 2, 3):
        saved = {k: v.clone() for k, v in state.items()}  # before the peak is sampled
        with _PrivatePeak() as peak:
            handle = ram.save(state, step=step, blocking=False)
            for v in state.values():
                v.add_(1.0)  # the loop goes on while the writer seals the files
            handle.wait()
        assert ram.store._pool.capacity == 0
        back = {k: torch.zeros_like(v) for k, v in saved.items()}
        ram.load(back, step=step, strict=True)
        assert _equal(back, saved)
        assert ram.store.verify(step).step == step
        assert [m.step for m in ram.list()] == [step]
        assert tree_bytes(ram.root / DATA_DIR) >= nbytes
        rise = (peak.peak - peak.before) * 1024
        assert rise < nbytes // 2, f"save {step}: private memory rose {rise // MB} MiB"
    ram.close()


def test_a_save_rewrites_the_pages_of_the_checkpoint_it_drops(shm: Path) -> None:
    """With ``overwrite_oldest``, each async save after the first writes into the
    chunk files of the checkpoint it drops (the same inodes: their pages, mapped
    since the save that wrote them, are not allocated again), the tier never holds
    more than ``keep_last`` checkpoints with the one in flight counted, nothing is
    left in ``.spare/`` after a save, and every save loads back bitwise (small tensors
    packed end to end, odd sizes and the zeros between them included). A blocking save
    in between writes new files and frees the spares first."""
    state = _state(2, 8) | {f"small{i}": torch.randn(16) for i in range(3)} | {
        "odd": torch.arange(3, dtype=torch.uint8), "half": torch.randn(5).half(),
        "flags": torch.tensor([True, False, True])}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ram = RamTierStore(shm / "ram", budget_bytes=2 * nbytes + 4 * MB, keep_last=1,
                       overwrite_oldest=True, chunk_bytes=2 * MB)

    def inodes() -> set[int]:
        return {f.stat().st_ino for f in (ram.root / DATA_DIR).rglob("*")
                if f.is_file() and f.stat().st_size > MB}

    ram.save(state, step=1, blocking=False).wait()
    first = inodes()
    assert len(first) >= 4
    for step in (2, 3, 4):
        for v in state.values():
            if v.dtype == torch.bool:
                v.logical_not_()
            else:
                v.add_(1)
        ram.save(state, step=step, blocking=False).wait()
        assert inodes() == first, f"save {step} allocated new chunk files"
        assert [m.step for m in ram.list()] == [step]
        assert not list((ram.root / SPARE_DIR).glob("*"))
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        ram.load(back, step=step, strict=True)
        assert _equal(back, state)
    ram.save(state, step=5).wait()  # blocking: its own files
    assert not inodes() & first and not list((ram.root / SPARE_DIR).glob("*"))
    assert tree_bytes(ram.root) <= ram.policy.budget_bytes
    ram.close()


def test_a_save_into_spares_only_copies_before_it_returns(shm: Path) -> None:
    """With ``overwrite_oldest`` and a spare for every chunk, ``save(blocking=False)``
    returns having only copied: while the writer thread is held up, no uid's data
    directory or in-flight marker exists beside the dropped checkpoint's leftovers, the
    spares hold the new chunk bytes, and no manifest is committed. Once the writer
    runs, the save commits in the same inodes and loads back bitwise."""
    state = _state(3, 8)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ram = RamTierStore(shm / "ram", budget_bytes=2 * nbytes + 4 * MB, keep_last=1,
                       overwrite_oldest=True, chunk_bytes=2 * MB)
    ram.save(state, step=1, blocking=False).wait()
    dirs = {p.name for p in (ram.root / DATA_DIR).iterdir()}
    inodes = {f.stat().st_ino for f in (ram.root / DATA_DIR).rglob("*")
              if f.is_file() and f.stat().st_size > MB}
    for v in state.values():
        v.add_(1.0)
    release = threading.Event()
    ram.store._executor.submit(release.wait)  # the writer thread, held up
    handle = ram.save(state, step=2, blocking=False)
    try:
        assert {p.name for p in (ram.root / DATA_DIR).iterdir()} == dirs  # none begun
        assert not any((ram.root / INFLIGHT_DIR).glob("*"))  # no marker yet
        assert not list((ram.root / MANIFEST_DIR).iterdir())  # step 1 retired
        spares = sorted((ram.root / SPARE_DIR).iterdir())
        assert {f.stat().st_ino for f in spares} == inodes
        staged = b"".join(f.read_bytes()[:-CRC_BYTES] for f in spares)
        assert state["t0"].numpy().tobytes()[:MB] in staged
    finally:
        release.set()
    handle.wait()
    assert [m.step for m in ram.list()] == [2]
    assert {f.stat().st_ino for f in (ram.root / DATA_DIR).rglob("*")
            if f.is_file() and f.stat().st_size > MB} == inodes
    assert not list((ram.root / SPARE_DIR).iterdir())
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ram.load(back, step=2, strict=True)
    assert _equal(back, state)
    ram.close()


def test_async_saves_keep_the_budget_with_the_staging_counted(shm: Path) -> None:
    """Budget for two checkpoints and a bit: each async save's staged files are in the
    tier (and counted) as soon as save() returns, next to the checkpoint kept, and the
    tier never holds more than the budget; the oldest goes to make room, the newest
    two load exactly."""
    one = state_bytes(_state(0, 2))
    budget = 2 * one + one // 2
    ram = RamTierStore(shm, budget_bytes=budget, keep_last=10)
    states = {step: _state(step, 2) for step in range(1, 6)}
    nbytes = sum(t.numel() * t.element_size() for t in states[1].values())
    for step, state in states.items():
        handle = ram.save(state, step=step, blocking=False)
        held = ram.used_bytes()  # the save is staged, perhaps not sealed yet
        assert held <= budget
        assert held >= (2 if step > 1 else 1) * nbytes, (step, held)
        handle.wait()
        assert ram.used_bytes() <= budget
    assert [m.step for m in ram.list()] == [4, 5]
    for step in (4, 5):
        back = {k: torch.zeros_like(v) for k, v in states[step].items()}
        ram.load(back, step=step, strict=True)
        assert _equal(back, states[step])
    ram.close()


_STAGER = """
import os, sys, torch
from checkpoint_store.ram_tier import RamTierStore
from checkpoint_store._faults import CRASH_ENV
store = RamTierStore(sys.argv[1], budget_bytes=64 << 20, chunk_bytes=1 << 20)
g = torch.Generator().manual_seed(1)
store.save({"w": torch.randn(1 << 20, generator=g)}, step=1).wait()
os.environ[CRASH_ENV] = sys.argv[2]  # SIGKILL once the first chunk file is staged
store.save({"w": torch.randn(1 << 20, generator=g)}, step=2, blocking=False).wait()
print("NOT KILLED", flush=True)
"""


def test_kill_during_staging_commits_nothing(shm: Path) -> None:
    """A trainer SIGKILLed after the first of an async save's four chunk files is staged
    leaves that save uncommitted: a restart lists and loads only the step before, bit
    for bit, and ``gc`` removes the torn save's files and marker."""
    out = subprocess.run([sys.executable, "-c", _STAGER, str(shm), STAGING_PHASE], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, (out.returncode, out.stdout, out.stderr)
    torn = [d for d in (shm / DATA_DIR).iterdir()]
    assert len(torn) == 2 and len(list((shm / MANIFEST_DIR).iterdir())) == 1
    chunks = {d.name: sorted(p.name for p in d.rglob("*") if p.is_file() and
                             p.name != "zarr.json") for d in torn}
    # Step 1's four chunk files; the torn save got as far as its first one.
    assert sorted(len(c) for c in chunks.values()) == [1, 4], chunks
    assert len(list((shm / INFLIGHT_DIR).iterdir())) == 1

    store = RamTierStore(shm, budget_bytes=64 << 20, chunk_bytes=1 << 20)
    assert [m.step for m in store.list()] == [1]
    back = {"w": torch.zeros(1 << 20)}
    manifest = store.load(back, strict=True)
    assert manifest is not None and manifest.step == 1
    assert torch.equal(back["w"], torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)))
    report = store.gc()
    assert len(report.removed_data) == 1 and report.in_flight == []
    assert len(list((shm / DATA_DIR).iterdir())) == 1
    assert list((shm / INFLIGHT_DIR).iterdir()) == []
    store.close()


_RECYCLER = """
import os, sys, torch
from checkpoint_store.ram_tier import RamTierStore
from checkpoint_store._faults import CRASH_ENV
store = RamTierStore(sys.argv[1], budget_bytes=64 << 20, chunk_bytes=1 << 20, keep_last=2,
                     overwrite_oldest=True)
g = torch.Generator().manual_seed(1)
for step in (1, 2):
    store.save({"w": torch.randn(1 << 20, generator=g)}, step=step, blocking=False).wait()
os.environ[CRASH_ENV] = sys.argv[2]  # SIGKILL once the first chunk file is staged
store.save({"w": torch.randn(1 << 20, generator=g)}, step=3, blocking=False).wait()
print("NOT KILLED", flush=True)
"""


def test_kill_while_a_save_rewrites_dropped_pages_commits_nothing(shm: Path) -> None:
    """A trainer SIGKILLed while an async save writes into the chunk files of the
    checkpoint it dropped (``overwrite_oldest``, keep_last=2: step 1 dropped, its four
    files taken as spares, step 3's first chunk copied into one; their move into a data
    directory, the uid and the marker wait for the writer thread) commits nothing: a
    restart lists and loads step 2 bit for bit, removes the dead process's spares, and
    ``gc`` removes what step 1 left (its metadata, whose removal waits for the commit
    that never came); no other data directory was begun."""
    out = subprocess.run([sys.executable, "-c", _RECYCLER, str(shm), STAGING_PHASE], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, (out.returncode, out.stdout, out.stderr)
    assert len(list((shm / MANIFEST_DIR).iterdir())) == 1
    assert len(list((shm / SPARE_DIR).iterdir())) == 4

    store = RamTierStore(shm, budget_bytes=64 << 20, chunk_bytes=1 << 20, keep_last=2)
    assert not list((shm / SPARE_DIR).iterdir())
    assert [m.step for m in store.list()] == [2]
    back = {"w": torch.zeros(1 << 20)}
    manifest = store.load(back, strict=True)
    g = torch.Generator().manual_seed(1)
    torch.randn(1 << 20, generator=g)
    assert manifest is not None and manifest.step == 2
    assert torch.equal(back["w"], torch.randn(1 << 20, generator=g))
    report = store.gc()
    assert len(report.removed_data) == 1 and report.in_flight == []
    assert len(list((shm / DATA_DIR).iterdir())) == 1
    store.close()


def test_stage_in_files_is_refused_where_it_cannot_hold(tmp_path: Path) -> None:
    """``stage_in_files`` needs a local directory: a remote URL is refused at once,
    naming what to do."""
    with pytest.raises(ValueError, match="needs a local directory and a one-process store"):
        CheckpointStore("memory://staging-refused", stage_in_files=True)
    CheckpointStore(tmp_path, stage_in_files=True).close()
