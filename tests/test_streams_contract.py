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
