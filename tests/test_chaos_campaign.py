"""The chaos campaign (bench/chaos.py), small: every fault class it injects, once, on a
real 3-node elastic job (torchrun agents, the trainguard rendezvous, a real
redis-server, real checkpoints on disk). Long (minutes): ``-m chaos`` only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402


@pytest.mark.chaos
@pytest.mark.timeout(2400)  # each class once: ~10 min on a quiet 2-core machine
def test_every_fault_class_is_healed_with_no_human_and_no_record_lost_or_trained_twice(
        tmp_path: Path) -> None:
    """Each injected class once (seeded moments): every one handled with no human (the
    job trained again and finished, or for the restart loop the breaker stopped it with
    exit 87), 0 records lost, 0 trained twice, in the ledger of each class's final
    checkpoint; the classes the campaign cannot inject are in the table with a reason,
    not dropped."""
    results = tmp_path / "chaos.json"
    code = chaos.main(["--reps", "1", "--gap-s", "5", "--seed", "1", "--results", str(results)])
    rows = {r["class"]: r for r in json.loads(results.read_text())["benches"]["chaos"]["rows"]}
    ran = [*chaos.CLASSES, "node_rejoin"]
    assert {c: (rows[c]["injected"], rows[c]["handled"], rows[c]["lost"], rows[c]["duplicated"])
            for c in ran} == {c: (1, True, 0, 0) for c in ran}
    assert all(rows[c]["injected"] == 0 and rows[c]["why"] for c in chaos.NOT_RUN)
    assert code == 0
