"""``bench/scale.py`` (the commit at W ranks x P partitions) at a toy size on the single
Redis it starts itself: checks what the run did (which objects a restore read, that
every size and side was measured in every round, what reached the results file),
never how long anything took."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import scale  # noqa: E402

from trainguard.core import streams  # noqa: E402

RANKS, PARTS, WORKERS, SAMPLE, ROUNDS = [4, 8], [32, 64], 2, 2, 1


def owners_read(P: int, W: int, W2: int, rank: int) -> int:
    """How many ranks of layout W own the partitions rank ``rank`` reads at W2."""
    mine = streams.rank_partitions(P, world_size=W2, num_workers=WORKERS, rank=rank)
    return len({streams.partition_owner(p, partitions=P, world_size=W, num_workers=WORKERS)
                for p in mine})


def test_scale_bench_restores_read_only_the_owners_objects(tmp_path: Path):
    """At every size a same-W restore reads exactly one rank object (its own) plus the
    manifest, and a restore at W x 0.75 or W x 1.25 reads exactly the objects of the
    ranks that owned its partitions; the baseline's rank reads its whole manifest,
    which grows with W while the new one stays the index; both sides are measured in
    every round; the section lands in the results file as returned."""
    out = tmp_path / "results.json"
    section = scale.main([
        "--ranks", ",".join(map(str, RANKS)), "--partitions", ",".join(map(str, PARTS)),
        "--workers", str(WORKERS), "--sample", str(SAMPLE), "--rounds", str(ROUNDS),
        "--no-cluster", "--out", str(out),
    ])
    fig = section["targets"]["single"]
    sizes = {(f["world_size"], f["partitions"]): f for f in fig["sizes"]}
    assert set(sizes) == {(w, p) for w in RANKS for p in PARTS}
    for (W, P), f in sizes.items():
        assert f["sampled_ranks"] == [0, W - 1]
        # Of the sampled ranks only rank 0 lists the store; the other GETs its list.
        assert f["store_listings_per_commit"] == 1
        same = f["restore_same"]
        assert same["new"]["objects_read_max"] == 1
        # The manifest and the object of its own rank, nothing else.
        assert same["new"]["bytes_read_per_rank"] < f["manifest_bytes"]["new"] + 2 * f[
            "object_bytes_median"]
        assert same["old"]["bytes_read_per_rank"] == f["manifest_bytes"]["old"] - f[
            "manifest_bytes"]["new"]
        for change, factor in (("minus25", 0.75), ("plus25", 1.25)):
            W2 = round(W * factor)
            assert f[f"restore_{change}"]["new"]["world_size"] == W2
            ranks = sorted({round(i * (W2 - 1) / (SAMPLE - 1)) for i in range(SAMPLE)})
            assert f[f"restore_{change}"]["new"]["objects_read_max"] == max(
                owners_read(P, W, W2, r) for r in ranks)
        for key in ("stall_s", "commit_s", "rank_work_s", "redis_cpu_s"):
            assert f[key]["new"]["n"] == f[key]["old"]["n"] == f[key]["ratio"]["n"] == ROUNDS
        # Main's restore before the placement raised the fences (a pass of fences
        # first), beside the new one in every round, and the fence check (now in the
        # commit) measured with the loop's stall too; the new restore has no fence pass.
        two = same["two_pass"]
        assert two["restore_s"]["n"] == same["ratio_two_pass"]["n"] == ROUNDS
        assert two["place_us_per_partition"]["n"] == ROUNDS
        assert two["fencing"]["fence_us_per_partition"]["n"] == ROUNDS
        assert "fence_us_per_partition" not in same["new"]["fencing"]
        assert f["parts"]["new"]["stall_with_fence_s"]["n"] == ROUNDS
    for P in PARTS:
        small, big = sizes[(RANKS[0], P)], sizes[(RANKS[1], P)]
        # Baseline: every rank's random states in the manifest; new: 35 B of index per rank.
        grew_old = big["manifest_bytes"]["old"] - small["manifest_bytes"]["old"]
        grew_new = big["manifest_bytes"]["new"] - small["manifest_bytes"]["new"]
        assert grew_old > (RANKS[1] - RANKS[0]) * 1000
        # 35 B an index entry; the rest of the manifest differs only by the digits of
        # its timestamp and of the generation (a restore bumps it every round).
        assert abs(grew_new - (RANKS[1] - RANKS[0]) * 35) <= 8
    assert set(fig["exponents"]["in_W"]) == set(scale.COSTS)
    assert len(fig["targets"]) == 3 * len(PARTS) + len(PARTS)
    doc = json.loads(out.read_text())
    written = dict(doc["benches"]["scale_ranks"])
    written.pop("commit")
    assert written == json.loads(json.dumps(section))
