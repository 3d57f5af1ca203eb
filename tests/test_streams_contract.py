"""The stream contract: keys, IDs, encoding and assignment are pure and stable."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.core import streams as s


def test_keys_share_a_hash_slot_per_partition() -> None:
    # Everything a Lua script touches for partition 7 carries the same hash tag.
    tag = "{tok:p0007}"
    assert s.partition_key("tok", 7) == f"tg:{tag}"
    assert tag in s.seq_key("tok", 7)
    assert tag in s.fence_key("tok", 7, "run1")
    assert s.meta_key("tok") == "tg:{tok}:meta"


def test_ids_are_deterministic_and_ordered() -> None:
    assert s.make_id(0, 0) == "1-0"
    assert s.id_epoch_index("3-17") == (2, 17)
    assert s.parse_id(b"10-2") > s.parse_id("9-99")
    with pytest.raises(s.ContractError, match="not of the form"):
        s.parse_id("abc")


@given(st.integers(0, 10_000), st.integers(0, 2**40))
def test_id_round_trip(epoch: int, index: int) -> None:
    assert s.id_epoch_index(s.make_id(epoch, index)) == (epoch, index)


@pytest.mark.parametrize(
    "value",
    [b"\x00raw\xff", {"text": "hi", "n": [1, 2.5, None]}, "plain", 7,
     np.arange(12, dtype=np.int32).reshape(3, 4), np.array([], dtype=np.uint16)],
)
def test_record_round_trip(value: object) -> None:
    fields = s.encode_record(value, pos="f.jsonl:3")
    assert fields[s.F_POS] == b"f.jsonl:3"
    back = s.decode_record(fields)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value


def test_bytes_stay_raw() -> None:
    payload = bytes(range(256)) * 4
    assert s.encode_record(payload)[s.F_DATA] is not None
    assert s.encode_record(payload)[s.F_DATA] == payload


def test_unencodable_record_says_what_it_got() -> None:
    with pytest.raises(s.ContractError, match="type object cannot be encoded"):
        s.encode_record(object())


@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 4))
def test_every_partition_has_exactly_one_owner(p: int, world: int, workers: int) -> None:
    owners: dict[int, int] = {}
    for rank in range(world):
        for worker in range(max(1, workers)):
            for part in s.assign_partitions(
                p, world_size=world, num_workers=workers, rank=rank, worker=worker
            ):
                assert part not in owners
                owners[part] = rank
    assert sorted(owners) == list(range(p))


def _filtered(p: int, world: int, workers: int, rank: int, worker: int) -> list[int]:
    """The assignment as version 2 computed it: a filter over every partition."""
    total = world * max(1, workers)
    return [q for q in range(p) if q % total == rank * max(1, workers) + worker]


@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 8), st.data())
def test_rank_assignment_equals_the_filtered_one(p: int, world: int, workers: int,
                                                 data: st.DataObject) -> None:
    """The stepped assignment, rank_partitions and partition_owner give exactly the
    partitions (and owners) of the O(P) filter they replace."""
    rank = data.draw(st.integers(0, world - 1))
    per_worker = [_filtered(p, world, workers, rank, w) for w in range(max(1, workers))]
    for w, expect in enumerate(per_worker):
        assert s.assign_partitions(p, world_size=world, num_workers=workers, rank=rank,
                                   worker=w) == expect
    mine = s.rank_partitions(p, world_size=world, num_workers=workers, rank=rank)
    assert mine == sorted(q for ps in per_worker for q in ps)
    for q in range(p):
        owner = s.partition_owner(q, partitions=p, world_size=world, num_workers=workers)
        assert (owner == rank) == (q in mine)


def test_the_largest_layout_is_accepted_and_owned_once() -> None:
    """65,536 partitions is a valid dataset, and over 16,384 ranks x 8 workers (more
    consumers than partitions) every partition still has exactly one owner."""
    s.DatasetSpec("big", partitions=s.MAX_PARTITIONS, source="memory://x")
    with pytest.raises(s.ContractError, match="between 1 and 65536"):
        s.DatasetSpec("big", partitions=s.MAX_PARTITIONS + 1, source="memory://x")
    P, W = s.MAX_PARTITIONS, 16384
    seen = [q for r in range(W) for q in s.rank_partitions(P, world_size=W, num_workers=8, rank=r)]
    assert sorted(seen) == list(range(P))
    assert s.partition_key("big", 65535) == "tg:{big:p65535}"


def test_spec_round_trips_through_redis_fields_and_reports_differences() -> None:
    spec = s.DatasetSpec("tok", partitions=4, source="memory://x.jsonl", seed=3)
    assert s.DatasetSpec.from_redis(spec.to_redis()) == spec
    other = s.DatasetSpec("tok", partitions=8, source="memory://x.jsonl", seed=3)
    assert spec.differences(other) == {"partitions": (4, 8)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"name": "bad name"}, "not valid"), ({"partitions": 0}, "between 1"),
     ({"format": "csv"}, "unknown"), ({"source": ""}, "needs a source")],
)
def test_spec_rejects_bad_values(kwargs: dict, message: str) -> None:
    base = {"name": "ok", "source": "memory://x"} | kwargs
    with pytest.raises(s.ContractError, match=message):
        s.DatasetSpec(**base)


def test_contract_module_imports_nothing_heavy() -> None:
    code = ("import sys, trainguard.core.streams; "
            "print(sorted(m for m in ('aiohttp','torch','redis','zarr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
