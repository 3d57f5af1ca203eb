"""The resharding plan: which saved bytes fill a requested block (pure arithmetic)."""

from __future__ import annotations

import pytest

from checkpoint_store.reshard import Piece, plan_region
from trainguard.core.checkpoints import CorruptCheckpointError


def _rows(bounds: list[tuple[int, int]], cols: int, itemsize: int = 4) -> list[dict]:
    """Row blocks of a (n, cols) tensor, each in its own array at offset 0."""
    return [{"array": f"r{i}/t0", "offset": 0, "nbytes": (hi - lo) * cols * itemsize,
             "offsets": [lo, 0], "shape": [hi - lo, cols]} for i, (lo, hi) in enumerate(bounds)]


def test_four_to_two_reads_exactly_the_share():
    """37 rows saved 10/10/10/7 and read as 19/18: each target reads only its own rows,
    so the bytes read per rank equal its share exactly."""
    saved = _rows([(0, 10), (10, 20), (20, 30), (30, 37)], 3)
    first = plan_region(saved, (0, 0), (19, 3), where="t")
    second = plan_region(saved, (19, 0), (18, 3), where="t")
    assert sum(p.nbytes for p in first) == 19 * 3 * 4
    assert sum(p.nbytes for p in second) == 18 * 3 * 4
    assert second[0] == Piece("r1/t0", 9 * 12, 12, (19, 0), (1, 3))


def test_empty_target_needs_nothing_even_with_several_blocks():
    """An empty block (FSDP2's empty local shard) plans no reads instead of reporting
    damage (the bug: "cover -14 of the 0 elements")."""
    assert plan_region(_rows([(0, 3), (3, 5)], 7), (5, 0), (0, 7), where="t") == []


def test_identical_blocks_count_once_and_other_overlaps_are_damage():
    """The same block recorded twice (replicated) is read once; blocks that overlap
    partially, or leave a gap, cannot fill the target and say so."""
    twice = _rows([(0, 4), (0, 4)], 3)
    assert [p.array for p in plan_region(twice, (0, 0), (4, 3), where="t")] == ["r0/t0"]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        plan_region(_rows([(0, 3), (2, 4)], 3), (0, 0), (4, 3), where="t")
    with pytest.raises(CorruptCheckpointError, match="cover only 6 of the 12"):
        plan_region(_rows([(0, 2)], 3), (0, 0), (4, 3), where="t")
