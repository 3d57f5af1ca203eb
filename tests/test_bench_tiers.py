"""``bench/tiers.py`` and ``bench/tiers_gpu.py`` at a toy size, so that the figures
of docs/guides/ram-tier.md can be taken again. Checks what the runs did (every tier
restored the state bit for bit, every figure against its baseline, the memory counted
is the copies that exist, the lost-work arithmetic is the advisor's), never how long
anything took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import _tiers_lost as lost  # noqa: E402
import tiers  # noqa: E402
import tiers_gpu  # noqa: E402

from checkpoint_store.node_tiers import TierIntervals  # noqa: E402
from checkpoint_store.ram_tier import memory_backed  # noqa: E402
from trainguard.core.interval import lost_work  # noqa: E402
from trainguard.core.multilevel import Level  # noqa: E402

pytestmark = pytest.mark.skipif(memory_backed("/dev/shm") is None,
                                reason="/dev/shm is not a memory-backed file system here")

RESTORES = ("RAM restore", "partner restore", "local disk restore (warm cache)",
            "remote restore (moto S3)")


@pytest.mark.slow
def test_tiers_bench_reports_every_figure_against_its_baseline(tmp_path: Path) -> None:
    """One run: the async RAM save's stall against a host copy; the restores from RAM,
    a partner, disk and remote (each checked bit for bit inside the run); partner
    against remote with its target; peak memory whose tier bytes are exactly one copy
    of the state on each side (plus manifest and metadata); the lost-work table of the
    advisor's intervals against one interval; all of it in the results file."""
    out = tmp_path / "results.json"
    section = tiers.main(["--size-mib", "2", "--rounds", "1", "--dir", str(tmp_path),
                          "--json", str(out)])
    assert json.loads(out.read_text())["benches"]["tiers"]["ratios"] == section["ratios"]
    rows = section["rows"]
    for name in (*RESTORES, "RAM tier save (committed)", "partner copy (one partner)",
                 "local disk save (fsync'd)", "remote save (moto S3)"):
        assert len(rows[name]["wall_s"]) == 1, name
    for name in ("RAM tier async save (loop stall)",
                 "RAM tier async save into new pages (loop stall)",
                 "host copy into buffers allocated once"):  # milliseconds: more rounds
        assert len(rows[name]["wall_s"]) == tiers.stall_rounds(1) == section["stall_rounds"]
    ratios = section["ratios"]
    assert ratios["async RAM save stall / host copy (time)"]["target"] == "<= 1.2x"
    assert ratios["partner restore speed / remote (moto S3)"]["target"] == ">= 5x"
    state = section["state_bytes"]
    assert state == 2 << 20
    for peak in section["peak_memory"]:
        assert peak["saves"] == 3
        assert peak["added_bytes"] == peak["process_extra_bytes"] + peak["peak_tiers_bytes"]
        if peak["config"] != "bounded":
            continue
        # Bounded tiers hold one checkpoint each, at the end and at every sample on the
        # way: the state's bytes and its manifest and array metadata (a few KiB).
        for key in ("own_tier_bytes", "partner_copy_bytes"):
            assert state <= peak[key] < state + (64 << 10), (peak["mode"], key, peak[key])
        assert 2 * state <= peak["peak_tiers_bytes"] < 2 * state + (128 << 10), peak
    assert {(p["config"], p["mode"]) for p in section["peak_memory"]} == {
        (c, m) for c in ("bounded", "default") for m in ("blocking", "async")}
    # Lost work: the advisor's intervals for the measured costs, and each failure's
    # loss is lost_work() at the period of the tier that serves it.
    work = section["lost_work"]
    med = {name: rows[name]["median_s"] for name in rows}
    measured = {"stall_s": med["RAM tier async save (loop stall)"],
                "ram_s": med["RAM tier save (committed)"],
                "partner_s": med["partner copy (one partner)"],
                "disk_s": med["local disk save (fsync'd)"],
                "remote_s": med["remote save (moto S3)"]}
    # (the rows are rounded to 10 us in the results file)
    assert work["costs"] == pytest.approx(measured, abs=1e-5)
    assert work == lost.compare(lost.TierCosts(**work["costs"]), step_s=1.0)


@pytest.mark.slow
def test_tiers_bench_restore_only_runs_the_restore_group_alone(tmp_path: Path) -> None:
    """``--restore-only``: the four restores (each checked bit for bit inside the run)
    and their ratios, partner against remote with its target, in a section of its
    own; no other group runs."""
    out = tmp_path / "results.json"
    section = tiers.main(["--size-mib", "2", "--rounds", "1", "--dir", str(tmp_path),
                          "--json", str(out), "--restore-only"])
    benches = json.loads(out.read_text())["benches"]
    assert "tiers" not in benches
    assert benches["tiers_restore"]["ratios"] == section["ratios"]
    assert sorted(section["rows"]) == sorted(RESTORES)
    assert all(len(row["wall_s"]) == 1 for row in section["rows"].values())
    assert section["ratios"]["partner restore speed / remote (moto S3)"]["target"] == ">= 5x"
    assert "peak_memory" not in section and "lost_work" not in section


def test_tiers_bench_stall_only_runs_the_stall_group_alone(tmp_path: Path) -> None:
    """``--stall-only``: the async save with ``overwrite_oldest``, the same save into
    new pages, the host copy and ``clone()``, and their ratios (the first against the
    host copy with its target), in a section of its own; no other group runs."""
    out = tmp_path / "results.json"
    section = tiers.main(["--size-mib", "2", "--rounds", "1", "--dir", str(tmp_path),
                          "--json", str(out), "--stall-only"])
    benches = json.loads(out.read_text())["benches"]
    assert "tiers" not in benches and benches["tiers_stall"]["ratios"] == section["ratios"]
    assert sorted(section["rows"]) == sorted([
        "RAM tier async save (loop stall)", "RAM tier async save into new pages (loop stall)",
        "host copy into buffers allocated once", "host clone()"])
    assert section["ratios"]["async RAM save stall / host copy (time)"]["target"] == "<= 1.2x"


def test_lost_work_is_the_advisors_intervals_against_one_daly_interval() -> None:
    """The arithmetic, on known costs: the periods are TierIntervals.auto's, a
    failure needing tier i loses lost_work(T_i, stall, lag_i), today's interval is
    Daly's for the disk save plus its upload, and the expectation weights each kind
    by its stated rate."""
    costs = lost.TierCosts(stall_s=0.05, ram_s=0.3, partner_s=1.5, disk_s=1.0, remote_s=4.0)
    doc = lost.compare(costs, step_s=1.0)
    rates = {f.tier: f.rate_per_s for f in lost.FAILURES}
    ram_every, iv = TierIntervals.auto(
        step_s=1.0, ram=Level("ram", 0.3, rates["ram"]),
        partner=Level("partner", 1.5, rates["partner"]), disk=Level("disk", 1.0, rates["disk"]),
        remote=Level("remote", 4.0, rates["remote"]))
    adv = doc["advisor"]
    assert (adv["ram_every_steps"], adv["partner_every"], adv["disk_every"],
            adv["remote_every"]) == (ram_every, iv.partner_every, iv.disk_every, iv.remote_every)
    crash = lost.FAILURES[0].kind
    assert doc["lost_s_per_kind"]["multilevel"][crash] == lost_work(ram_every * 1.0, 0.05, 0.3)
    node = lost.FAILURES[1].kind
    assert doc["lost_s_per_kind"]["multilevel"][node] == lost_work(
        ram_every * iv.partner_every, 0.05, 0.3 + 1.5)
    tau = doc["today"]["interval_s"]
    assert doc["lost_s_per_kind"]["today"][node] == lost_work(tau, 0.05, 1.0 + 4.0)
    total = sum(f.rate_per_s for f in lost.FAILURES)
    expect = sum(f.rate_per_s * doc["lost_s_per_kind"]["today"][f.kind]
                 for f in lost.FAILURES) / total
    assert doc["lost_s_per_failure"]["today"] == pytest.approx(expect)


def test_tiers_gpu_check_on_cpu_state_holds_the_snapshot_in_one_buffer(
        capsys: pytest.CaptureFixture[str]) -> None:
    """gpu-check's RAM-tier step on the CPU path: the state changed right after
    save(blocking=False) returns is saved as it was, the restore is bitwise, and no
    save of the rounds allocated a staging buffer (CPU state stages into the tier's
    files)."""
    assert tiers_gpu.main(["--device", "cpu", "--size-mib", "2", "--rounds", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(tiers_gpu.PREFIX)]
    assert "snapshot held, restored bit for bit" in lines[0]
    assert "no staging buffer (staged in the tier's files) over 3 saves" in lines[0]
    assert "target <= 1.2x" in lines[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_tiers_gpu_check_skips_with_one_clear_line_without_cuda(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without a CUDA device the GPU step says it checked nothing, and passes."""
    assert tiers_gpu.main(["--device", "cuda"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{tiers_gpu.PREFIX} SKIP: torch {torch.__version__} sees no CUDA device; "
                   "the RAM tier's GPU path (pinned staging) was not checked"]
