"""The chaos campaign (bench/chaos.py), small: each fault class injected into a real
3-node elastic job on this machine, and the verdict read from the final checkpoint's
per-record ledger.

Real parts: three torchrun agents on the trainguard rendezvous, a real redis-server
(or a real Redis Cluster), real checkpoints on disk (and on moto's S3 server behind a
real TCP proxy), real kill -9 and SIGSTOP; the one fake is NVML (no GPU here). Runs
under ``-m chaos`` (``make chaos``): minutes per class on this machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("cls", chaos.CLASSES)
def test_each_fault_class_heals_with_no_human_and_trains_every_record_once(
    cls: str, tmp_path: Path
) -> None:
    """One fault of class ``cls`` at a random (seeded) moment of a 3-node job (node
    kill: the node of rank 0, then that node rejoining): the job trains again after
    it and finishes on every live node with exit 0, without anyone stepping in, and
    the final checkpoint's ledger holds every record the stream was given exactly
    once: 0 lost, 0 duplicated. For ``crash_loop`` (a bug at one step in every
    attempt) the breaker stops the job with exit 87 and a ``restart_loop`` incident,
    and the newest checkpoint holds every record of its steps exactly once."""
    args = argparse.Namespace(reps=1, gap_s=10.0, seed=0, warm=False)
    run = chaos.run_class(cls, tmp_path, args, random.Random(0))
    summary = {k: v for k, v in run.items() if k != "incidents"}
    assert run["finished"], summary
    assert run["lost"] == 0, summary
    assert run["duplicated"] == 0, summary
    if cls == "crash_loop":
        assert run["handled"], summary
        return
    # Every fault was injected and the job trained again after each one.
    rows = {name: chaos._row(name, {cls: run}, args.reps) for name in chaos.ROWS}
    expected = ("node_kill", "node_rejoin") if cls == "node_kill" else (cls,)
    for name in expected:
        assert rows[name]["injected"] == 1 and rows[name]["handled"], rows[name]
    assert run["once"] == run["records"] > 0, summary
