"""The commit at scale: loop stall, commit latency and restore at W simulated ranks x P
partitions, on single Redis and on a Redis Cluster (3 masters + 3 replicas), the
per-rank layout (main, session record 4) beside the baseline (record 2: a global
gather of offsets and a manifest holding every rank's record), in the same run: the
inputs of ``docs/SCALING.md``.

One machine cannot run 16,384 ranks whole: each size measures per-rank costs on a
sample of ranks (all P partitions' real data and group in Redis) and composes them;
``bench/_scale_ranks.py``'s docstring gives what is measured and the formulas, and the
output says it again. Per size it prints each cost of both sides (median over rounds,
range), their paired ratio baseline/new, and the fitted exponent of each cost in W
and in P (log-log least squares over the sizes run).

    .venv/bin/python bench/scale.py                                  # small: 1 min
    .venv/bin/python bench/scale.py --ranks 1024,4096,16384 --partitions 16384,65536 \
        --workers 1 --rounds 2      # the big one (docs/SCALING.md): ~40 min on 2 cores;
                                    # one worker so that 16,384 partitions feed 16,384 ranks
    .venv/bin/python bench/scale.py --per-op ...     # the per-operation costs (ingest,
                                                     # reads, memory): bench/_scale_ops.py
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _scale_ops  # noqa: E402
import _scale_ranks as sr  # noqa: E402
import rounds as rd  # noqa: E402

from tests.servers import RedisCluster, RedisServer  # noqa: E402

TARGETS = {"loop stall": 0.2, "restore, same W": 2.0, "manifest bytes": 1e6}
"""Issue #26's targets at 16,384 ranks (seconds, bytes); and the exponent in W of the
per-rank commit work <= 0.1."""


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """The slope of log y on log x (least squares): y ~ x^slope."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    return float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])


COSTS: dict[str, Callable[[dict[str, Any], str], float]] = {
    "loop stall": lambda f, s: f["stall_s"][s]["median"],
    "commit latency": lambda f, s: f["commit_s"][s]["median"],
    "per-rank commit work": lambda f, s: f["rank_work_s"][s]["median"],
    "rank 0's commit work": lambda f, s: f["rank0_work_s"][s]["median"],
    "restore, same W": lambda f, s: f["restore_same"][s]["restore_s"]["median"],
    "manifest bytes": lambda f, s: f["manifest_bytes"][s],
    "bytes a rank reads at restore": lambda f, s: f["restore_same"][s]["bytes_read_per_rank"],
    "Redis CPU per checkpoint": lambda f, s: f["redis_cpu_s"][s]["median"],
}


def exponents(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cost and side, its exponent in W (at each P) and in P (at each W)."""
    out: dict[str, Any] = {"in_W": {}, "in_P": {}}
    for name, cost in COSTS.items():
        for side in ("new", "old"):
            for axis, fixed, moving in (("in_W", "partitions", "world_size"),
                                        ("in_P", "world_size", "partitions")):
                for value in sorted({f[fixed] for f in sizes}):
                    pts = sorted((f[moving], cost(f, side)) for f in sizes if f[fixed] == value)
                    e = exponent([p[0] for p in pts], [p[1] for p in pts])
                    if e is not None:
                        out[axis].setdefault(name, {}).setdefault(side, {})[str(value)] = round(e, 3)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _cell(d: dict[str, Any], scale: float = 1.0, fmt: str = ".3f") -> str:
    return f"{d['median'] * scale:{fmt}} ({d['min'] * scale:{fmt}}-{d['max'] * scale:{fmt}})"


def print_sizes(name: str, fig: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== {name} ({fig['masters']} master{'s' * (fig['masters'] > 1)}): composed from "
          f"{args.sample} sampled ranks per size; seconds, median (range) over {args.rounds} "
          "rounds; ratio = baseline/new per round")
    rows: list[tuple[str, Callable[[dict[str, Any], str], str]]] = [
        ("loop stall s", lambda f, s: _cell(f["stall_s"][s])),
        ("commit latency s", lambda f, s: _cell(f["commit_s"][s])),
        ("per-rank commit work s (ranks > 0)", lambda f, s: _cell(f["rank_work_s"][s])),
        ("rank 0's commit work s", lambda f, s: _cell(f["rank0_work_s"][s])),
        ("rank 0 manifest write s", lambda f, s: _cell(f["manifest_write_s"][s])),
        ("Redis CPU per checkpoint s", lambda f, s: _cell(f["redis_cpu_s"][s])),
        ("restore, same W s", lambda f, s: _cell(f["restore_same"][s]["restore_s"])),
        ("restore, W x 0.75 s", lambda f, s: _cell(f["restore_minus25"][s]["restore_s"])
         if s == "new" else "-"),
        ("restore, W x 1.25 s", lambda f, s: _cell(f["restore_plus25"][s]["restore_s"])
         if s == "new" else "-"),
        ("manifest bytes", lambda f, s: f"{f['manifest_bytes'][s]:,}"),
        ("bytes a rank reads, same W", lambda f, s: f"{f['restore_same'][s]['bytes_read_per_rank']:,}"),
        ("bytes a rank reads, W x 0.75 (objects)", lambda f, s: (
            f"{f['restore_minus25'][s]['bytes_read_per_rank']:,} "
            f"({f['restore_minus25'][s]['objects_read_max']})") if s == "new" else "-"),
        ("bytes a rank reads, W x 1.25 (objects)", lambda f, s: (
            f"{f['restore_plus25'][s]['bytes_read_per_rank']:,} "
            f"({f['restore_plus25'][s]['objects_read_max']})") if s == "new" else "-"),
    ]
    for f in fig["sizes"]:
        print(f"\n{f['world_size']:,} ranks x {f['partitions']:,} partitions "
              f"(sampled ranks {f['sampled_ranks']}; baseline manifest encoded/parsed at "
              f"{f['v2_measured_ranks']:,} ranks, scaled by bytes)")
        print(f"  {'':40s}{'new (main)':>30s}{'baseline (record 2)':>34s}{'ratio':>24s}")
        for label, cell in rows:
            key = {"loop stall s": "stall_s", "commit latency s": "commit_s",
                   "per-rank commit work s (ranks > 0)": "rank_work_s",
                   "Redis CPU per checkpoint s":
                   "redis_cpu_s"}.get(label)
            ratio = _cell(f[key]["ratio"], fmt=".3g") if key else (
                _cell(f["restore_same"]["ratio"], fmt=".3g") if label == "restore, same W s" else "")
            print(f"  {label:40s}{cell(f, 'new'):>30s}{cell(f, 'old'):>34s}{ratio:>24s}")
        # This change's own before/after, in the same rounds (main before it: the fence
        # check on the loop's path; the restore's fences raised by a pass of their own).
        parts, same = f["parts"]["new"], f["restore_same"]
        print(f"  {'loop stall with the fence check s':40s}"
              f"{_cell(parts['stall_with_fence_s']):>30s}   (main before; now in the commit)")
        print(f"  {'restore, same W, fences first s':40s}"
              f"{_cell(same['two_pass']['restore_s']):>30s}   paired before/now "
              f"{_cell(same['ratio_two_pass'], fmt='.3g')}")
        two = same["two_pass"]
        print(f"  {'server us per partition, placement':40s}"
              f"{_cell(same['new']['place_us_per_partition'], fmt='.1f'):>30s}"
              f"   fences first: fence {_cell(two['fencing']['fence_us_per_partition'], fmt='.1f')}"
              f" + placement {_cell(two['place_us_per_partition'], fmt='.1f')}")
    print("\nfitted exponents (log-log least squares): cost ~ W^e at each P, ~ P^e at each W")
    for axis in ("in_W", "in_P"):
        for cost, sides in fig["exponents"][axis].items():
            cells = "  ".join(f"{side} " + ", ".join(f"{k}: {v:+.2f}" for k, v in by.items())
                              for side, by in sides.items())
            print(f"  {axis:5s} {cost:32s} {cells}")


def targets(fig: dict[str, Any]) -> list[str]:
    biggest = max(f["world_size"] for f in fig["sizes"])
    out = []
    for f in (f for f in fig["sizes"] if f["world_size"] == biggest):
        for cost, limit in TARGETS.items():
            v = COSTS[cost](f, "new")
            out.append(f"{cost} at {biggest:,} x {f['partitions']:,}: {v:.4g} "
                       f"(target <= {limit:g}): {'met' if v <= limit else 'MISSED'}")
    for P, e in fig["exponents"]["in_W"].get("per-rank commit work", {}).get("new", {}).items():
        out.append(f"per-rank commit work exponent in W at P={P}: {e:+.3f} (target <= 0.1): "
                   f"{'met' if e <= 0.1 else 'MISSED'}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--per-op" in argv:
        argv.remove("--per-op")
        return _scale_ops.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=_ints, default=[64, 256, 1024],
                    help="simulated world sizes, comma-separated")
    ap.add_argument("--partitions", type=_ints, default=[1024, 4096],
                    help="partition counts, comma-separated (each a dataset in Redis)")
    ap.add_argument("--entries", type=int, default=2, help="records per partition")
    ap.add_argument("--record-bytes", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--sample", type=int, default=4, help="ranks measured per size")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after 1 warm-up)")
    ap.add_argument("--merged", type=int, default=2,
                    help="baseline: gather payloads merged per round (scaled by W / merged)")
    ap.add_argument("--v2-max-ranks", type=int, default=4096,
                    help="baseline: largest version 2 manifest built whole (bigger: by bytes)")
    ap.add_argument("--no-cluster", action="store_true", help="single Redis only")
    ap.add_argument("--no-single", action="store_true",
                    help="the cluster only (e.g. beside a --no-cluster run: two processes)")
    ap.add_argument("--out", help="results file (default: bench/results/<host>-<stamp>.json)")
    args = ap.parse_args(argv)
    sr.init_gloo()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tg-bench-scale-") as tmp:
        made: list[tuple[str, Callable[[], RedisServer | RedisCluster]]] = []
        if not args.no_single:
            made.append(("single", lambda: RedisServer(Path(tmp) / "redis").start()))
        if not args.no_cluster:
            made.append(("cluster", lambda: RedisCluster(Path(tmp) / "cluster").start()))
        for name, start in made:
            target = _scale_ops.Target(name, start())
            try:
                work = Path(tmp) / f"work-{name}"
                work.mkdir()
                figures[name] = sr.measure(target, work, args)
            finally:
                target.stop()
    for name, fig in figures.items():
        fig["exponents"] = exponents(fig["sizes"])
        print_sizes(name, fig, args)
        fig["targets"] = targets(fig)
        print("\ntargets (issue #26), new layout:\n  " + "\n  ".join(fig["targets"]))
    print("\nthe baseline is reproduced, not run: the calls the version 2 commit made "
          "(fence check of all P per rank, gather_offsets of W payloads, rank 0 publishing "
          "all P, a manifest of every offset and every rank's random states), with the real "
          "trainer_client functions; the collectives' transport is in neither side")
    section = {"args": vars(args) | {"out": None}, "targets": figures}
    out = Path(args.out) if args.out else rd.results_path()
    rd.write_section(out, "scale_ranks", section, rd.machine())
    print(f"\nwrote the scale_ranks section of {out}")
    return section


if __name__ == "__main__":
    main()
