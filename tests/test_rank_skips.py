"""Skipped batches live in the per-rank state objects (session record version 4):
each rank's own, none lost to rank 0's manifest, carried over restores on the same
world size and across a world change, and read back by the run history (the admin
API's and ``trainguard runs show``'s) in the same shape as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_store import CheckpointStore
from ingest_service.service.admin_checkpoints import StoreRoot, StoreSet
from ingest_service.service.catalog import NEVER
from ingest_service.service.runs import _root_histories
from tests import _client_fill as cf
from tests.servers import free_port
from trainguard.core.rank_record import RankRecord, carried_skips, checkpoint_skipped
from trainguard.core.record import SKIPPED_KEY, RankState, SessionRecord

ROOT = Path(__file__).resolve().parents[1]
N, P = 96, 4  # 24 records a partition; batches of 4


def rank_lines(url: str, store: str, world: int, steps: int, *extra: str
               ) -> list[dict[str, str]]:
    """Run ``world`` ranks of tests/_rank_skips.py; each rank's printed figures."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests._rank_skips", "--redis", url, "--store", store,
             "--steps", str(steps), *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, text[-3000:]
        out.append(dict(x.split(" ", 1) for x in text.splitlines()
                        if x.startswith(("SKIPPED ", "LISTS ", "WARNED "))))
    return out


def _ranks(url: str, store: str, world: int, steps: int, *extra: str) -> list[str]:
    """Each rank's skipped batch ID."""
    return [x["SKIPPED"] for x in rank_lines(url, store, world, steps, *extra)]


def test_each_ranks_skips_are_kept_in_its_object_and_carried_over_restores(
        redis_server, tmp_path: Path) -> None:
    """Two ranks each skip a batch of their own partitions: the checkpoint lists both
    (before, the manifest held rank 0's alone), each in its own rank's object and none
    in the manifest; a restore on 2 ranks carries each rank's own on; a restore on 1
    rank (a world change) carries both; the run history (the admin API's path) counts
    2 skipped batches at each of the three checkpoints."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    url = f"file://{tmp_path}/c"
    skipped = _ranks(redis_server.url, url, 2, 2, "--skip")
    assert skipped[0] != skipped[1]
    store = CheckpointStore(url, keep_last=100)

    def skips_at(step: int) -> tuple[str, ...] | None:
        m = next(m for m in store.list() if m.step == step)
        rec = SessionRecord.of(m)
        assert rec is not None and rec.version == 4 and SKIPPED_KEY not in m.extra
        return checkpoint_skipped(store, m, rec)

    assert skips_at(2) == tuple(skipped)
    first = next(m for m in store.list() if m.step == 2)
    for rank in range(2):
        obj = RankRecord.from_wire(store.read_rank_state(first, rank), rank=rank)
        assert obj.skipped == (skipped[rank],) and obj.version == 2

    _ranks(redis_server.url, url, 2, 1)  # same world: each rank carries its own on
    assert skips_at(3) == tuple(skipped)
    again = next(m for m in store.list() if m.step == 3)
    assert [RankRecord.from_wire(store.read_rank_state(again, r), rank=r).skipped
            for r in range(2)] == [(skipped[0],), (skipped[1],)]

    _ranks(redis_server.url, url, 1, 1)  # world 2 -> 1: the one rank carries both
    assert set(skips_at(4) or ()) == set(skipped)

    stores = StoreSet({"c": StoreRoot("c", url)})
    try:
        (h,) = _root_histories(stores, None, stores.roots["c"], NEVER)
    finally:
        stores.close()
    assert [(c["step"], c["skipped"]) for c in h["checkpoints"]] == [(2, 2), (3, 2), (4, 2)]
    store.close()


def _rec(version: int, skipped: tuple[str, ...] | None = None) -> SessionRecord:
    return SessionRecord(dataset="tok", run="exp", partitions=4, generation=1, commit=1,
                         world_size=2, num_workers=0, skipped=skipped, seed=1,
                         version=version)


def test_a_version_4_record_refuses_skips_and_a_version_3_one_keeps_them() -> None:
    """Version 4 has no manifest field for skips (a writer that put them there would
    hide them from every reader): refused, naming where they go. Version 3 still
    writes and parses them, so checkpoints of the previous writer keep their skips."""
    with pytest.raises(ValueError, match="each rank's object holds its own"):
        _rec(4, ("0:1-0..1-3",)).to_extra()
    assert SKIPPED_KEY not in _rec(4).to_extra()
    old = _rec(3, ("0:1-0..1-3",)).to_extra()
    assert old[SKIPPED_KEY] == ["0:1-0..1-3"]
    parsed = SessionRecord.from_extra(old)
    assert parsed is not None
    # A version 3 checkpoint's skips come from its manifest: no rank object is read.
    assert checkpoint_skipped(None, None, parsed) == ("0:1-0..1-3",)  # type: ignore[arg-type]


def test_rank_record_skips_round_trip_and_version_1_objects_still_read() -> None:
    obj = RankRecord(rank=1, world_size=2, num_workers=0, offsets={1: "1-3"},
                     batches={1: 1}, state=RankState(), skipped=("1:1-0..1-3",))
    wire = obj.to_wire()
    assert wire["skipped"] == ["1:1-0..1-3"] and wire["version"] == 2
    assert RankRecord.from_wire(wire, rank=1) == obj
    v1 = {k: v for k, v in wire.items() if k != "skipped"} | {"version": 1}
    assert RankRecord.from_wire(v1, rank=1).skipped is None
    with pytest.raises(ValueError, match="skipped is a str"):
        RankRecord.from_wire({**wire, "skipped": "1:1-0..1-3"}, rank=1)


def test_carried_skips_keep_those_of_the_ranks_partitions_and_the_unplaceable() -> None:
    """After a world change a rank carries the skips naming its partitions (a batch
    spanning two partitions goes with both owners) and those no partition places;
    together the new ranks carry every old skip."""
    a = RankRecord(rank=0, world_size=2, num_workers=0,
                   skipped=("0:1-0..1-3", "0:1-4..1-5;2:1-0..1-1", "custom"))
    b = RankRecord(rank=1, world_size=2, num_workers=0, skipped=("1:1-0..1-3",))
    none = RankRecord(rank=1, world_size=2, num_workers=0)
    assert carried_skips([a, b], [2, 3]) == ("0:1-4..1-5;2:1-0..1-1", "custom")
    assert carried_skips([a, b], [0, 1]) == ("0:1-0..1-3", "0:1-4..1-5;2:1-0..1-1",
                                             "custom", "1:1-0..1-3")
    assert carried_skips([none], [1]) is None
    assert carried_skips([b], [0]) == ()
