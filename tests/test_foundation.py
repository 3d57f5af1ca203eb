"""The foundation's one-of-each pieces, as the parts and the CLI rely on them: the exit
code map, the session record and the restore order, the store port's entry point, and
the retry policy's backoff."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from trainguard.core import record
from trainguard.core.checkpoints import (
    CorruptCheckpointError,
    NoCheckpointError,
    PinnedCheckpointError,
    open_store,
)
from trainguard.core.newest import newest_first
from trainguard.core.record import RankState, RecordError, SessionRecord
from trainguard.core.resilience import Backoff, CircuitOpenError, RetryPolicy
from trainguard.core.streams import ContractError, DatasetNotFoundError
from trainguard.ops import exits


@dataclass(frozen=True)
class _Manifest:
    name: str
    step: int
    uid: str
    extra: dict[str, Any] = field(default_factory=dict)
    pinned: bool = False


def _record(**kw: Any) -> SessionRecord:
    base: dict[str, Any] = dict(dataset="tok", run="exp", partitions=2, generation=1, commit=1,
                                world_size=1, num_workers=0, offsets={0: "1-4", 1: "0-0"},
                                batches={0: 1, 1: 0}, version=2)
    return SessionRecord(**(base | kw))


# --------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(("exc", "code"), [
    (CorruptCheckpointError("crc"), 1),  # a ValueError too, but damage is a failure
    (NoCheckpointError("none"), 3),
    (FileNotFoundError("gone"), 3),
    (DatasetNotFoundError("no ds"), 3),
    (LookupError("x"), 3),
    (PinnedCheckpointError("pinned"), 4),
    (FileExistsError("exists"), 4),
    (ContractError("bad name"), 2),
    (ValueError("bad"), 2),
    (CircuitOpenError("redis", "open", 1.0), 1),
    (OSError(5, "EIO"), 1),
    (KeyboardInterrupt(), 130),
])
def test_one_exit_code_map(exc: BaseException, code: int) -> None:
    """Every command maps what it raised through the one table."""
    assert exits.exit_code(exc) == code


def test_gpu_critical_exits_with_the_trainers_code() -> None:
    """A CRITICAL GPU error carries the code the trainer exits with: the CLI answers the
    same 75 (the two constants agree)."""
    from trainer_client.errors import GpuCriticalError
    from trainer_client.health import EXIT_GPU_CRITICAL

    err = GpuCriticalError("gpu 0 lost", report=None, exit_code=EXIT_GPU_CRITICAL)
    assert exits.exit_code(err) == exits.EXIT_GPU_CRITICAL == EXIT_GPU_CRITICAL == 75


def test_a_bug_is_not_mapped_and_keeps_its_traceback() -> None:
    """An exception outside the table (a bug) is not turned into a quiet exit code."""
    assert exits.exit_code(TypeError("oops")) is None
    assert exits.exit_code(AttributeError("oops")) is None


def test_help_prints_the_exit_codes() -> None:
    out = subprocess.run([sys.executable, "-m", "trainguard", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for line in ("0    success", "3    not found", "4    refused", "75   GPU health CRITICAL"):
        assert line in out


# --------------------------------------------------------------------------- session record


def test_session_record_round_trips_through_extra() -> None:
    """What the session writes is what every reader parses back, and the wire is the
    documented one (string partition keys)."""
    rec = _record(skipped=("0:1-0..1-3",))
    extra = rec.to_extra()
    assert extra["trainguard"]["offsets"] == {"0": "1-4", "1": "0-0"}
    assert extra["skipped_batches"] == ["0:1-0..1-3"]
    assert SessionRecord.from_extra(extra) == rec
    assert "skipped_batches" not in _record().to_extra()  # a run that never skips
    assert SessionRecord.from_extra({"user": 1}) is None


def test_version_3_keeps_offsets_and_rank_states_out_of_the_manifest() -> None:
    """Version 3 (the per-rank layout) writes the run-wide fields only: no offsets,
    batches or rank states, which each rank's own object carries; it parses back."""
    rec = _record(seed=7, offsets={}, batches={}, version=3)
    doc = rec.to_extra()["trainguard"]
    assert doc == {"version": 3, "dataset": "tok", "run": "exp", "partitions": 2,
                   "generation": 1, "commit": 1, "world_size": 1, "num_workers": 0,
                   "seed": 7}
    assert SessionRecord.from_extra(rec.to_extra()) == rec


def test_rank_objects_give_each_partition_from_its_owner_only() -> None:
    """positions() reads, for partitions of a 4-rank checkpoint, only the objects of
    the ranks that owned them, once each, and a version 2 record reads none."""
    from trainguard.core.rank_record import RankRecord, positions

    rec = _record(partitions=8, world_size=4, offsets={}, batches={}, version=3)
    objs = {r: RankRecord(rank=r, world_size=4, num_workers=0,
                          offsets={p: f"1-{p}" for p in range(r, 8, 4)},
                          batches={p: p for p in range(r, 8, 4)}) for r in range(4)}
    reads: list[int] = []

    def read(rank: int) -> RankRecord:
        reads.append(rank)
        return RankRecord.from_wire(objs[rank].to_wire(), rank=rank)

    got = positions(rec, [1, 5, 2], read)
    assert got.offsets == {1: "1-1", 5: "1-5", 2: "1-2"} and got.batches == {1: 1, 5: 5, 2: 2}
    assert reads == [1, 2]
    assert positions(_record(), [0, 1], read).offsets == {0: "1-4", 1: "0-0"}
    assert reads == [1, 2]
    with pytest.raises(RecordError, match="rank 3's says rank 1"):
        RankRecord.from_wire(objs[1].to_wire(), rank=3)


def test_version_2_carries_seed_and_rank_states_and_version_1_still_reads() -> None:
    """Version 2 adds the run seed and each rank's random states and epoch position;
    a version 1 record (written before them) still reads, with none of them."""
    rec = _record(seed=7, ranks={0: RankState(rng={"torch": "AAAA"}, epoch=1, epoch_batches=3),
                                 1: RankState()})
    extra = rec.to_extra()
    assert extra["trainguard"]["version"] == 2
    assert extra["trainguard"]["seed"] == 7
    assert extra["trainguard"]["ranks"] == {
        "0": {"rng": {"torch": "AAAA"}, "epoch": 1, "epoch_batches": 3},
        "1": {"rng": {}, "epoch": 0, "epoch_batches": 0},
    }
    assert SessionRecord.from_extra(extra) == rec
    v1 = {"trainguard": {"version": 1, "dataset": "tok", "run": "r", "partitions": 2,
                         "generation": 3, "commit": 4, "world_size": 1, "num_workers": 0,
                         "offsets": {"0": "1-4"}, "batches": {"0": 1}}}
    old = SessionRecord.from_extra(v1)
    assert old is not None and (old.version, old.seed, dict(old.ranks)) == (1, None, {})
    assert old.offsets == {0: "1-4"} and old.generation == 3


@pytest.mark.parametrize("doc", [
    {"trainguard": {"version": 5, "dataset": "tok"}},
    {"trainguard": "not a record"},
    {"trainguard": {"version": 2, "dataset": "tok", "ranks": {"0": {"rng": "x"}}}},
    {"trainguard": {"dataset": "tok", "generation": "x"}},
    {"trainguard": {"dataset": "tok", "offsets": {"0": "not-an-id"}}},
])
def test_a_newer_or_malformed_record_is_refused_clearly(doc: dict[str, Any]) -> None:
    with pytest.raises(RecordError):
        SessionRecord.from_extra(doc)


def test_restore_order_is_generation_then_commit_then_commit_time() -> None:
    """A rollback's lineage (higher commit, lower step) beats the steps it abandoned; a
    newer generation beats a zombie's late commit; checkpoints without a record (or
    with an unreadable one) sort by commit time, below every session checkpoint."""
    def m(step: int, uid: str, **kw: Any) -> _Manifest:
        return _Manifest(f"{step:012d}-{uid}.json", step, uid,
                         _record(**kw).to_extra() if kw else {})

    plain_old, plain_new = m(5, "0001-aa"), m(1, "0002-aa")
    abandoned = m(30, "0003-aa", generation=1, commit=2)
    rolled_back = m(20, "0004-aa", generation=1, commit=3)
    zombie_late = m(40, "0006-aa", generation=1, commit=4)
    restarted = m(25, "0005-aa", generation=2, commit=4)
    broken = _Manifest("000000000050-0007-aa.json", 50, "0007-aa", {"trainguard": "junk"})
    order = newest_first(
        [plain_old, abandoned, broken, zombie_late, rolled_back, plain_new, restarted])
    assert [x.step for x in order] == [25, 40, 20, 30, 50, 1, 5]


def test_retention_floor_is_the_oldest_kept_offset_of_this_run() -> None:
    kept = [_Manifest("a", 1, "01", _record(offsets={0: "1-2", 1: "1-9"}).to_extra()),
            _Manifest("b", 2, "02", _record(run="other", offsets={0: "0-0"}).to_extra())]
    floor = record.retention_floor({0: "1-7", 1: "1-8"}, kept, dataset="tok", run="exp")
    assert floor == {0: "1-2", 1: "1-8"}


# --------------------------------------------------------------------------- store port


def test_open_store_makes_the_registered_implementation(tmp_path) -> None:
    """A URL becomes a store through the ``trainguard.checkpoint_stores`` entry point:
    the trainer client opens one without importing checkpoint_store."""
    import checkpoint_store

    store = open_store(str(tmp_path / "ck"), keep_last=2)
    try:
        assert isinstance(store, checkpoint_store.CheckpointStore)
        assert store.keep_last == 2  # type: ignore[attr-defined]
    finally:
        store.close()
    with pytest.raises(LookupError, match="no checkpoint store implementation 'nope'"):
        open_store(str(tmp_path), implementation="nope")


# --------------------------------------------------------------------------- backoff


def test_backoff_doubles_to_the_cap_and_resets() -> None:
    """The loops that retry by themselves (producer re-sync, uploader) wait what the
    policy says: initial, doubling, capped; a success starts over."""
    backoff = Backoff(RetryPolicy(wait_initial_s=0.5, wait_max_s=3.0, wait_jitter_s=0.0))
    assert [backoff.next_wait_s() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_wait_s() == 0.5
    jittered = Backoff(RetryPolicy(wait_initial_s=0.5, wait_max_s=3.0, wait_jitter_s=0.25))
    assert 0.5 <= jittered.next_wait_s() <= 0.75


def test_a_store_loads_what_a_restart_resumes_from(tmp_path) -> None:
    """CheckpointStore.load() walks the same restore order as the session: after a
    zombie's late commit (generation 1) the newer generation's checkpoint loads, while
    latest() still names the newest commit (what LATEST points to)."""
    import torch

    from checkpoint_store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck", keep_last=10)
    for step, gen, commit in ((10, 1, 1), (15, 2, 2), (30, 1, 2)):
        state = {"w": torch.full((2,), float(step))}
        store.save(state, step=step, extra=_record(generation=gen, commit=commit).to_extra())
    target = {"w": torch.zeros(2)}
    loaded = store.load(target)
    assert loaded is not None and loaded.step == 15 and target["w"].tolist() == [15.0, 15.0]
    latest = store.latest()
    assert latest is not None and latest.step == 30
    store.close()
