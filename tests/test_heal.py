"""The job heals itself (issue #24, parts 2, 4, 5), through torchrun's own agent:

- a worker stopped with SIGSTOP is noticed by its peer's watchdog (from the measured
  step times, or sooner from its silent heartbeat), which reports the hang with every
  thread's stack, kills the stopped rank and exits 86; the agent restarts the group
  and every record is trained once;
- a crash at the same step after every restore climbs the restart-loop breaker's
  ladder (restore, older checkpoint, skip the batch in flight) and stops the run with
  exit 87 and an incident saying what was tried; the agent's further restarts are
  refused at once; nothing was trained twice;
- an attempt that dies before its first checkpoint counts as a failure in
  ``trainguard runs show`` and in the interval advice.

Jobs: tests/_heal_job.py (a ledger: each step adds 1 per record of its batch to a
buffer saved in the checkpoint). Runs use ``torchrun --standalone``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from tests import _client_fill as cf
from tests._client_ledger import final_counts
from trainguard.core import incidents as inc
from trainguard.core.exit_codes import EXIT_RESTART_LOOP
from trainguard.core.process import pid_alive
from trainguard.ops.cli import main

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4


class Torchrun:
    """``torchrun --standalone`` of the heal job, its lines collected as they come."""

    def __init__(self, nproc: int, max_restarts: int, args: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
             "--monitor-interval=0.1", "-m", "tests._heal_job", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
            text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, line: str, timeout_s: float = 120, *, start: int = 0) -> str:
        """Wait for a line starting with ``line`` among those from ``start`` on."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = next((x for x in self.seen[start:] if x.startswith(line)), None)
            if got is not None:
                return got
            try:
                self.seen.append(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no {line!r} in {timeout_s} s: {self.seen[-20:]}") from None

    def pid(self, rank: int) -> int:
        """The newest PID that ``rank`` printed."""
        return [int(x.split()[2]) for x in self.seen if x.startswith(f"{rank}: PID ")][-1]

    def finish(self, timeout_s: float = 240) -> int:
        """Wait for torchrun's exit (killing its session past ``timeout_s``)."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return rc


def _docs(url: str, key: str) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(url)
    try:
        raw = r.hgetall(key)
    finally:
        r.close()
    docs = [inc.loads(v) for k, v in raw.items() if k != b"seq"]
    return sorted(docs, key=lambda d: d["attempt"])


def _job(redis_server: Any, tmp_path: Path, n: int, partitions: int) -> list[str]:
    spec = cf.create(redis_server.url, "heal", partitions=partitions)
    cf.fill(redis_server.url, spec, n)
    return ["--redis", redis_server.url, "--store", f"file://{tmp_path}/ckpt", "--records", str(n),
            "--batch-size", str(BATCH)]


def _stop_at_step_8(redis_server: Any, tmp_path: Path, n: int, victim: int,
                    *extra: str) -> tuple[Torchrun, int]:
    """A two-rank heal job of ``n`` records (``extra``: its arguments) whose rank
    ``victim`` is stopped with SIGSTOP at step 8; torchrun's exit code once it ended
    (the stopped process killed afterwards if the job left it)."""
    run = Torchrun(2, 1, [*_job(redis_server, tmp_path, n, 2), "--sleep-ms", "20", *extra],
                   tmp_path / "torchrun.log")
    stopped = 0
    try:
        run.wait_for(f"{victim}: STEP 8")
        stopped = run.pid(victim)
        os.kill(stopped, signal.SIGSTOP)
        rc = run.finish()
    finally:
        if stopped and pid_alive(stopped):
            os.kill(stopped, signal.SIGKILL)
        run.finish(10)
    return run, rc


def test_sigstopped_rank_is_detected_and_the_job_recovers_training_each_record_once(
        redis_server: Any, tmp_path: Path) -> None:
    """Two ranks; rank 1 is stopped with SIGSTOP at step 8. Rank 0's watchdog fires
    (no step within k x p99, floor 1.5 s), names rank 1 as the rank whose heartbeat
    stopped, kills it and exits 86; torchrun restarts both and the job finishes.
    Every record is trained exactly once (the ledger in the final checkpoint); the
    incident is one ``hang`` detected by the watchdog, with rank 0's stacks (waiting
    in the collective), the steps and records redone (a full batch per rank per
    step) and the time to the next step by phase."""
    n = 2 * BATCH * 25
    run, rc = _stop_at_step_8(redis_server, tmp_path, n, 1)
    assert rc == 0, (run.seen[-20:], (tmp_path / "torchrun.log").read_text()[-3000:])
    assert f"0: DONE {n // (2 * BATCH)}" in run.seen
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n)), "a record was lost or trained twice"

    found = _docs(redis_server.url, inc.incidents_key("heal", "job"))
    assert [i["cause"] for i in found] == ["hang"]
    hang = found[0]
    assert hang["detected_by"] == "watchdog" and hang["world_before"] == 2
    (report,) = hang["reports"]
    assert report["rank"] == 0 and report["suspects"] == [1] and report["phase"] == "train"
    assert report["trigger"] == "budget"  # peer_silence_s (10 s) is longer than the budget
    # Why it fired: the stall passed the limit, k x p99 of the steps measured, never
    # below the 1.5 s floor (a loaded machine's slow steps may raise it above).
    assert report["limit_s"] >= 1.5 and report["stalled_s"] > report["limit_s"]
    assert any("all_reduce" in "".join(frames) for frames in report["stacks"].values())
    assert hang["detection_latency_s"] > 0 and hang["failed_at"] < hang["detected_at"]
    rec = hang["recovery"]
    assert rec["world_after"] == 2 and rec["attempt"] == 2
    assert rec["steps_redone"] == hang["step"] - rec["restored_step"] >= 1
    assert rec["records_redone"] == 2 * BATCH * rec["steps_redone"]
    assert set(rec["phases_s"]) == {"detect", "restart", "imports", "session", "restore",
                                    "first_step"}
    assert all(v is not None and v >= 0 for v in rec["phases_s"].values()), rec
    tried = _docs(redis_server.url, inc.attempts_key("heal", "job"))
    assert [(a["attempt"], a["outcome"], a["restart_count"]) for a in tried] == [
        (1, "failed", 0), (2, "ok", 1)]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_stopped_rank_is_found_by_its_silent_heartbeat_long_before_the_step_budget(
        redis_server: Any, tmp_path: Path, victim: int) -> None:
    """The step budget is 120 s here (a floor a loaded machine's slow steps can push
    k x p99 to); rank ``victim`` is stopped with SIGSTOP at step 8. The other rank, a
    checker of its peers' heartbeats, sees the stopped one beat nothing for the 2 s of
    ``peer_silence_s`` while its own step makes no progress, and fires then: the hang
    report says so (trigger ``peer_silence``, the stopped rank silent and a suspect,
    the stall far inside the step budget). Rank 0 stopped is found as well (rank 1 is
    the second checker). The job then finishes with every record trained once."""
    n = 2 * BATCH * 25
    run, rc = _stop_at_step_8(redis_server, tmp_path, n, victim,
                              "--watchdog-floor-s", "120", "--watchdog-peer-silence-s", "2")
    assert rc == 0, (run.seen[-20:], (tmp_path / "torchrun.log").read_text()[-3000:])
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n)), "a record was lost or trained twice"
    (hang,) = _docs(redis_server.url, inc.incidents_key("heal", "job"))
    assert hang["cause"] == "hang" and hang["detected_by"] == "watchdog"
    (report,) = hang["reports"]
    assert report["rank"] == 1 - victim and report["trigger"] == "peer_silence"
    assert report["silent"] == [victim] and report["suspects"] == [victim]
    assert report["limit_s"] == 2.0 and 2.0 < report["stalled_s"] < 120.0


def test_a_rank_out_of_data_first_steps_on_empty_batches_and_the_job_ends_once(
        redis_server: Any, tmp_path: Path) -> None:
    """Two ranks on 3 partitions: rank 0 owns two, rank 1 one, so rank 1 runs out of
    data halfway and steps on join mode's empty batches (no data, length 0) while
    rank 0 trains on. The job ends at its real end, exit 0 on the first attempt, with
    every record trained exactly once in the final checkpoint. (The ledger job used
    to index an empty batch's missing data: it crashed at the end of every uneven
    stream, the breaker stopped it with exit 87 and the last steps after the newest
    checkpoint looked lost: the chaos campaign's node-kill "20 records lost".)"""
    n = 3 * BATCH * 10
    run = Torchrun(2, 0, [*_job(redis_server, tmp_path, n, 3), "--sleep-ms", "5"],
                   tmp_path / "torchrun.log")
    rc = run.finish()
    assert rc == 0, (run.seen[-20:], (tmp_path / "torchrun.log").read_text()[-3000:])
    # Rank 0 trained its 20 batches; rank 1's 10 ran out at step 10.
    assert "0: DONE 20" in run.seen and "1: DONE 20" in run.seen, run.seen[-10:]
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n)), "a record was lost or trained twice"


def test_a_crash_at_the_same_step_after_every_restore_is_stopped_with_what_was_tried(
        redis_server: Any, tmp_path: Path) -> None:
    """A bug at step 12 (checkpoints every 5 steps): attempt 2 restores step 10 and
    crashes again, attempt 3 restores the checkpoint before it (step 5), attempt 4
    skips the batch in flight at step 12 - and still crashes; attempt 5 stops the run
    with exit 87 and a restart_loop incident listing the three remedies; attempt 6
    (torchrun's last restart) is refused at once. No record was trained twice: the
    newest checkpoint (step 10) counts steps 1-10's records once, none after."""
    n = BATCH * 20
    run = Torchrun(1, 5, [*_job(redis_server, tmp_path, n, 1), "--crash-at", "12",
                          "--sleep-ms", "0"],
                   tmp_path / "torchrun.log")
    rc = run.finish()
    assert rc != 0, run.seen[-20:]
    log = (tmp_path / "torchrun.log").read_text()
    assert "exitcode  : 87" in log, log[-3000:]
    found = _docs(redis_server.url, inc.incidents_key("heal", "job"))
    assert [(i["attempt"], i["cause"], (i["remedy"] or {}).get("action")) for i in found] == [
        (1, "crash", "restore"), (2, "crash", "older_checkpoint"), (3, "crash", "skip_batches"),
        (4, "crash", "stop"), (5, "restart_loop", "stop")]
    assert len({i["signature"] for i in found[:4]}) == 1
    assert "RuntimeError" in found[0]["signature"] and "step=12" in found[0]["signature"]
    stop = found[4]
    assert stop["tried"] == ["restore", "older_checkpoint", "skip_batches"]
    assert stop["repeats"] == 4 and "step 12" in stop["look_at"]
    assert "deterministic bug at step 12" in stop["look_at"]
    readies = [x for x in run.seen if x.startswith("0: READY")]
    assert readies == ["0: READY 0", "0: READY 10", "0: READY 5", "0: READY 10"]
    tried = _docs(redis_server.url, inc.attempts_key("heal", "job"))
    assert [a["outcome"] for a in tried] == ["failed"] * 4 + ["stopped", "refused"]
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.tensor([1.0] * (10 * BATCH) + [0.0] * (10 * BATCH)))


def test_an_attempt_that_dies_before_its_first_checkpoint_counts_in_runs_show(
        redis_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first attempt is SIGKILLed after one step, before any checkpoint; the
    second trains the dataset. ``trainguard runs show`` counts one failure (the
    advice's too) and shows the incident: ``killed``, detected by the next attempt."""
    n = BATCH * 6
    args = _job(redis_server, tmp_path, n, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.run([sys.executable, "-m", "tests._heal_job", *args,
                            "--die-before-checkpoint"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-m", "tests._heal_job", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n))

    common = ["--redis-url", redis_server.url, "--stores", f"main=file://{tmp_path}/ckpt"]
    assert main(["runs", "show", "job", *common, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["totals"]["failures"] == 1 and shown["failures"] == 1
    assert shown["advice"]["failures"] == 1
    assert [a["outcome"] for a in shown["attempts"]] == ["failed", "ok"]
    (killed,) = shown["incidents"]
    assert (killed["cause"], killed["detected_by"], killed["step"]) == ("killed",
                                                                        "next attempt", 1)
    assert killed["recovery"]["restored_step"] == 0
    assert main(["runs", "show", "job", *common]) == 0
    text = capsys.readouterr().out
    assert "attempts: 2 (1 failed, 2 ok)" in text
    assert main(["runs", "ls", *common, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["restarts"], row["attempts"], row["last_incident"]) == (1, 2, "killed")


def test_a_script_that_calls_sys_exit_before_close_is_an_exit_with_its_code(
        redis_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first attempt calls ``sys.exit(3)`` after step 2, without ``session.close()``
    (Python runs no excepthook for SystemExit); the second trains the dataset. The
    incident is an ``exit`` with code 3 at step 2, reported by the exiting process
    itself (not ``killed``, guessed by the next attempt), and every record trains
    exactly once."""
    n = BATCH * 6
    args = _job(redis_server, tmp_path, n, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.run([sys.executable, "-m", "tests._heal_job", *args, "--exit-at", "2"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 3, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-m", "tests._heal_job", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n))

    common = ["--redis-url", redis_server.url, "--stores", f"main=file://{tmp_path}/ckpt"]
    assert main(["runs", "show", "job", *common, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [a["outcome"] for a in shown["attempts"]] == ["failed", "ok"]
    (exited,) = shown["incidents"]
    assert (exited["cause"], exited["detected_by"], exited["step"],
            exited["exit_code"]) == ("exit", "exit hook", 2, 3)
    assert exited["signature"] == "exit step=2 code=3"
    (report,) = exited["reports"]
    assert (report["via"], report["rank"]) == ("sys.exit", 0)
    assert shown["totals"]["failures"] == 1


@pytest.mark.chaos
def test_a_poisoned_record_is_skipped_after_the_ladder_and_every_other_record_trains_once(
        redis_server: Any, tmp_path: Path) -> None:
    """A record that makes its step raise (record 46, in the batch of step 12): attempt
    2 restores step 10, attempt 3 the checkpoint before it (5), attempt 4 skips the
    batch in flight and finishes. The ledger: records 44-47 never trained, every other
    record exactly once; the final manifest lists that batch as skipped (consumed,
    never trained), so nothing is silently lost."""
    from trainguard.core.record import SessionRecord

    n = BATCH * 20
    run = Torchrun(1, 4, [*_job(redis_server, tmp_path, n, 1), "--poison", "46",
                          "--sleep-ms", "0"], tmp_path / "torchrun.log")
    assert run.finish() == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    found = _docs(redis_server.url, inc.incidents_key("heal", "job"))
    assert [(i["cause"], i["remedy"]["action"]) for i in found] == [
        ("crash", "restore"), ("crash", "older_checkpoint"), ("crash", "skip_batches")]
    assert found[0]["batches"] == {"0": "0:1-44..1-47"}
    counts, extra = final_counts(f"file://{tmp_path}/ckpt", n)
    expected = torch.ones(n)
    expected[44:48] = 0
    assert torch.equal(counts, expected)
    rec = SessionRecord.from_extra(extra)
    assert rec.skipped == ("0:1-44..1-47",)


@pytest.mark.chaos
def test_repeated_sigstops_of_either_rank_each_heal_and_every_record_trains_once(
        redis_server: Any, tmp_path: Path) -> None:
    """Four rounds: each attempt of a two-rank job has one of its ranks stopped with
    SIGSTOP at a random step; each time the other rank's watchdog reports the hang
    and torchrun restarts the group. Every record is trained exactly once, and there
    is one ``hang`` incident per stop, each naming the stopped rank."""
    import random

    rng = random.Random(7)
    n = 2 * BATCH * 60
    rounds = 4
    run = Torchrun(2, rounds, [*_job(redis_server, tmp_path, n, 2), "--sleep-ms", "20"],
                   tmp_path / "torchrun.log")
    victims = []
    try:
        mark = 0
        for _ in range(rounds):
            rank = rng.randrange(2)
            ready = run.wait_for(f"{rank}: READY ", start=mark)
            # Past the first steps (start-up's budget until 3 steps are measured).
            at = int(ready.split()[2]) + rng.randint(7, 11)
            run.wait_for(f"{rank}: STEP {at}", start=mark)
            pid = run.pid(rank)
            os.kill(pid, signal.SIGSTOP)
            victims.append((rank, pid))
            mark = len(run.seen)
        rc = run.finish(600)
    finally:
        for _, pid in victims:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        run.finish(10)
    assert rc == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    counts, _ = final_counts(f"file://{tmp_path}/ckpt", n)
    assert torch.equal(counts, torch.ones(n))
    found = _docs(redis_server.url, inc.incidents_key("heal", "job"))
    (tmp_path / "incidents.json").write_text(json.dumps(found, indent=1))  # for a failure
    assert [i["cause"] for i in found] == ["hang"] * rounds
    assert [i["reports"][0]["suspects"] for i in found] == [[r] for r, _ in victims]


def test_settings_parse_or_say_what_was_expected_and_the_exit_codes_are_documented(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TRAINGUARD_WATCHDOG`` and ``$TRAINGUARD_LOOP_BREAKER``: ``off``, or key=value
    of the config's fields; anything else is refused naming the variable, the field
    and what it expected. A RestartLoopError maps to exit 87, and ``trainguard
    --help`` documents 86 and 87."""
    from trainer_client import RestartLoopError, WatchdogConfig
    from trainguard.core.incidents import LoopPolicy
    from trainguard.ops import exits

    assert not WatchdogConfig.from_env("off").enabled
    # Unset: on under an elastic agent only (its exit is for the agent to restart).
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert WatchdogConfig.from_env("") == WatchdogConfig(enabled=False)
    assert WatchdogConfig.from_env("on") == WatchdogConfig()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert WatchdogConfig.from_env("") == WatchdogConfig()
    cfg = WatchdogConfig.from_env("k=5, floor_s=2,min_steps=4,kill_stalled_peers=false")
    assert (cfg.k, cfg.floor_s, cfg.min_steps, cfg.kill_stalled_peers) == (5.0, 2.0, 4, False)
    assert cfg.step_limit_s(0.1) == 2.0 and cfg.step_limit_s(1.0) == 5.0
    assert cfg.step_limit_s(None) == cfg.startup_s
    with pytest.raises(ValueError, match=r"TRAINGUARD_WATCHDOG: k='fast' is not a float"):
        WatchdogConfig.from_env("k=fast")
    with pytest.raises(ValueError, match=r"'floor=3' is not key=value of \[.*'floor_s'"):
        WatchdogConfig.from_env("floor=3")
    with pytest.raises(ValueError, match="k > 1 and 0 < floor_s <= ceiling_s"):
        WatchdogConfig.from_env("floor_s=100,ceiling_s=10")
    assert not LoopPolicy.from_env("off").enabled
    assert LoopPolicy.from_env("max_tries=2").max_tries == 2
    with pytest.raises(ValueError, match="expected 'off' or 'max_tries=N'"):
        LoopPolicy.from_env("tries=2")
    err = RestartLoopError("stopped", exit_code=EXIT_RESTART_LOOP)
    assert exits.exit_code(err) == exits.EXIT_RESTART_LOOP == 87
    assert exits.EXIT_HUNG == 86
    assert "\n  86 " in exits.EPILOG and "\n  87 " in exits.EPILOG


def test_a_loss_spike_rollback_is_an_incident_and_no_failure(redis_server: Any,
                                                              tmp_path: Path) -> None:
    """GuardedTraining rolls back once (a spike at the batch of step 26, back to step
    25): the run's incidents hold one ``rollback`` by the loss spike guard, from step
    26 to 25, with the guard's verdict; the attempt ended ok and no failure is
    counted (the advice's failure rate stays true)."""
    from tests import _guard_train as gt
    from trainer_client.spikes import SpikeConfig

    n, parts = 400, 4
    cf.fill(redis_server.url, cf.create(redis_server.url, gt.DATASET, partitions=parts), n)
    seen: list[int] = []

    def inject(batch: Any, step: int) -> float | None:
        if 205 in gt.records(batch) and not seen:
            seen.append(step)
            return 1e6
        return None

    res = gt.train(redis_server.url, f"file://{tmp_path}/ckpt", n, inject=inject,
                   spike=SpikeConfig(window=10, warmup_steps=5))
    assert len(res.rollbacks) == 1
    found = _docs(redis_server.url, inc.incidents_key(gt.DATASET, gt.RUN))
    assert [(i["cause"], i["detected_by"], i["step"], i["to_step"]) for i in found] == [
        ("rollback", "loss spike guard", 26, 25)]
    assert found[0]["reason"].startswith("loss spike at step 26 (")
    assert found[0]["recovery"]["steps_redone"] == 1
    tried = _docs(redis_server.url, inc.attempts_key(gt.DATASET, gt.RUN))
    assert [a["outcome"] for a in tried] == ["ok"]
