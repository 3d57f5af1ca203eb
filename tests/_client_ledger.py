"""Test helper: run the ledger job (tests/_client_train.py) and SIGKILL it at random
moments until it finishes the dataset; then read the final counts from the store.

Jobs are forked by a fork server (tests/_client_zygote.py) that imported torch once,
so twenty restarts do not pay twenty torch imports; each job is still its own process,
killed with SIGKILL by PID.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


class Zygote:
    def __init__(self, log: Path, job: str = "tests._client_train") -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self._log = open(log, "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._client_zygote", job], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.pids: set[int] = set()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            rank, _, line = raw.strip().partition(": ")
            if rank.isdigit():
                self.lines.put((int(rank), line))

    def spawn(self, args: list[str], world: int, module: str | None = None) -> Job:
        from tests.servers import free_port

        port = str(free_port())
        assert self.proc.stdin is not None
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            req = {"rank": rank, "args": args, "env": env, "module": module}
            self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        job = Job(self, world)
        while len(job.pids) < world:
            job.next_line(60)
        return job

    def close(self) -> None:
        # Jobs are the fork server's children, not ours: kill any still running (a
        # failed test must not leave a trainer retrying against a dead Redis).
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()
        self._log.close()


class Job:
    def __init__(self, zygote: Zygote, world: int) -> None:
        self.zygote = zygote
        self.world = world
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.seen: list[str] = []

    def next_line(self, timeout_s: float) -> tuple[int, str] | None:
        try:
            rank, line = self.zygote.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None
        self.seen.append(f"{rank}: {line}")
        word, _, rest = line.partition(" ")
        if word == "PID":
            self.pids[rank] = int(rest)
            self.zygote.pids.add(int(rest))
        elif word == "EXIT":
            self.exits[rank] = int(rest)
            self.zygote.pids.discard(self.pids.get(rank, -1))  # reaped: the PID is free
        return rank, line

    def wait_line(self, prefix: str, timeout_s: float, *, nth: int = 1) -> bool:
        """Wait for the nth rank-0 line starting with ``prefix``; False if a rank exited."""
        deadline = time.monotonic() + timeout_s
        count = 0
        while time.monotonic() < deadline:
            got = self.next_line(0.05)
            if self.exits:
                return False
            if got is not None and got[0] == 0 and got[1].startswith(prefix):
                count += 1
                if count >= nth:
                    return True
        raise AssertionError(f"no {prefix!r} line within {timeout_s} s: {self.seen[-20:]}")

    def sleep(self, seconds: float) -> bool:
        """Sleep while collecting lines; False if a rank exited meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.exits:
            self.next_line(min(0.01, max(0.0, end - time.monotonic())))
        return not self.exits

    def kill(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while len(self.exits) < self.world:
            if self.next_line(60) is None:
                raise AssertionError(f"killed job did not exit: {self.seen[-20:]}")

    def finish(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.exits) < self.world and time.monotonic() < deadline:
            self.next_line(0.5)
        if len(self.exits) < self.world:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout_s} s: {self.seen[-30:]}")
        codes = [self.exits[r] for r in range(self.world)]
        assert codes == [0] * self.world, f"job failed {codes}: {self.seen[-30:]}"
        assert any(s.startswith("0: DONE") for s in self.seen), self.seen[-30:]


def kill_at_random(
    job: Job, rng: random.Random, kind: int, during: Callable[[Job], None] | None = None
) -> bool:
    """Kill the job at a moment of the given kind; False if it finished first.

    kind 0: a random moment after 1-16 training steps; 1: during an async checkpoint
    write (just after a SAVE line); 2: right after a manifest commit. ``during(job)``
    runs once the job is training (e.g. to kill Redis under it)."""
    if not job.wait_line("READY", 120):
        return False
    if during is not None:
        during(job)
    # Kill points are counted in steps, not seconds, so that a kill lands before the
    # job finishes however fast this machine is today.
    if kind == 0:
        if not job.wait_line("STEP", 120, nth=rng.randint(1, 16)):
            return False
        if not job.sleep(rng.uniform(0.0, 0.005)):
            return False
    elif kind == 1:
        if not job.wait_line("SAVE", 120, nth=rng.randint(1, 2)):
            return False
        if not job.sleep(rng.uniform(0.0, 0.01)):
            return False
    elif not job.wait_line("COMMITTED", 120):
        return False
    job.kill()
    return True


@contextlib.contextmanager
def zygote(log: Path, job: str = "tests._client_train") -> Iterator[Zygote]:
    z = Zygote(log, job)
    try:
        yield z
    finally:
        z.close()


def run_until_done(
    args: list[str],
    *,
    kills: int,
    seed: int,
    log: Path,
    world_for: Callable[[int], int] = lambda attempt: 1,
    between: Callable[[int], None] = lambda attempt: None,
    during: Callable[[int, Job], None] | None = None,
    args_for: Callable[[int], list[str]] | None = None,
    job: str = "tests._client_train",
) -> int:
    """Start, kill ``kills`` times, then let it finish. Returns the kills done.

    ``between(attempt)`` runs after each kill (e.g. to restart Redis); ``world_for``
    and ``args_for`` may change the world size and arguments per attempt; ``during``
    runs while an attempt trains; ``job`` is the module whose ``main`` each attempt runs."""
    rng = random.Random(seed)
    done = 0
    attempt = 0
    with zygote(log, job) as z:
        while True:
            job = z.spawn(args_for(attempt) if args_for else args, world_for(attempt))
            hook = functools.partial(during, attempt) if during is not None else None
            if done < kills and kill_at_random(job, rng, attempt % 3, hook):
                done += 1
                between(attempt)
                attempt += 1
                continue
            job.finish(300)
            return done


def final_counts(store_url: str, n: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The restored ledger, and the newest checkpoint's ``extra`` with every
    partition's offset under ``["trainguard"]["offsets"]`` (read from its rank objects
    where the session record is of version 3, which keeps them out of the manifest),
    and its skipped batches under ``["skipped_batches"]`` (from the rank objects from
    record version 4 on)."""
    from checkpoint_store import CheckpointStore
    from tests._client_train import make_state
    from trainguard.core import streams
    from trainguard.core.rank_record import checkpoint_offsets, checkpoint_skipped
    from trainguard.core.record import SKIPPED_KEY, SessionRecord

    state, model, _ = make_state(n)
    store = CheckpointStore(store_url)
    try:
        manifest = store.load(state)
        assert manifest is not None, "no checkpoint was committed"
        extra = dict(manifest.extra)
        if "trainguard" in extra:
            extra["trainguard"] = {**extra["trainguard"], "offsets": streams.offsets_to_wire(
                checkpoint_offsets(store, manifest))}
            rec = SessionRecord.of(manifest)
            skipped = None if rec is None else checkpoint_skipped(store, manifest, rec)
            if skipped is not None:
                extra[SKIPPED_KEY] = list(skipped)
    finally:
        store.close()
    return model.counts.clone(), extra


def assert_each_once(counts: torch.Tensor) -> None:
    """Every record's count is exactly 1 (the ledger's verdict)."""
    lost, dup = int((counts == 0).sum()), int((counts > 1).sum())
    assert (lost, dup) == (0, 0), f"{lost} records lost, {dup} trained more than once"
    assert torch.equal(counts, torch.ones(len(counts)))
