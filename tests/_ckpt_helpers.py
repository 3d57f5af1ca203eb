"""Shared helpers of the checkpoint_store tests (importable by subprocess workers)."""

from __future__ import annotations

import torch

from checkpoint_store import CheckpointStore
from checkpoint_store.direct import DirectLoad
from checkpoint_store.dtypes import _BY_NAME, is_supported
from checkpoint_store.flatten import decode_skeleton
from checkpoint_store.layout import data_dir
from checkpoint_store.loading import Applier
from checkpoint_store.reader import ChunkReader

SUPPORTED_DTYPES = sorted((d for d in _BY_NAME.values() if is_supported(d)), key=str)
SHAPES: list[tuple[int, ...]] = [(), (0,), (0, 3), (7,), (3, 5), (2, 3, 4)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all): only a bit-exact store round-trips them."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes in C order, as uint8 (for bit-exact comparison)."""
    if t.dtype == torch.complex128:
        flat = t.clone().contiguous().reshape(-1).view(torch.float64)
    else:
        from checkpoint_store.dtypes import raw_view

        flat = raw_view(t).clone().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def zeroed(t: torch.Tensor) -> torch.Tensor:
    """A contiguous all-zero-bits tensor like ``t`` (works for dtypes without kernels)."""
    from checkpoint_store.dtypes import raw_view

    out = torch.empty(t.shape, dtype=t.dtype)
    raw_view(out).zero_()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def state_for(step: int, *, width: int = 8) -> dict[str, object]:
    """A small training-like state whose every value depends on ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(width, width, generator=g),
        "b": torch.randn(width, generator=g).to(torch.bfloat16),
        "step": step,
        "name": f"run-{step}",
    }



def empty_state(*, width: int = 8) -> dict[str, object]:
    """A load target shaped like ``state_for(..., width=width)``, holding none of its values."""
    return {"w": torch.zeros(width, width), "b": torch.zeros(width, dtype=torch.bfloat16),
            "step": -1, "name": ""}


def run_ranks(worker: str, mode: str, world: int, root: str, *extra: str,
              killed: frozenset[int] = frozenset(), timeout_s: float = 240) -> list[dict]:
    """Run ``world`` gloo ranks of ``worker`` (``MODE RANK WORLD PORT ROOT EXTRA...``)
    and return each rank's last JSON line; ranks in ``killed`` must die by SIGKILL
    (and give ``{}``). The timeout only guards against a hang: a rank stuck in a
    collective fails the test instead of stalling the suite."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.servers import free_port

    repo = Path(__file__).resolve().parent.parent
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    procs = [
        subprocess.Popen([sys.executable, worker, mode, str(r), str(world), str(port), root,
                          *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(world)
    ]
    results: list[dict] = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {r} of {mode} hung for {timeout_s} s") from None
        if r in killed:
            assert p.returncode == -signal.SIGKILL, (p.returncode, err.decode()[-3000:])
            results.append({})
            continue
        assert p.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def claimed_in_place(store: CheckpointStore, target: dict[str, object]) -> set[str]:
    """Keys of ``target`` that a load of the newest checkpoint reads in place (the direct
    path) on this rank; the others go through the staged reader."""
    m = store.list()[-1]
    reader = ChunkReader(store._backend, data_dir(m.uid), m.arrays, io_threads=2)
    direct = DirectLoad(store._backend, data_dir(m.uid), m.arrays, io_threads=2)
    applier = Applier(m.name, m.tensors, reader, direct)
    applier.prepare(target, decode_skeleton(m.state), None)
    return set(applier.claimed)
