"""The RAM tier's GPU path, for ``make gpu-check``: CUDA state saved to the RAM tier
through the store's pinned staging buffer, restored bit for bit, and the loop's stall
against a plain ``.cpu()`` copy of the same state, in interleaved rounds.

    python bench/tiers_gpu.py [--device cuda|cpu] [--size-mib 256] [--rounds 4]

What it checks, and prints as ``tiers gpu:`` lines (gpu_check keeps those):

- a save of CUDA state (``save(blocking=False)``, the session's save) copies into one
  pinned host buffer, the same buffer on every save (no allocation in steady state);
  a save of CPU state allocates no buffer at all (it stages into the tier's files);
- the checkpoint holds the values of the moment ``save`` returned, although the loop
  changes the tensors in place right after: the device-to-host copies are queued on
  the current stream, so the loop's later kernels run after them, and the writer
  waits on the event recorded behind them;
- a restore into CUDA tensors is bitwise equal to the state;
- the stall: ``save(blocking=False)`` until its copies are done (a synchronize of the
  current stream; on a CPU state the copies are done on return) against
  ``{k: v.cpu()}`` (on CPU state: ``clone()``). Target: <= 1.2x.

``--device cpu`` runs the same checks on CPU state (the path every machine has; the
tests run it). ``--device cuda`` where torch sees no CUDA device prints one SKIP line
and exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rounds as rd

from checkpoint_store.ram_tier import RamTierStore

PREFIX = "tiers gpu:"


def state_on(device: str, size_mib: int) -> dict[str, torch.Tensor]:
    """8 float32 tensors and one bfloat16 (no numpy dtype: the raw-bytes path)."""
    g = torch.Generator().manual_seed(0)
    per = size_mib * 2**20 // 4 // 8
    state = {f"layer{i}": torch.randn(per, generator=g) for i in range(8)}
    state["embed_bf16"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    return {k: v.to(device) for k, v in state.items()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def check(device: str, size_mib: int, rounds: int, root: Path) -> dict[str, Any]:
    """The checks of the module doc; raises AssertionError on the first that fails."""
    state = state_on(device, size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ram = RamTierStore(root, budget_bytes=4 * nbytes + (16 << 20), keep_last=1)
    pool = ram.store._pool
    try:
        # The snapshot: changed in place right after save() returns, saved as before.
        expect = {k: v.clone() for k, v in state.items()}
        handle = ram.save(state, step=1, blocking=False)
        for v in state.values():
            v.mul_(3).add_(1)  # the next training step, queued behind the staging copies
        manifest = handle.wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ram.load(target, step=1, strict=True) is not None
        for k in state:
            assert target[k].device.type == device, (k, target[k].device)
            assert torch.equal(target[k].cpu().flatten().view(torch.uint8),
                               expect[k].cpu().flatten().view(torch.uint8)), (
                f"{k}: the checkpoint does not hold the values of the moment save() returned")
        buffers = set()

        def async_save() -> int:
            ram.save(state, step=next(steps), blocking=False)
            sync(device)  # the loop's stall: until the device-to-host copies are done
            if pool._buffer is not None:
                buffers.add(pool._buffer.data_ptr())
            return nbytes

        def plain_copy() -> int:
            copies = ({k: v.cpu() for k, v in state.items()} if device == "cuda"
                      else {k: v.clone() for k, v in state.items()})
            del copies
            return nbytes

        def settle(_name: str) -> None:
            ram.store._wait_current()  # the background write is not the loop's

        steps = iter(range(2, 10**6))
        baseline = ".cpu() copy" if device == "cuda" else "clone()"
        r = rd.run_rounds({"RAM tier async save (loop stall)": async_save, baseline: plain_copy},
                          rounds=rounds, after=settle)
        pinned = False
        if device == "cuda":
            assert len(buffers) == 1, f"the staging buffer was reallocated: {len(buffers)} buffers"
            assert pool._buffer is not None
            pinned = pool._buffer.is_pinned()
            assert pinned, "the staging buffer of CUDA state is not pinned"
        else:
            # CPU state is staged straight into the tier's files: no host buffer at all.
            assert not buffers and pool.capacity == 0, (
                f"an async save of CPU state allocated a staging buffer of {pool.capacity} bytes")
        # A restore of the last save, bit for bit.
        last = ram.latest()
        assert last is not None
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ram.load(target, step=last.step, strict=True)
        for k, v in state.items():
            assert torch.equal(target[k], v), f"{k}: the restore differs from the state"
        ratio = rd.time_ratio(r, "RAM tier async save (loop stall)", baseline,
                              name=f"async RAM save stall / {baseline} (time)", target="<= 1.2x")
        return {"device": device, "state_bytes": nbytes, "pinned": pinned,
                "buffers": len(buffers), "snapshot": manifest.name, "rounds": r,
                "ratio": ratio}
    finally:
        ram.wipe()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{PREFIX} SKIP: torch {torch.__version__} sees no CUDA device; the RAM tier's "
              "GPU path (pinned staging) was not checked", flush=True)
        return 0
    root = Path("/dev/shm") / f"trainguard-tiers-gpu-{uuid.uuid4().hex}"
    try:
        doc = check(args.device, args.size_mib, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(rd.table(doc["rounds"]))
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    staging = (f"staging buffer pinned={doc['pinned']}, {doc['buffers']} buffer"
               if args.device == "cuda" else "no staging buffer (staged in the tier's files)")
    print(f"{PREFIX} {doc['state_bytes'] / 2**20:.0f} MiB of {args.device} state on {name}: "
          f"snapshot held, restored bit for bit; {staging} over {args.rounds + 1} saves")
    print(f"{PREFIX} {doc['ratio'].text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
