"""GuardedTraining end to end: real redis-server, real torch, real CheckpointStore.

The ledger (tests/_guard_train.py) counts, per record, the applied steps that trained
it; the dataset is deterministic (P partitions, batches of 8 consecutive records of one
partition, partitions round-robin), so the batch of record ``i`` is known in advance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests import _guard_train as gt
from trainer_client.dataset import Batch
from trainer_client.errors import NoRollbackTargetError, RollbackLimitError
from trainer_client.guard import SKIPPED_EXTRA_KEY, GuardedTraining
from trainer_client.health import EXIT_GPU_CRITICAL
from trainer_client.spikes import RollbackConfig, SpikeConfig
from trainguard.core import incidents as inc
from trainguard.core import streams
from trainguard.core.rank_record import checkpoint_skipped
from trainguard.core.record import SessionRecord

N, P = 400, 4
POISON = 205  # partition 1, its batch 6 -> the 26th batch (round-robin), step 26
ROOT = Path(__file__).resolve().parents[1]


def _setup(url: str, tmp_path: Path) -> str:
    cf.fill(url, cf.create(url, gt.DATASET, partitions=P), N)
    return f"file://{tmp_path}/ckpt"


def _records_in(url: str, bid: str) -> list[int]:
    """Dataset indices of the records a batch ID names, read back from Redis."""
    client = redis.Redis.from_url(url)
    try:
        out = []
        for part in bid.split(";"):
            p, _, span = part.partition(":")
            first, _, last = span.partition("..")
            for _, fields in client.xrange(streams.partition_key(gt.DATASET, int(p)), first, last):
                out.append(int(streams.decode_record(fields)[0]))
        return out
    finally:
        client.close()


def _manifests(store: str) -> list:
    """The manifests in commit order, each ``extra`` with the checkpoint's skipped
    batches under ``skipped_batches`` (from session record 4 on they are read from the
    rank objects, as the run history reads them)."""
    cs = CheckpointStore(store)
    try:
        out = []
        for m in sorted(cs.list(), key=lambda m: m.extra["trainguard"]["commit"]):
            rec = SessionRecord.of(m)
            skipped = None if rec is None else checkpoint_skipped(cs, m, rec)
            if skipped is not None:
                m = dataclasses.replace(m, extra={**m.extra, SKIPPED_EXTRA_KEY: list(skipped)})
            out.append(m)
        return out
    finally:
        cs.close()


def _spike_once_at(record: int, value: float) -> Callable[[Batch, int], float | None]:
    seen: list[int] = []

    def inject(batch: Batch, step: int) -> float | None:
        if record in gt.records(batch) and not seen:
            seen.append(step)
            return value
        return None

    return inject


def _check_ledger(res: gt.Result, skipped: list[int]) -> None:
    expected = torch.ones(N)
    expected[skipped] = 0
    counts = res.model.counts.detach()
    assert torch.equal(counts, expected), (
        f"{int((counts == 0).sum())} records never trained (expected {len(skipped)}), "
        f"{int((counts > 1).sum())} trained twice"
    )


def test_spike_rolls_back_and_never_trains_the_batch(redis_server, tmp_path: Path) -> None:
    """A loss 1e6x the average at the batch holding record 205 (once): the guard rolls
    back to step 25 (weights, optimizer, counts and offsets), drops that batch on the
    replay, lists exactly its records as skipped in every later manifest (none before),
    and every other record is trained exactly once."""
    store = _setup(redis_server.url, tmp_path)
    res = gt.train(redis_server.url, store, N, inject=_spike_once_at(POISON, 1e6),
                   spike=SpikeConfig(window=10, warmup_steps=5))
    assert len(res.rollbacks) == 1
    spike_step, bad = res.rollbacks[0]
    assert spike_step == 26 and res.restored == [25]
    bad_records = res.batches[bad]
    assert POISON in bad_records and len(bad_records) == 8
    assert _records_in(redis_server.url, bad) == bad_records
    assert bad not in res.applied
    assert res.guarded.dropped_batch_ids == [bad]
    _check_ledger(res, bad_records)
    assert res.step == math.ceil(N / 8) - 1  # every batch but the dropped one (they span partitions)
    manifests = _manifests(store)
    before = [m for m in manifests if m.extra[SKIPPED_EXTRA_KEY] == []]
    after = [m for m in manifests if m.extra[SKIPPED_EXTRA_KEY] == [bad]]
    assert len(before) + len(after) == len(manifests)
    assert max(m.step for m in before) == 25  # the last one before the spike
    assert min(m.step for m in after) == 30  # the next one after the rollback
    assert max(m.extra["trainguard"]["commit"] for m in before) < min(
        m.extra["trainguard"]["commit"] for m in after)


def test_nan_rolls_back_at_once_even_in_warmup(redis_server, tmp_path: Path) -> None:
    """NaN at step 3 (warmup is 20 steps): rollback at once to the step-0 checkpoint
    the guard wrote on the fresh restore; that batch is never trained, all others once."""
    store = _setup(redis_server.url, tmp_path)
    state: dict[str, int] = {}

    def inject(batch: Batch, step: int) -> float | None:
        if step == 3 and not state:
            state["hit"] = 1
            return math.nan
        return None

    res = gt.train(redis_server.url, store, N, inject=inject)  # default SpikeConfig
    assert [s for s, _ in res.rollbacks] == [3]
    bad = res.rollbacks[0][1]
    assert res.guarded.dropped_batch_ids == [bad]
    _check_ledger(res, res.batches[bad])
    first_after = min((m for m in _manifests(store) if m.step > 0), key=lambda m: m.step)
    assert first_after.extra[SKIPPED_EXTRA_KEY] == [bad]


def test_rollback_cap_stops_a_loop_that_always_spikes(redis_server, tmp_path: Path) -> None:
    """Every batch's loss is NaN; each rollback restores the step-0 checkpoint, whose
    guard state has no rollback history. The live history survives those loads, so the
    third spike raises RollbackLimitError (max 2 within 100 steps) naming the cap and
    both earlier rollbacks, instead of looping through the whole dataset."""
    store = _setup(redis_server.url, tmp_path)
    spikes: list[int] = []

    def always_nan(batch: Batch, step: int) -> float:
        spikes.append(step)
        # A guard whose history is reset by its rollbacks would loop here forever.
        assert len(spikes) <= 10, f"no RollbackLimitError after {len(spikes)} spikes"
        return math.nan

    with pytest.raises(RollbackLimitError) as info:
        gt.train(redis_server.url, store, N, inject=always_nan,
                 rollback=RollbackConfig(max_rollbacks=2, within_steps=100))
    assert spikes == [1, 1, 1]  # each rollback went back to the step-0 checkpoint
    msg = str(info.value)
    assert "would be rollback 3 within 100 executed steps; the policy allows 2" in msg
    assert msg.count("non-finite loss=nan") == 3  # this spike and the two earlier ones
    assert [m.step for m in _manifests(store)] == [0]  # nothing applied, nothing saved


def test_restart_restores_guard_state(redis_server, tmp_path: Path) -> None:
    """Run 1 spikes at step 26, rolls back to 25, checkpoints and ends before the
    replay reaches the bad batch. Run 2 (new session, model, guard) restores exactly
    the guard state run 1 saved (rollback history, skip list, detector window) and,
    with no spike injected any more, still drops the bad batch: every other record
    once, the bad batch's records never."""
    store = _setup(redis_server.url, tmp_path)
    cfg = SpikeConfig(window=10, warmup_steps=5)
    first = gt.train(redis_server.url, store, N, inject=_spike_once_at(POISON, 1e6), spike=cfg,
                     stop_after_rollback=True)
    assert first.step == 25 and len(first.rollbacks) == 1
    bad = first.rollbacks[0][1]
    saved = first.guarded.guard.state_dict()
    assert saved["policy"]["total_rollbacks"] == 1

    state, _, opt = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        again = GuardedTraining(sess, state, optimizer=opt, spike=cfg)
        assert again.restore() == 25
        assert again.guard.state_dict() == saved
        assert again.guard.is_skipped(bad)
    finally:
        sess.close()

    second = gt.train(redis_server.url, store, N, spike=cfg)
    assert second.rollbacks == []
    assert second.guarded.dropped_batch_ids == [bad]
    assert second.guarded.guard.policy.total_rollbacks == 1
    _check_ledger(second, first.batches[bad])


def test_lr_scale_applies_after_rollback_and_restart(redis_server, tmp_path: Path) -> None:
    """RollbackConfig.lr_scale=0.5: after one rollback every param group's LR is half
    its base, and a restart (guard state restored) keeps it halved; with
    scale_lr=False the guard tracks the scale but leaves the rates alone."""
    store = _setup(redis_server.url, tmp_path)
    res = gt.train(redis_server.url, store, N, inject=_spike_once_at(POISON, math.inf),
                   rollback=RollbackConfig(lr_scale=0.5))
    assert len(res.rollbacks) == 1
    assert [g["lr"] for g in res.guarded.optimizer.param_groups] == [0.5e-4, 0.5]
    state, _, opt = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        GuardedTraining(sess, state, optimizer=opt, rollback=RollbackConfig(lr_scale=0.5)).restore()
        assert [g["lr"] for g in opt.param_groups] == [0.5e-4, 0.5]
    finally:
        sess.close()
    # scale_lr=False (a scheduler owns the rate): the same run leaves the rates alone.
    res = gt.train(redis_server.url, f"file://{tmp_path}/other", N,
                   inject=_spike_once_at(POISON, math.inf),
                   rollback=RollbackConfig(lr_scale=0.5), scale_lr=False)
    assert len(res.rollbacks) == 1 and res.guarded.lr_scale == 0.5
    assert [g["lr"] for g in res.guarded.optimizer.param_groups] == [1e-4, 1.0]


def test_health_without_gpu_and_from_monitor(redis_server, tmp_path: Path) -> None:
    """health(): with a monitor, its latest report (a fake NVML GPU, OK); without one
    and without GPUs (fake NVML with zero devices), a report that says no GPU."""
    from tests._fake_nvml import FakeGpu, FakeNvml
    from trainer_client.health import HealthMonitor, HealthProbe, Status

    store = _setup(redis_server.url, tmp_path)
    state, _, _ = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        bare = GuardedTraining(sess, state, probe=HealthProbe(nvml=FakeNvml([])))
        report = bare.health()
        assert report.no_gpu and report.status is Status.OK and report.gpus == ()
        monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([FakeGpu()])), interval_s=3600)
        watched = GuardedTraining(sess, state, monitor=monitor)
        report = watched.health()
        assert not report.no_gpu and len(report.gpus) == 1 and report.status is Status.OK
        assert monitor.latest is report
    finally:
        sess.close()


def test_gpu_critical_checkpoints_and_exits_75(redis_server, tmp_path: Path) -> None:
    """A training process (GuardedTraining.run) whose fake NVML reports an uncorrected
    ECC error right after step 7: it takes no further batch, checkpoints step 7 and
    exits with code 75. Restoring that checkpoint gives step 7, the offsets the process
    had after step 7, and counts of 1 for exactly the records of steps 1..7."""
    store = _setup(redis_server.url, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._guard_train", "--redis", redis_server.url,
         "--store", store, "--n", str(N), "--critical-at", "7"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == EXIT_GPU_CRITICAL, proc.stderr[-3000:]
    steps = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("STEP ")]
    batches = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("BATCH ")]
    assert [int(s) for _, s, _ in steps] == list(range(1, 8))
    assert [int(s) for _, s, _ in batches] == list(range(1, 8))  # no 8th batch taken
    offsets = {int(p): i for p, i in json.loads(steps[-1][2]).items()}
    trained = [r for _, _, recs in batches for r in json.loads(recs)]

    state, model, opt = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        assert GuardedTraining(sess, state, optimizer=opt).restore() == 7
        assert sess.offsets == offsets
    finally:
        sess.close()
    expected = torch.zeros(N)
    expected[trained] = 1
    assert torch.equal(model.counts.detach(), expected)


def test_gpu_critical_is_its_own_incident_cause(redis_server, tmp_path: Path) -> None:
    """A process whose fake NVML GPU turns CRITICAL after step 7 exits 75 through
    ``exit_on_gpu_critical``; the next session on the run records the incident as
    ``gpu_critical`` (detected by the GPU health probe, exit code 75, step 7), not as
    a crash, an exit or a silent death, and restores plainly (no breaker rung)."""
    store = _setup(redis_server.url, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._guard_train", "--redis", redis_server.url,
         "--store", store, "--n", str(N), "--critical-at", "7"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == EXIT_GPU_CRITICAL, proc.stderr[-3000:]
    sess = gt.session(redis_server.url, store)  # the next attempt assembles the incident
    try:
        r = redis.Redis.from_url(redis_server.url)
        raw = r.hgetall(inc.incidents_key(gt.DATASET, gt.RUN))
        r.close()
        (incident,) = [inc.loads(v) for k, v in raw.items() if k != b"seq"]
        assert (incident["cause"], incident["detected_by"], incident["exit_code"],
                incident["step"]) == ("gpu_critical", "GPU health probe", EXIT_GPU_CRITICAL, 7)
        assert incident["reports"][0]["error"]["type"] == "GpuCriticalError"
        assert incident["remedy"]["action"] == "restore"
    finally:
        sess.close()


def test_checkpoints_back_and_a_second_spike_stay_in_the_lineage(redis_server, tmp_path: Path) -> None:
    """checkpoints_back=1: the spike at step 26 rolls back to step 20 (not 25), a
    second spike (record 333, step 41 after the drop) to step 35 of the new lineage;
    both batches are listed as skipped, never trained, all other records once."""
    store = _setup(redis_server.url, tmp_path)
    first, second = _spike_once_at(POISON, 1e6), _spike_once_at(333, 1e6)
    res = gt.train(redis_server.url, store, N, inject=lambda b, s: first(b, s) or second(b, s),
                   spike=SpikeConfig(window=10, warmup_steps=5),
                   rollback=RollbackConfig(checkpoints_back=1))
    assert [s for s, _ in res.rollbacks] == [26, 41]
    assert res.restored == [20, 35]
    bad = [b for _, b in res.rollbacks]
    assert res.guarded.dropped_batch_ids == bad
    _check_ledger(res, res.batches[bad[0]] + res.batches[bad[1]])
    final = _manifests(store)[-1]
    assert final.step == res.step and final.extra[SKIPPED_EXTRA_KEY] == bad


def test_greedy_mode_never_trains_a_spiking_record(redis_server, tmp_path: Path) -> None:
    """Greedy (non-deterministic) reading may form other batches on the replay: every
    replayed batch sharing a record with the spike's batch is dropped, the manifest's
    skipped IDs name exactly the records with count 0 (the spike's among them), and
    every other record is trained once."""
    store = _setup(redis_server.url, tmp_path)
    res = gt.train(redis_server.url, store, N, inject=_spike_once_at(POISON, 1e6),
                   spike=SpikeConfig(window=10, warmup_steps=5), deterministic=False)
    assert len(res.rollbacks) == 1
    skipped = _manifests(store)[-1].extra[SKIPPED_EXTRA_KEY]
    assert skipped == res.guarded.dropped_batch_ids and skipped
    dropped = [r for bid in skipped for r in _records_in(redis_server.url, bid)]
    assert set(res.batches[res.rollbacks[0][1]]) <= set(dropped)
    assert len(dropped) == len(set(dropped))
    _check_ledger(res, dropped)


def test_guard_takes_over_a_run_checkpointed_without_it(redis_server, tmp_path: Path) -> None:
    """A run checkpointed by a plain TrainingSession (step 5, no guard state) restores
    under GuardedTraining with a fresh guard, and a NaN at step 6 rolls back to that
    step-5 checkpoint: its batch never trained, every record once."""
    store = _setup(redis_server.url, tmp_path)
    state, _, opt = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        assert sess.restore(state) == 0
        step_fn = gt.train_step(state["model"], N)
        batches = sess.batches(sess.dataset(batch_size=8))
        for _ in range(5):
            step_fn(next(batches))
            opt.step()
            opt.zero_grad()
        batches.close()
        sess.checkpoint(state, 5, blocking=True)
    finally:
        sess.close()
    hit: list[int] = []

    def nan_at_6(batch: Batch, step: int) -> float | None:
        if step == 6 and not hit:
            hit.append(step)
            return math.nan
        return None

    res = gt.train(redis_server.url, store, N, inject=nan_at_6)
    assert [s for s, _ in res.rollbacks] == [6] and res.restored == [5]
    _check_ledger(res, res.batches[res.rollbacks[0][1]])


def test_restart_after_rollback_to_an_older_checkpoint_keeps_the_new_lineage(
    redis_server, tmp_path: Path
) -> None:
    """checkpoints_back=1: the spike at step 26 rolls back to step 20, which is then
    checkpointed again and the run stops. The restart restores that new step-20
    checkpoint (its guard state knows the rollback and the skipped batch), not the
    abandoned lineage's step 25."""
    store = _setup(redis_server.url, tmp_path)
    cfg, back = SpikeConfig(window=10, warmup_steps=5), RollbackConfig(checkpoints_back=1)
    first = gt.train(redis_server.url, store, N, inject=_spike_once_at(POISON, 1e6), spike=cfg,
                     rollback=back, stop_after_rollback=True)
    assert first.restored == [20]
    state, _, opt = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        again = GuardedTraining(sess, state, optimizer=opt, spike=cfg, rollback=back)
        assert again.restore() == 20
        assert again.guard.policy.total_rollbacks == 1
    finally:
        sess.close()


def test_spike_without_a_checkpoint_before_it_is_a_clear_error(redis_server, tmp_path: Path) -> None:
    """initial_checkpoint=False on a fresh run and a NaN loss at the first step: there
    is nothing to roll back to, so observe() raises NoRollbackTargetError (still a
    RollbackLimitError, and a LookupError) naming the spike's step and what it found."""
    store = _setup(redis_server.url, tmp_path)
    state, _, _ = gt.make_state(N)
    sess = gt.session(redis_server.url, store)
    try:
        guarded = GuardedTraining(sess, state, initial_checkpoint=False)
        assert guarded.restore() == 0
        batch = next(iter(guarded.batches(sess.dataset(batch_size=8))))
        with pytest.raises(NoRollbackTargetError) as info:
            guarded.observe(math.nan, batch)
        assert isinstance(info.value, RollbackLimitError) and isinstance(info.value, LookupError)
        assert "loss spike at step 1" in str(info.value)
        assert "found none in []" in str(info.value)
    finally:
        sess.close()
