"""CUDA state (skipped without a GPU; run with `make gpu-check`): CUDA tensors
round-trip bit for bit, an async save stages through pinned host memory and is a
snapshot of the moment save() returned (through the RAM tier too, one pinned buffer
reused across saves), FSDP2 and DTensor state on CUDA saves and
resumes bit for bit, through the store and through DCP's async_save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, RamTierStore
from checkpoint_store.dtypes import raw_view
from tests._ckpt_helpers import SUPPORTED_DTYPES, bits, random_tensor, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORKER = str(Path(__file__).resolve().parent / "_ckpt_fsdp_worker.py")


def _host(t: torch.Tensor) -> torch.Tensor:
    return raw_view(t).cpu().view(t.dtype)


def test_cuda_tensors_of_every_dtype_round_trip_bit_exact(tmp_path):
    """Every supported dtype on the GPU (random bits, NaNs included), saved blocking
    and non-blocking, loads into CUDA targets and into CPU ones bit for bit."""
    # Moved as raw bits: dtypes without kernels (bits, sub-byte) still move that way.
    state = {str(d): raw_view(random_tensor(d, (3, 5), seed=i)).cuda().view(d)
             for i, d in enumerate(SUPPORTED_DTYPES)}
    store = CheckpointStore(tmp_path, chunk_bytes=64)
    store.save(state, step=1)
    store.save(state, step=2, blocking=False).wait()
    for device in ("cuda", "cpu"):
        for step in (1, 2):
            target = {k: torch.empty(v.shape, dtype=v.dtype, device=device)
                      for k, v in state.items()}
            store.load(target, step=step, strict=True)
            for k, v in state.items():
                assert target[k].device.type == device
                assert torch.equal(bits(_host(target[k])), bits(_host(v))), (k, device, step)
    store.close()


def test_async_save_of_cuda_state_is_a_pinned_snapshot(tmp_path):
    """save(blocking=False) returns once the device-to-host copies are queued into
    the pinned staging buffer; kernels queued afterwards on the same stream (the next
    training step) do not reach the checkpoint, which holds the values of the moment
    save() returned."""
    w = torch.randn(1 << 22, device="cuda")
    expect = w.clone()
    store = CheckpointStore(tmp_path)
    handle = store.save({"w": w}, step=1, blocking=False)
    w.mul_(3).add_(1)  # queued behind the staging copies on the current stream
    manifest = handle.wait()
    assert store._pool.pinned and store._pool._buffer is not None
    assert store._pool._buffer.is_pinned()
    target = torch.zeros_like(expect)
    assert store.load({"w": target}, strict=True).name == manifest.name
    assert torch.equal(target, expect)
    store.close()


def test_ram_tier_save_of_cuda_state_is_a_pinned_snapshot_in_one_reused_buffer():
    """The RAM tier's GPU path: save(blocking=False) of CUDA state stages into pinned
    host memory, the checkpoint holds the values of the moment save() returned
    although the loop changes the tensors right after, a restore into CUDA tensors
    is bitwise equal, and three saves use one staging buffer (same address)."""
    import shutil
    import uuid

    root = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    w = torch.randn(1 << 22, device="cuda")
    store = RamTierStore(root, budget_bytes=64 << 20, keep_last=1)
    try:
        addresses = set()
        for step in (1, 2, 3):
            expect = w.clone()
            handle = store.save({"w": w}, step=step, blocking=False)
            w.mul_(3).add_(1)  # queued behind the staging copies on the current stream
            handle.wait()
            buf = store.store._pool._buffer
            assert buf is not None and buf.is_pinned()
            addresses.add(buf.data_ptr())
            target = torch.zeros_like(w)
            store.load({"w": target}, step=step, strict=True)
            assert torch.equal(target, expect), step
        assert len(addresses) == 1, addresses
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cuda_worker_env(monkeypatch):
    monkeypatch.setenv("CKPT_DEVICE", "cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.mark.parametrize("api", ["store", "dcp_async"])
def test_fsdp2_on_cuda_resumes_bit_exact_after_a_kill_mid_save(tmp_path, monkeypatch,
                                                                cuda_worker_env, api):
    """FSDP2 + AdamW on the GPU (NCCL): killed mid-save of step 4, step 2 loads and the
    resumed run matches the uninterrupted one bit for bit; through the store and
    through DCP's async_save (CUDA state staged by DCP) with trainguard's backend."""
    monkeypatch.setenv("CKPT_API", api)
    root = tmp_path / "ckpt"
    run_ranks(WORKER, "train", 1, str(root), "0", killed=frozenset({0}))
    assert [m.step for m in CheckpointStore(root).list()] == [2]
    (out,) = run_ranks(WORKER, "resume", 1, str(root), "train")
    assert (out["step"], out["diff"], out["final_diff"]) == (2, [], [])


def test_dtensor_on_cuda_saves_once_and_loads_into_other_placements(tmp_path,
                                                                    cuda_worker_env):
    """DTensors on a CUDA mesh: bytes go through to_local() and the pinned path; the
    checkpoint holds each tensor once and loads into other placements bit for bit."""
    (out,) = run_ranks(WORKER, "dtensor", 1, str(tmp_path / "ckpt"))
    assert out["diff"] == []
    assert out["nbytes"]["d/rows"] == 5 * 7 * 4 and out["nbytes"]["d/one"] == 0
