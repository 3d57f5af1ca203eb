"""Run history and the interval advisor's inputs, from manifests that real
TrainingSession runs wrote: a trainer killed with SIGKILL twice and resumed shows two
restarts, each resuming at the step the restarted process reported; save timings,
restart counts and trained time reach the advisor; a rollback is on the timeline."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests._client_ledger import zygote
from trainer_client import TrainingSession
from trainguard.core import record
from trainguard.core.history import CheckpointRow, RestartRow, WorldRow, history
from trainguard.core.interval import IntervalPolicy, advise
from trainguard.core.newest import newest_first
from trainguard.core.rank_record import checkpoint_skipped
from trainguard.core.timing import Event, SaveTime, TimingError, TimingRecord, Totals
from trainguard.ops.cli import main

N, P = 720, 3


def _args(url: str, store: str) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "exp", "--store", store, "--n", str(N),
            "--batch-size", "8", "--ckpt-every", "6", "--sleep-ms", "20", "--keep-last", "100"]


def _ready_step(seen: list[str]) -> int:
    return int(next(s for s in reversed(seen) if s.startswith("0: READY")).split()[-1])


def test_history_of_a_run_killed_twice(redis_server, tmp_path: Path) -> None:
    """Two SIGKILLs after commits, then a run to the end: the manifests alone give
    two restarts (generations 1->2->3) resuming exactly where each new process said
    it resumed; the advisor's inputs equal what the manifests' timing records hold."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    resumed = []
    with zygote(tmp_path / "job.log") as z:
        for _ in range(2):
            job = z.spawn(_args(redis_server.url, store), 1)
            assert job.wait_line("READY", 120)
            resumed.append(_ready_step(job.seen))
            assert job.wait_line("COMMITTED", 120, nth=3)
            job.kill()
        job = z.spawn(_args(redis_server.url, store), 1)
        assert job.wait_line("READY", 120)
        resumed.append(_ready_step(job.seen))
        job.finish(300)
    manifests = CheckpointStore(store, keep_last=100).list()
    h = history(manifests, dataset="tok", run="exp")

    assert resumed[0] == 0
    assert [(r["from_generation"], r["generation"]) for r in h["restarts"]] == [(1, 2), (2, 3)]
    assert [r["resumed_step"] for r in h["restarts"]] == resumed[1:]
    # What the restore order picks among the older generation's manifests.
    for r in h["restarts"]:
        older = [m for m in manifests if record.SessionRecord.of(m).generation < r["generation"]]
        assert r["resumed_step"] == newest_first(older)[0].step
        assert r["steps_redone_exact"] is False  # a SIGKILL leaves no last step behind
    assert h["totals"]["failures"] == 2
    assert [c["generation"] for c in h["checkpoints"]] == sorted(
        c["generation"] for c in h["checkpoints"])
    # The producer's rows have exactly the keys of their types (the admin API adds
    # CheckpointRow's optional status later).
    assert all(set(c) == CheckpointRow.__required_keys__ for c in h["checkpoints"])
    assert all(set(r) == set(RestartRow.__annotations__) for r in h["restarts"])
    assert all(set(w) == set(WorldRow.__annotations__) for w in h["world"])
    assert h["world"] == [{"at": h["checkpoints"][0]["created_at"],
                           "step": h["checkpoints"][0]["step"], "world_size": 1,
                           "num_workers": 0}]

    # Save timings: every save but the last of each process is measured in a later
    # manifest; blocked never exceeds durable.
    timed = [c for c in h["checkpoints"] if c["blocked_s"] is not None]
    assert timed
    by_gen: dict[int, list[dict]] = {}
    for c in h["checkpoints"]:
        by_gen.setdefault(c["generation"], []).append(c)
    assert sorted(by_gen) == [1, 2, 3]
    for gen, cps in by_gen.items():
        # A save is measured in the manifests that follow it in its own process, so
        # the last saves of each process are not (a kill, or the end, comes first).
        assert all(c["blocked_s"] is not None for c in cps[:max(1, len(cps) - 3)]), gen
    assert all(0 < c["blocked_s"] <= c["durable_s"] for c in timed if c["durable_s"])

    # The advisor's inputs, recomputed from the raw timing records.
    records = [TimingRecord.from_extra(m.extra) for m in sorted(manifests, key=lambda m: m.uid)]
    # A save is listed by every later manifest (up to 8): once before it was durable,
    # then with its manifest's name and durable time.
    durable = {(s.step, s.blocked_s): s for r in records for s in r.saves if s.name}
    blocked = {(s.step, s.blocked_s) for r in records for s in r.saves}
    newest = records[-1]
    assert newest.totals.restarts == 2
    expected = advise(
        blocked_s=statistics.median(b for _, b in blocked),
        durable_s=statistics.median(s.durable_s for s in durable.values()),
        observed_s=newest.totals.trained_s, failures=2,
        current_s=statistics.median(r.interval_s for r in records[-8:] if r.interval_s),
    )
    assert h["advice"] == expected.to_json()


def _state() -> dict[str, object]:
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_rollback_and_restart_carry_into_the_advice(redis_server, tmp_path: Path,
                                                    capsys) -> None:
    """A rollback is recorded with the step it went back to and the step it left; a
    restarted session's advice already counts the restart and the measured saves."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 200)
    url = f"file://{tmp_path}/ckpt"
    policy = IntervalPolicy(prior_mtbf_s=3600, min_interval_s=0)
    s = TrainingSession(redis_server.url, dataset="tok", run="exp", store=url, block_ms=100,
                        interval=policy)
    state = _state()
    s.restore(state)
    assert s.checkpoint_advice() is None  # nothing measured yet
    assert s.should_checkpoint(0)  # min_interval_s=0: save at once to measure the cost
    it = iter(s.batches(DataLoader(s.dataset(batch_size=4), batch_size=None)))
    for step in (5, 10):
        for _ in range(5):
            next(it)
        s.checkpoint(state, step, blocking=True)
    s.rollback(state, 5)
    for _ in range(3):
        next(it)
    s.checkpoint(state, 8, blocking=True, skipped=["b-1"])
    advice = s.checkpoint_advice()
    assert advice is not None and advice.failures == 0
    s.close()

    store = CheckpointStore(url, keep_last=100)
    h = history(store.list(), dataset="tok", run="exp",
                skips=lambda m, rec: checkpoint_skipped(store, m, rec))
    assert [c["step"] for c in h["checkpoints"]] == [5, 10, 8]
    assert h["rollbacks"] == [{"at": h["rollbacks"][0]["at"], "to_step": 5, "last_step": 10,
                               "generation": 1, "skipped": ["b-1"]}]
    assert h["restarts"] == []
    assert h["totals"]["rollbacks"] == 1

    again = TrainingSession(redis_server.url, dataset="tok", run="exp", store=url,
                            block_ms=100, interval=policy)
    assert again.restore(_state()) == 8
    carried = again.checkpoint_advice()
    assert carried is not None and carried.failures == 1
    assert carried.blocked_s == pytest.approx(statistics.median(
        c["blocked_s"] for c in h["checkpoints"] if c["blocked_s"] is not None))
    again.close()

    # The CLI reads the same history from Redis and the store (no service running).
    common = ["--redis-url", redis_server.url, "--stores", f"main={url}"]
    assert main(["runs", "show", "exp", *common, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    after = history(store.list(), dataset="tok", run="exp",
                    skips=lambda m, rec: checkpoint_skipped(store, m, rec))
    assert after["rollbacks"][0]["skipped"] == ["b-1"]  # read from the rank object
    assert {k: shown[k] for k in after} == {**after, "checkpoints": [
        {**c, "status": ["committed"], "tiers": ["disk"]} for c in after["checkpoints"]]}
    assert shown["store"] == "main" and shown["group"]["lag"] is not None
    assert main(["runs", "ls", *common]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == [
        "RUN", "DATASET", "STORE", "CKPTS", "STEP", "LAST", "COMMIT", "GEN", "RESTARTS",
        "ROLLBACKS", "LAG", "INTERVAL", "RECOMMENDED"]
    assert text.splitlines()[1].split()[:5] == ["exp", "tok", "main", "3", "8"]
    assert main(["runs", "show", "nope", *common]) == 3  # not found


def test_timing_record_format_and_refusals() -> None:
    """The timing record's document, exactly (version 1); a newer version and a
    malformed record are refused with a clear error."""
    rec = TimingRecord(
        saves=(SaveTime(10, "m10.json", 0.5, 2.0), SaveTime(20, None, 0.25, None)),
        events=(Event("restore", 10, 2, 1700000000.0, None),),
        interval_s=30.0, interval_steps=10, totals=Totals(1, 0, 3600.0))
    doc = rec.to_extra()
    assert doc == {"trainguard_timing": {
        "version": 1,
        "saves": [{"step": 10, "name": "m10.json", "blocked_s": 0.5, "durable_s": 2.0},
                  {"step": 20, "name": None, "blocked_s": 0.25, "durable_s": None}],
        "events": [{"kind": "restore", "to_step": 10, "generation": 2, "at": 1700000000.0,
                    "last_step": None}],
        "interval": {"seconds": 30.0, "steps": 10},
        "totals": {"restarts": 1, "rollbacks": 0, "trained_s": 3600.0},
    }}
    assert TimingRecord.from_extra(doc) == rec
    assert TimingRecord.from_extra({}) is None
    with pytest.raises(TimingError, match=r"version 2.*upgrade trainguard"):
        TimingRecord.from_extra({"trainguard_timing": {"version": 2}})
    with pytest.raises(TimingError, match=r"malformed.*KeyError"):
        TimingRecord.from_extra({"trainguard_timing": {"version": 1, "saves": [{"step": 1}]}})
    with pytest.raises(TimingError, match="event kind 'crash' is unknown"):
        TimingRecord.from_extra({"trainguard_timing": {"version": 1, "events": [
            {"kind": "crash", "to_step": 1, "at": 0}]}})
