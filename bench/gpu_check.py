"""``make gpu-check``: everything of the checkpoint store that needs a GPU, in one run
of under 5 minutes, ending with one summary.

1. the tests marked ``cuda`` (CUDA tensors, pinned staging, async save of CUDA state,
   FSDP2 and DTensor on CUDA, DCP async_save of CUDA state);
2. ``bench/checkpoint.py`` (trainguard against raw writes, torch.save and DCP);
3. ``bench/checkpoint.py --dist N --device cuda``: an FSDP2 model + AdamW on the GPUs
   (one rank each, up to 4), trainguard against DCP's FileSystemWriter/Reader;
4. ``bench/tiers_gpu.py --device cuda``: the RAM tier's GPU path: CUDA state saved
   through the pinned staging buffer (one buffer, reused across saves) into the RAM
   tier, the snapshot held while the loop changes the tensors, a bitwise restore into
   CUDA tensors, and the loop's stall against a plain ``.cpu()`` copy (target <= 1.2x);
5. ``bench/titan_step.py --device cuda``: one real torchtitan training step (its llama3
   debugmodel, optimizer and LR containers, the TrainguardDataLoader, saves through
   ``checkpoint_manager``), a kill -9, a resume with bitwise-equal weights and every
   record trained once. Skipped, and said so in the summary, where torchtitan is not
   installed; a failure where it is fails gpu-check.

Exits 1 when a step fails, 2 when no CUDA device is usable (a CPU build of torch:
``make gpu-check TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url
https://download.pytorch.org/whl/cu126'`` installs a CUDA one).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = {"tests": 150, "bench": 60, "dist bench": 80, "tiers gpu": 60, "titan step": 120}


def step(name: str, cmd: list[str], keep: str) -> tuple[str, bool, float, list[str]]:
    """Run ``cmd``; returns (name, ok, seconds, the output lines containing ``keep``)."""
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=BUDGET_S[name])
        out, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as e:
        out, ok = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {BUDGET_S[name]} s", False
    print(out[-6000:], flush=True)
    lines = [ln for ln in out.splitlines() if keep in ln]
    return name, ok, time.perf_counter() - t0, lines


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device (torch "
              f"{torch.__version__}); on a GPU machine install a CUDA build of torch and "
              "run again (see bench/gpu_check.py)", file=sys.stderr)
        return 2
    gpus = min(torch.cuda.device_count(), 4)
    py = sys.executable
    results = [
        step("tests", [py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                       "tests/test_checkpoint_cuda.py"], " passed"),
        step("bench", [py, "bench/checkpoint.py", "--size-mib", "512", "--tensors", "16",
                       "--many", "200"], "ratios"),
        step("dist bench", [py, "bench/checkpoint.py", "--dist", str(gpus), "--device", "cuda",
                            "--size-mib", "256", "--rounds", "3"], "median"),
        step("tiers gpu", [py, "bench/tiers_gpu.py", "--device", "cuda", "--size-mib", "256",
                           "--rounds", "4"], "tiers gpu:"),
    ]
    skipped = []
    if importlib.util.find_spec("torchtitan") is None:
        skipped.append("titan step: torchtitan is not installed (`make setup` installs it)")
    else:
        results.append(step("titan step", [py, "bench/titan_step.py", "--device", "cuda"],
                            "titan step"))
    print(f"\n=== gpu-check summary ({torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
          f"torch {torch.__version__})")
    for name, ok, seconds, lines in results:
        print(f"{'PASS' if ok else 'FAIL'} {name:11s} {seconds:6.1f} s")
        for line in lines:
            print(f"     {line.strip()}")
    for line in skipped:
        print(f"SKIP {line}")
    return 0 if all(ok for _, ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
