"""``bench/scale.py --per-op`` at a toy size (16 partitions, 2 ranks), on the single Redis and
the Redis Cluster it starts itself, so that the figures behind docs/SCALING.md can be
taken again. Checks what the run did (counts, which partitions a commit covered, how
many partitions one transaction reads), never how long it took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import scale  # noqa: E402

P, E, SIZE, RANKS, WORKERS, BATCH, ROUNDS = 16, 4, 64, 2, 2, 4, 2


def test_scale_bench_measures_every_cost_on_single_redis_and_on_the_cluster(tmp_path: Path):
    """Every record is ingested (and every record of the deep dataset read) and the read rounds consume P records each, one of every
    partition (so each checkpoint commits all P offsets); a round's read asks all P
    partitions in one round trip, on single Redis and on the cluster (one pipeline per
    master); W simulated ranks are restarted and gathered; the section lands in the
    results file as returned."""
    out = tmp_path / "results.json"
    section = scale.main([
        "--per-op", "--partitions", str(P), "--entries", str(E), "--record-bytes", str(SIZE),
        "--ranks", str(RANKS), "--workers", str(WORKERS), "--batch", str(BATCH),
        "--rounds", str(ROUNDS), "--restores", "1", "--deep-partitions", "4",
        "--deep-entries", "32", "--out", str(out),
    ])
    targets = section["targets"]
    assert set(targets) == {"single", "cluster"}
    for name, fig in targets.items():
        assert fig["ingest"]["records"] == P * E
        assert fig["ingest"]["mb"] == round(P * E * SIZE / 1e6, 3)
        # A stream entry costs its payload and more; a group costs something per partition.
        assert fig["ingest"]["memory_usage_bytes_per_entry"] > SIZE
        assert fig["group"]["memory_usage_bytes_per_partition"] > 0
        assert fig["deep_read"]["pending_bytes_per_entry"] > 0
        assert (fig["deep_ingest"]["records"] == fig["deep_read"]["records"]
                == fig["deep_read_deterministic"]["records"] == 4 * 32)
        # A deterministic read asks, in one round trip, every partition whose next
        # records are not read ahead yet, a batch of each: batches led in turn use up
        # the 4 heads together, so each read asks all 4 partitions for BATCH entries.
        assert fig["deep_read_deterministic"]["partitions_per_read"] == 4
        assert fig["deep_read_deterministic"]["entries_per_xreadgroup"] == BATCH
        read = fig["read"]
        assert read["records"] == ROUNDS * P
        # One read per round asks every partition, and each is sent ahead of its round
        # (the first round also reads its own): ROUNDS + 1 reads.
        assert read["reads"] == ROUNDS + 1
        assert read["xreadgroup"] == read["reads"] * P
        assert read["partitions_per_read"] == P
        commit = fig["commit"]
        # Record version 3: no offset in the manifest; the one rank's state object
        # holds every partition's, each committed.
        assert commit["offsets_in_manifest"] == 0
        assert commit["offsets_in_rank_state"] == commit["partitions_committed"] == P
        assert commit["rank_state_bytes"] > 0
        for key in ("checkpoint_s", "checkpoint_cpu_s", "stall_s", "publish_s", "fence_check_s",
                    "fence_check_cpu_s"):
            assert commit[key]["n"] == ROUNDS
            assert commit[key]["min"] <= commit[key]["median"] <= commit[key]["max"]
        ranks = fig["ranks"]
        assert (ranks["world_size"], ranks["workers"]) == (RANKS, WORKERS)
        assert ranks["masters"] == (1 if name == "single" else 3)
        assert ranks["rank_restart_s"]["n"] == ranks["rank_fence_check_s"]["n"] == RANKS
        assert ranks["gather_bytes_per_rank"] == RANKS * ranks["gather_payload_bytes"]
        assert ranks["generations_taken"] == 1
        assert set(fig["at_world"]) == {"commit_s", "stall_s", "restore_s", "fence_queue_s"}
    doc = json.loads(out.read_text())
    assert doc["format"] == "trainguard.bench/1"
    written = dict(doc["benches"]["scale"])
    measured = written.pop("commit")  # bench/rounds.py names the commit each section measured
    assert measured is None or isinstance(measured, str)
    assert written == json.loads(json.dumps(section))
