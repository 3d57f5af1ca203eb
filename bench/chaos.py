"""The chaos campaign: a 3-node elastic job on this machine, faults injected at random
(seeded) moments, each class ``--reps`` times; the verdict is the per-record ledger.

    python bench/chaos.py [--reps 2] [--gap-s 30] [--seed 0] [--classes a,b,...] [--warm|--cold]

Each class runs one job: 3 torchrun agents (``--rdzv-backend=trainguard`` against a
fresh redis-server, gloo, ``--nproc-per-node=1``) training the ledger job of
tests/_heal_job.py (its ``counts`` buffer adds 1 per record per step, so the final
checkpoint says how often each record was trained). The stream is topped up ahead of
the job while it runs and finished after the last fault, so the job never ends before
the faults are done and never waits for data (a wait would be a stall to the
watchdog). Before the classes, a fault-free job of the same shape measures the
records/s that goodput is divided by, in the same run; with ``--paired-baseline``, a
fault-free job right before each class, on that class's Redis and store (S3, a Redis
Cluster, AOF), is the class's own.

A fault is injected ``gap_s x U(0.5, 1.5)`` after the job trained again. Classes
(what is injected; how the job is expected to heal):

- ``worker_kill``: kill -9 of a random node's worker; its agent restarts the group.
- ``node_kill``: kill -9 of a node (agent and worker; the first rep kills the node of
  rank 0); the others re-form without it. Then ``node_rejoin``: the node is started
  again and admitted at the next round.
- ``hang``: SIGSTOP of a worker; the peers' watchdog kills it and exits 86.
- ``loss_spike``: the job's loss x50 (odd reps: NaN) at a step a few ahead, through
  the job's ``--spike-file``; the spike guard rolls every rank back together (time to
  the next step: from the step before the spike).
- ``corrupt_chunk``: a chunk file of the newest checkpoint overwritten, then a worker
  killed so the group restores: the restore falls back to an intact checkpoint.
- ``redis_restart``: kill -9 of redis-server (AOF, fsync always) and a restart on the
  same port.
- ``cluster_master_kill``: the job on a Redis Cluster (3 masters, a replica each);
  kill -9 of the master of the rendezvous' slot (odd reps: of a partition's), once
  the replicas have the stream; its replica takes over, the node comes back as a
  replica.
- ``s3_outage``: the checkpoints on moto's S3 server behind a TCP proxy; the proxy
  stopped for ``S3_OUTAGE_S`` (connections refused and cut), then started: saves
  retry through it (time to the next step: from the endpoint's return).
- ``gpu_critical``: a node's (fake NVML) GPU reports an uncorrected ECC error a few
  steps ahead: every rank checkpoints at one step boundary, the bad node quarantines
  itself and its agent leaves, the others re-form without it; the bad node started
  again is refused by the rendezvous; a healthy replacement node then joins.
- ``crash_loop``: a job whose code raises at one step in every attempt: the breaker
  tries its remedies and stops it with exit 87 (handled = stopped that way, every
  agent exiting on the job stop instead of restarting, with a restart_loop incident; its ledger must hold no record twice and none lost up to the
  newest checkpoint).
- ``full_local_tier``: one process (the tiered store is single-process, so not the
  3-node job) trains with a ``TieredCheckpointStore`` whose local tier is a 1 MiB
  tmpfs filled to ENOSPC (``unshare -Urm``), killed hard after step 7 and started
  again: its saves go to the remote tier only and the restart restores from there
  (``bench/_chaos_full_tier.py``; time to the next step: from the kill). Not counted
  in goodput.

``--warm``: every worker starts through ``trainguard.elastic.warm`` (forked by its
node's zygote, which imported torch once) instead of as a fresh process (``--cold``,
the default, torchrun's way).

Classes this campaign does not inject (yet) are listed in the table as not run, with
the reason (``NOT_RUN``). Prints the table, exactly-once goodput and each incident's
time-to-next-step breakdown from the run's incidents; writes a ``chaos`` section into
``rounds.results_path()``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _chaos_job as cj  # noqa: E402
import rounds as rd  # noqa: E402
from _chaos_full_tier import full_local_tier  # noqa: E402

from trainguard.core import streams  # noqa: E402
from trainguard.elastic import keys as elastic_keys  # noqa: E402

CLASSES = ("worker_kill", "node_kill", "hang", "loss_spike", "corrupt_chunk",
           "redis_restart", "cluster_master_kill", "s3_outage", "gpu_critical", "crash_loop",
           "full_local_tier")
ROWS = (*CLASSES[:2], "node_rejoin", *CLASSES[2:])
S3_OUTAGE_S = 8.0  # how long the S3 endpoint is gone
NOT_RUN: dict[str, str] = {}  # classes listed but not run, with the reason


def _resume_s(job: cj.Job, live: list[cj.Agent], after: float, via: str) -> float | None:
    """Seconds from ``after`` to the first step trained once the job healed: for
    ``via`` READY or ROLLBACK, after every live node said so (past ``after``); for
    STEP, the first step past ``after``."""
    t = job.resumed(live, after, via)
    return None if t is None else t - after


def _inject(job: cj.Job, cls: str, rep: int, rng: random.Random) -> list[dict[str, Any]]:
    """One fault of class ``cls``; the events it gave (two for a node: kill, rejoin)."""
    live = job.live
    at = time.time()
    if cls in ("worker_kill", "hang", "corrupt_chunk"):
        victim = rng.choice(live)
        if cls == "corrupt_chunk":
            job.corrupt_newest_chunk()
        job.signal_worker(victim, signal.SIGSTOP if cls == "hang" else signal.SIGKILL)
        return [{"class": cls, "resume_s": _resume_s(job, live, at, "READY")}]
    if cls == "loss_spike":
        step = job.max_step() + rng.randint(3, 6)
        job.spike(step, "nan" if rep % 2 else "x50")
        resumed = job.resumed(live, at, "ROLLBACK")
        if resumed is None:
            return [{"class": cls, "resume_s": None}]
        # From the step before the spike (the job waited for the spike's step first).
        first = min(t for a in live for t, _ in a.seen(": ROLLBACK ") if t > at)
        began = max((t for t, _ in job.steps() if t < first), default=at)
        return [{"class": cls, "resume_s": resumed - began}]
    if cls in ("redis_restart", "cluster_master_kill", "s3_outage"):
        if cls == "redis_restart":
            job.restart_redis()
        elif cls == "s3_outage":  # from the endpoint's return: the outage is not the job's
            assert job.proxy is not None
            job.proxy.stop()
            time.sleep(S3_OUTAGE_S)
            job.proxy.start()
            at = time.time()
        else:  # first the master of the rendezvous' slot, then one of a partition's
            key = (elastic_keys.state_key(job.run_id) if rep % 2 == 0 else
                   streams.partition_key("heal", rng.randrange(cj.P)))
            at = job.kill_master(key)
        got = _resume_s(job, live, at, "STEP")
        time.sleep(5.0)  # did the outage make the group restart? then that is the resume
        if job.readies_after(live, at):
            got = _resume_s(job, live, at, "READY")
        return [{"class": cls, "resume_s": got}]
    if cls == "gpu_critical":
        return [_gpu_critical(job, rep, rng)]
    assert cls == "node_kill"
    victim = job.rank0() if rep == 0 else rng.choice(live)
    victim.kill()
    job.live.remove(victim)
    events = [{"class": cls, "resume_s": _resume_s(job, job.live, at, "READY"),
               "first_node": rep == 0}]
    back_at = time.time()
    job.start_agent(f"{victim.name}-r{rep}")
    events.append({"class": "node_rejoin",
                   "resume_s": _resume_s(job, job.live, back_at, "READY")})
    return events


def _gpu_critical(job: cj.Job, rep: int, rng: random.Random) -> dict[str, Any]:
    """A node's GPU turns CRITICAL a few steps ahead. Handled when every rank
    checkpointed together (``CRITICAL`` on every node, at one step), the bad node's
    agent left with its quarantine record written, the others trained again without
    it, and the bad node started again is refused by the rendezvous (its agent exits,
    saying why). Then a healthy replacement node joins, so each rep starts at full
    size. Time to the next step: from the CRITICAL verdict."""
    victim = rng.choice(job.live)
    at = time.time()
    job.gpu_critical(victim, job.max_step() + rng.randint(3, 6))
    job.live.remove(victim)
    resumed = job.resumed(job.live, at, "READY")
    try:
        left = victim.wait(cj.RESUME_TIMEOUT_S)
    except AssertionError:
        left = None
    said = [(t, x) for a in job.every for t, x in a.seen(": CRITICAL ") if t > at]
    steps = sorted({x.rsplit(" ", 1)[1] for _, x in said})
    quarantined = victim.name in job.quarantined()
    again = job.start_agent(f"{victim.name}-again{rep}", node=victim.name, live=False)
    try:
        refused = again.wait(cj.RESUME_TIMEOUT_S) != 0 and bool(again.seen("may not join"))
    except AssertionError:
        refused = False
    back_at = time.time()
    job.start_agent(f"{victim.name}-new{rep}")
    replaced = job.resumed(job.live, back_at, "READY")
    handled = (resumed is not None and left not in (None, 0) and quarantined
               and len(steps) == 1 and len(said) == cj.NODES and refused
               and replaced is not None)
    first = min((t for t, _ in said), default=at)
    return {"class": "gpu_critical", "resume_s": None if resumed is None else resumed - first,
            "node": victim.name, "agent_exit": left, "critical_steps": steps,
            "quarantined": quarantined, "refused_again": refused,
            "replaced_s": None if replaced is None else replaced - back_at, "handled": handled}


UNCOUNTED = ("crash_loop", "full_local_tier")
"""Classes outside goodput: the crash loop is stopped by design, and full_local_tier
runs a one-process job of its own."""


def run_class(cls: str, work: Path, args: argparse.Namespace, rng: random.Random
              ) -> dict[str, Any]:
    if cls == "crash_loop":
        return cj.crash_loop(work, args.reps, warm=args.warm)
    if cls == "full_local_tier":
        return full_local_tier(work, args.reps)
    job = cj.Job(work, cls, reps=args.reps, gap_s=args.gap_s, warm=args.warm, **_shape(cls))
    events: list[dict[str, Any]] = []
    try:
        job.wait_trained(min_step=cj.FIRST_CKPT + 1)
        for rep in range(args.reps):
            time.sleep(args.gap_s * rng.uniform(0.5, 1.5))
            got = _inject(job, cls, rep, rng)
            events += got
            print(f"  {cls} rep {rep}: " + ", ".join(
                f"{e['class']} next step after {_fmt(e['resume_s'])} s" for e in got),
                flush=True)
            if any(e["resume_s"] is None for e in got):
                break
        verdict = job.finish()
    finally:
        job.close()
    return {**verdict, "events": events}


def _shape(cls: str) -> dict[str, Any]:
    """What the job of ``cls`` runs on besides the default (one Redis, local disk): its
    paired baseline runs on the same (a job on moto's S3 or a Redis Cluster trains
    slower than one on local disk and one Redis, which is no fault's cost)."""
    return {"persistence": "always" if cls == "redis_restart" else "none",
            "cluster": cls == "cluster_master_kill", "s3": cls == "s3_outage"}


def _row(name: str, runs: dict[str, dict[str, Any]], reps: int) -> dict[str, Any]:
    if name in NOT_RUN:
        return {"class": name, "injected": 0, "handled": None, "why": NOT_RUN[name]}
    owner = "node_kill" if name == "node_rejoin" else name
    run = runs.get(owner)
    if run is None:
        return {"class": name, "injected": 0, "handled": None, "why": "not selected"}
    if name == "crash_loop":
        return {"class": name, "injected": 1, "handled": run["handled"], "resume_median_s": None,
                "resume_max_s": None, "lost": run["lost"], "duplicated": run["duplicated"]}
    times = [e["resume_s"] for e in run["events"] if e["class"] == name]
    ok = [t for t in times if t is not None]
    verdicts = all(e.get("handled", True) for e in run["events"] if e["class"] == name)
    return {"class": name, "injected": len(times),
            "handled": run["finished"] and verdicts and len(ok) == len(times) == reps,
            "resume_median_s": round(statistics.median(ok), 1) if ok else None,
            "resume_max_s": round(max(ok), 1) if ok else None,
            "lost": run["lost"], "duplicated": run["duplicated"]}


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'fault class':20s} {'injected':>8s} {'no human':>8s} {'next step med':>13s} "
          f"{'max':>6s} {'lost':>5s} {'dup':>5s}")
    for r in rows:
        handled = "n/a" if r["handled"] is None else ("yes" if r["handled"] else "NO")
        line = (f"{r['class']:20s} {r['injected']:8d} {handled:>8s} "
                f"{_fmt(r.get('resume_median_s')):>13s} {_fmt(r.get('resume_max_s')):>6s} "
                f"{_fmt(r.get('lost')):>5s} {_fmt(r.get('duplicated')):>5s}")
        print(line + (f"  ({r['why']})" if "why" in r else ""))


def print_incidents(runs: dict[str, dict[str, Any]]) -> None:
    print("incidents (time to the next step by phase, s, from the run's incident records):")
    for cls, run in runs.items():
        for i in run.get("incidents", []):
            rec = i.get("recovery") or {}
            phases = rec.get("phases_s") or {}
            print(f"  {cls:14s} attempt {i.get('attempt')} {i.get('cause')} by "
                  f"{i.get('detected_by')}: total {_fmt(rec.get('to_first_step_s'))}  " +
                  "  ".join(f"{k} {_fmt(v)}" for k, v in phases.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="faults per class")
    ap.add_argument("--gap-s", type=float, default=30.0,
                    help="mean seconds of training between faults (uniform 0.5x to 1.5x)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help=f"comma-separated subset of {','.join(CLASSES)}")
    ap.add_argument("--results", default="", help="results file (default: bench/results/)")
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--warm", dest="warm", action="store_true",
                       help="workers start through trainguard.elastic.warm (forked by "
                       "each node's zygote)")
    start.add_argument("--cold", dest="warm", action="store_false",
                       help="workers start as fresh processes, torchrun's way (default)")
    ap.add_argument("--paired-baseline", action="store_true",
                    help="a fault-free job right before each class's job, on the same "
                    "Redis and store, its rate that class's baseline (goodput then compares "
                    "like with like on a machine whose load drifts); default: one "
                    "fault-free job at the start")
    args = ap.parse_args(argv)
    chosen = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CLASSES))
    if unknown:
        ap.error(f"unknown classes {unknown}: expected some of {list(CLASSES)}")
    rng = random.Random(args.seed)
    started, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="chaos-base-") as work:
        rate = cj.fault_free_rate(Path(work), warm=args.warm)
    print(f"fault-free: {rate:.1f} records/s ({'warm' if args.warm else 'cold'} starts)",
          flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for cls in chosen:
        print(f"{cls}:", flush=True)
        if args.paired_baseline and cls not in UNCOUNTED:
            with tempfile.TemporaryDirectory(prefix="chaos-base-") as work:
                base = cj.fault_free_rate(Path(work), warm=args.warm, **_shape(cls))
            print(f"  fault-free just before: {base:.1f} records/s", flush=True)
        else:
            base = rate
        with tempfile.TemporaryDirectory(prefix=f"chaos-{cls}-") as work:
            runs[cls] = {**run_class(cls, Path(work), args, rng), "baseline_records_s": base}
    rows = [_row(name, runs, args.reps) for name in (*ROWS, *NOT_RUN)]
    # Goodput is the 3-node job's: full_local_tier runs a one-process job of its own.
    trained = {c: r for c, r in runs.items() if c not in UNCOUNTED}
    once = sum(r["once"] for r in trained.values())
    wall = sum(r["wall_s"] for r in trained.values())
    expected = sum(r["baseline_records_s"] * r["wall_s"] for r in trained.values())
    goodput = once / expected if expected else None
    print_table(rows)
    print(f"exactly-once goodput: {'-' if goodput is None else f'{goodput:.2f}'} ({once} "
          f"records trained exactly once in {wall:.0f} s of job wall time, against "
          + (f"a fault-free job before each class: {expected:.0f} records" if
             args.paired_baseline else f"fault-free {rate:.1f} records/s")
          + f"); loadavg at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    print("  per class: " + ", ".join(
        f"{c} {r['once'] / (r['baseline_records_s'] * r['wall_s']):.2f}"
        for c, r in trained.items() if r["wall_s"]))
    print_incidents(runs)
    doc = {"seed": args.seed, "reps": args.reps, "gap_s": args.gap_s, "warm": args.warm,
           "rows": rows,
           "goodput": goodput, "fault_free_records_s": rate,
           "paired_baseline": args.paired_baseline, "wall_s": time.time() - started,
           "loadavg_at_start": list(load), "runs": runs}
    path = Path(args.results) if args.results else rd.results_path()
    rd.write_section(path, "chaos", doc)
    print(f"results: {path}")
    return 0 if all(r["handled"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
