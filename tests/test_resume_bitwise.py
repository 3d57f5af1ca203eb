"""Bitwise-identical resume: ``examples/train_gpt.py`` (a tiny GPT with dropout, AdamW
and a warmup + cosine LR schedule, fed by a DataLoader with 2 workers) is SIGKILLed at
random steps and in the middle of checkpoints, and restarted until it finishes. Its
final weights, optimizer state and LR schedule, and the loss of every step (including
the steps redone after each kill), are bitwise equal to an uninterrupted run's. The
training loop does nothing about random states: the session saves and restores them.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from trainer_client import TrainingSession

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_gpt  # noqa: E402

SEQ = 32
N = 480  # 4 partitions of 120 records: 60 steps of 8, checkpoints every 10
# A text that does not change with the docs (the README's rewrite once made its last
# steps' batches harder than its first, failing the "loss goes down" check).
TEXT = np.frombuffer((ROOT / "LICENSE").read_bytes(), dtype=np.uint8)


def _window(i: int) -> np.ndarray:
    return TEXT[i * 17 : i * 17 + SEQ + 1].astype(np.int64)


def _fill(url: str) -> None:
    spec = cf.create(url, "text", partitions=4, sample_len=SEQ + 1)
    cf.fill(url, spec, N, make=_window)


def _args(url: str, store: str, run: str) -> list[str]:
    return ["--redis-url", url, "--dataset", "text", "--run-name", run, "--store", store,
            "--workers", "2", "--ckpt-every", "10", "--batch-size", "8"]


_STEP = re.compile(r"0: STEP (\d+) \S+ (-?0x[0-9a-f.]+p[-+]\d+)")


def _losses(seen: list[str]) -> list[tuple[int, str]]:
    """(step, loss) of every complete STEP line (a SIGKILL may cut the last one)."""
    return [(int(m[1]), m[2]) for line in seen if (m := _STEP.fullmatch(line))]


def _kill(job: ledger.Job, rng: random.Random, mid_checkpoint: bool) -> bool:
    """SIGKILL 0-8 steps after one of the first checkpoints committed, or just after a
    checkpoint started (its write in flight); False if the job ended first."""
    if not job.wait_line("READY", 120):
        return False
    if mid_checkpoint:
        if not job.wait_line("SAVE", 120, nth=rng.randint(1, 3)):
            return False
        if not job.sleep(rng.uniform(0.0, 0.01)):
            return False
    else:
        if not job.wait_line("COMMITTED", 120, nth=rng.randint(1, 2)):
            return False
        steps = rng.randint(0, 8)
        if steps and not job.wait_line("STEP", 120, nth=steps):
            return False
    job.kill()
    return True


def _train(z: ledger.Zygote, args: list[str], *, kills: int, seed: int) -> list[tuple[int, str]]:
    """Run to the end, SIGKILLed ``kills`` times (alternately at a random step and just
    after a checkpoint started); every (step, loss) line of every attempt. At least
    one restart must have resumed from a checkpoint (else nothing was tested)."""
    rng = random.Random(seed)
    losses: list[tuple[int, str]] = []
    resumed: list[int] = []
    history: list[str] = []
    done = 0
    while True:
        job = z.spawn(args, 1, module="train_gpt")
        killed = done < kills and _kill(job, rng, mid_checkpoint=done % 2 == 1)
        if not killed:
            job.finish(300)
        resumed += [int(line.split()[-1]) for line in job.seen if line.startswith("0: READY")]
        history.append(f"killed={killed} {job.seen[:3]} ... {job.seen[-4:]}")
        if killed:
            done += 1
            losses += _losses(job.seen)
            continue
        assert kills == 0 or max(resumed) > 0, f"no restart resumed from a checkpoint: {history}"
        return losses + _losses(job.seen)


def _final(store: str) -> dict[str, Any]:
    model = train_gpt.TinyGPT(SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train_gpt.warmup_cosine(6, 60))
    state = {"model": model, "optim": opt, "sched": sched}
    TrainingSession.inspect(store, state)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}


def _assert_bitwise(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_bitwise(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{path}/{i}")
    elif not callable(a):
        assert a == b, path


def _check_against(baseline: list[tuple[int, str]], got: list[tuple[int, str]]) -> None:
    want = dict(baseline)
    assert len(want) == len(baseline) == 60, "the uninterrupted run trains 60 steps once each"
    assert set(dict(got)) == set(want)
    for step, hexed in got:  # a redone step computes the very same loss
        assert hexed == want[step], f"step {step}: loss {hexed} != uninterrupted {want[step]}"


def _kill_runs(redis_server: Any, tmp_path: Path, seeds: list[int]) -> None:
    _fill(redis_server.url)
    with ledger.zygote(tmp_path / "jobs.log") as z:
        base_store = f"file://{tmp_path}/base"
        baseline = _train(z, _args(redis_server.url, base_store, "base"), kills=0, seed=0)
        final = _final(base_store)
        first = [float.fromhex(h) for _, h in baseline[:10]]
        last = [float.fromhex(h) for _, h in baseline[-10:]]
        assert sum(last) < 0.8 * sum(first), "the loss goes down"
        for seed in seeds:
            store = f"file://{tmp_path}/kill{seed}"
            got = _train(z, _args(redis_server.url, store, f"kill{seed}"), kills=2, seed=seed)
            _check_against(baseline, got)
            _assert_bitwise(final, _final(store))


def test_killed_gpt_resumes_bitwise(redis_server, tmp_path: Path) -> None:
    """Two SIGKILLs (a random step, mid-checkpoint): bitwise the uninterrupted run."""
    _kill_runs(redis_server, tmp_path, [1])


@pytest.mark.chaos
def test_killed_gpt_resumes_bitwise_20_times(redis_server, tmp_path: Path) -> None:
    """Twenty runs of two SIGKILLs each at seeded random moments: every one bitwise."""
    _kill_runs(redis_server, tmp_path, list(range(100, 120)))
