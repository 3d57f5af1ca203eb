"""Node loss to the next training step: the trainguard rendezvous against torch's c10d.

    python bench/rdzv_recovery.py [--rounds 3] [--nodes 3] [--warm|--cold]
    python bench/rdzv_recovery.py --warm-vs-cold [--rounds 3] [--nodes 3]

Each round runs, in alternating order, one job per backend: ``--nodes`` torchrun
agents on this machine (``--nproc-per-node=1``, gloo, ``--max-restarts=3``), each
training the ledger job (tests/_client_train.py, through bench/_rdzv_job.py, which
prints when its process was created and when its imports were done) against a fresh
redis-server. Once the job has committed a checkpoint, the node whose worker has
the highest rank that does not serve c10d's TCPStore (found by its listening port)
is killed (kill -9 of the agent and its worker), so c10d can survive the kill;
killing the store's node ends a c10d job, which this bench reports once per round as
``c10d-first`` when ``--c10d-first`` is given. torch's backend runs with its
defaults, as users meet it; trainguard's with its own defaults.

The time from the kill to the first step a survivor trains after it is split, from
what the agents and workers print (read-time stamps of each line, wall clock):

- detect: kill to the first survivor agent's "Worker group FAILED" (its worker's
  next collective failed);
- rendezvous: to the last survivor's last "Rendezvous complete" before training
  resumed (an attempt whose workers failed to start counts here: c10d's first
  attempt after a kill often does; ``rendezvous_rounds`` counts them);
- process start: to the newest worker's process creation (from /proc);
- imports: to the newest worker's imports done (torch, trainer_client,
  checkpoint_store);
- init + restore: to the last survivor's READY (process group, session, restore);
- first step: to the first STEP line after that.

Prints the per-round table, the median of the per-round ratios c10d / trainguard
with its range, and merges an ``rdzv_recovery`` section into the results file of
``rounds.results_path()``. ``--warm``: both backends' workers start through
``trainguard.elastic.warm`` (forked by each node's zygote), ``--cold`` (default) as
fresh processes.

``--warm-vs-cold``: the trainguard backend only, each round one job with cold worker
starts and one with warm ones, in alternating order; prints the median of the
per-round ratios cold / warm with its range and merges an ``rdzv_recovery_warm``
section. Warm, "imports" ends at the fork (the zygote imported before), so the phase
holds the wrapper's own start and the fork.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402

from tests import _client_fill as cf  # noqa: E402
from tests._elastic_agents import Agent, agent_command, wait_for  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402

N, P = 6000, 6
PHASES = ("detect", "rendezvous", "process start", "imports", "init + restore", "first step")


def _job_args(url: str, store: str) -> list[str]:
    return ["--redis", url, "--dataset", "b", "--run", "exp", "--store", store,
            "--n", str(N), "--batch-size", "4", "--ckpt-every", "4", "--sleep-ms", "50"]


def _first(agent: Agent, needle: str, after: float) -> float | None:
    return next((t for t, x in agent.seen(needle) if t >= after), None)


def _store_host(agents: list[Agent], endpoint: str) -> Agent | None:
    """The agent serving c10d's TCPStore: the one listening on the endpoint's port
    (every agent here may host it: they all run on the endpoint's machine)."""
    port = endpoint.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True,
                         text=True).stdout
    pids = {int(p) for p in re.findall(r"pid=(\d+)", out)}
    return next((a for a in agents if a.proc.pid in pids), None)


def _why(agents: list[Agent]) -> str:
    """What the survivors last said that looks like a reason."""
    lines = [x for a in agents for _, x in a.lines
             if "Error" in x or "FAILED" in x or "timed out" in x]
    return " | ".join(x[:200] for x in lines[-3:])


def _last(agent: Agent, needle: str, before: float) -> float:
    return max(t for t, _ in agent.seen(needle) if t <= before)


def _last_value(agent: Agent, prefix: str, before: float) -> float:
    return max(float(x.rsplit(" ", 1)[1]) for t, x in agent.seen(prefix) if t <= before)


def one_job(backend: str, work: Path, nodes: int, kill_first: bool = False, *,
            warm: bool = False) -> dict[str, Any]:
    redis = RedisServer(work / "redis").start()
    agents: list[Agent] = []
    try:
        url = redis.url
        cf.fill(url, cf.create(url, "b", partitions=P), N)
        endpoint = url if backend == "trainguard" else f"127.0.0.1:{free_port()}"
        command = agent_command(
            backend, endpoint, f"bench-{backend}-{time.time_ns()}", f"1:{nodes}",
            _job_args(url, f"file://{work}/ckpt"), conf=None,
            entry=(str(ROOT / "bench" / "_rdzv_job.py"),), warm=warm)
        agents = [Agent(f"n{i}", command, work / f"{backend}-n{i}.log",
                        env={"TRAINGUARD_WARM_DIR": str(work / "warm")}) for i in range(nodes)]
        wait_for(agents, "COMMITTED", timeout_s=300)
        host = _store_host(agents, endpoint) if backend == "c10d" else None
        by_rank = sorted((a for a in agents if a is not host),
                         key=lambda a: int(a.seen(": READY")[0][1].split(":")[0]))
        victim = host if kill_first and host is not None else (
            by_rank[0] if kill_first else by_rank[-1])
        killed_at = time.time()
        victim.kill()
        rest = [a for a in agents if a is not victim]
        try:
            wait_for(rest, "READY", count=2 * len(rest), timeout_s=240)
        except AssertionError:
            return {"recovered": False, "why": _why(rest)}
        ready_at = max(t for a in rest for t, _ in a.seen("READY")[1:2])
        deadline = time.monotonic() + 120
        while not any(_first(a, "STEP", ready_at) for a in rest):
            if time.monotonic() > deadline:
                return {"recovered": False}
            time.sleep(0.05)
        failed = min(t for a in rest if (t := _first(a, "Worker group FAILED", killed_at)))
        # The last attempt is the one that trained: c10d's first attempt after a kill
        # may fail (its workers time out connecting) and be followed by another, so
        # each phase ends at its last mark before the READY that counted.
        formed = max(_last(a, "Rendezvous complete", ready_at) for a in rest)
        started = max(_last_value(a, " START ", ready_at) for a in rest)
        imported = max(_last_value(a, " IMPORTED ", ready_at) for a in rest)
        step = min(t for a in rest if (t := _first(a, "STEP", ready_at)))
        attempts = max(sum(1 for t, _ in a.seen("Rendezvous complete") if t > failed)
                       for a in rest)
        marks = [killed_at, failed, formed, started, imported, ready_at, step]
        phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
        return {"recovered": True, "total_s": step - killed_at, "phases_s": phases,
                "rendezvous_rounds": attempts}
    finally:
        for a in agents:
            a.close()
        redis.kill()


def _line(r: int, name: str, got: dict[str, Any]) -> str:
    return f"round {r} {name:10s} " + (
        f"{got['total_s']:6.1f} s  " + "  ".join(f"{k} {v:.1f}" for k, v in got["phases_s"].items())
        if got["recovered"] else f"did not recover: {got.get('why')}")


def _medians(doc: dict[str, Any], results: dict[str, list[dict[str, Any]]]) -> None:
    for name, runs in results.items():
        ok = [x for x in runs if x["recovered"]]
        if ok:
            med = statistics.median(x["total_s"] for x in ok)
            split = {p: round(statistics.median(x["phases_s"][p] for x in ok), 2)
                     for p in PHASES}
            doc[f"{name}_median_s"] = round(med, 2)
            doc[f"{name}_phases_median_s"] = split
            print(f"{name:10s} median {med:6.1f} s  " +
                  "  ".join(f"{k} {v}" for k, v in split.items()))


def warm_vs_cold(rounds: int, nodes: int) -> int:
    """The trainguard backend, cold and warm worker starts interleaved."""
    load = os.getloadavg()
    results: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for r in range(rounds):
        for name in (["cold", "warm"] if r % 2 == 0 else ["warm", "cold"]):
            with tempfile.TemporaryDirectory(prefix=f"rdzv-{name}-") as work:
                got = one_job("trainguard", Path(work), nodes, warm=name == "warm")
            results[name].append(got)
            print(_line(r, name, got), flush=True)
    pairs = [(c, w) for c, w in zip(results["cold"], results["warm"])
             if c["recovered"] and w["recovered"]]
    doc: dict[str, Any] = {"nodes": nodes, "rounds": results, "loadavg_at_start": list(load),
                           "loadavg_at_end": list(os.getloadavg())}
    if pairs:
        ratio = rd.Ratio("node kill to next step: cold / warm worker starts (time)",
                         [c["total_s"] / w["total_s"] for c, w in pairs],
                         target="warm <= 15 s median")
        doc["ratio"] = ratio.doc()
        _medians(doc, results)
        rd.print_headlines([ratio])
    print(f"loadavg at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    rd.write_section(rd.results_path(), "rdzv_recovery_warm", doc)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--c10d-first", action="store_true",
                    help="also kill c10d's first node once per round (the job is expected to stop)")
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--warm", dest="warm", action="store_true",
                       help="workers start through trainguard.elastic.warm")
    start.add_argument("--cold", dest="warm", action="store_false",
                       help="workers start as fresh processes (default)")
    start.add_argument("--warm-vs-cold", action="store_true",
                       help="the trainguard backend, cold against warm worker starts")
    args = ap.parse_args()
    if args.warm_vs_cold:
        return warm_vs_cold(args.rounds, args.nodes)
    results: dict[str, list[dict[str, Any]]] = {"trainguard": [], "c10d": [], "c10d-first": []}
    for r in range(args.rounds):
        order = ["trainguard", "c10d"] if r % 2 == 0 else ["c10d", "trainguard"]
        for backend in order:
            with tempfile.TemporaryDirectory(prefix=f"rdzv-{backend}-") as work:
                got = one_job(backend, Path(work), args.nodes, warm=args.warm)
            results[backend].append(got)
            print(_line(r, backend, got), flush=True)
        if args.c10d_first:
            with tempfile.TemporaryDirectory(prefix="rdzv-c10d-first-") as work:
                got = one_job("c10d", Path(work), args.nodes, kill_first=True, warm=args.warm)
            results["c10d-first"].append(got)
            print(f"round {r} c10d-first recovered={got['recovered']}", flush=True)
    pairs = [(c, t) for c, t in zip(results["c10d"], results["trainguard"])
             if c["recovered"] and t["recovered"]]
    doc: dict[str, Any] = {"nodes": args.nodes, "rounds": results, "warm": args.warm}
    if pairs:
        ratio = rd.Ratio("node kill to next step: c10d / trainguard (time)",
                         [c["total_s"] / t["total_s"] for c, t in pairs],
                         target="trainguard <= 15 s median")
        doc["ratio"] = ratio.doc()
        _medians(doc, {b: results[b] for b in ("trainguard", "c10d")})
        rd.print_headlines([ratio])
    rd.write_section(rd.results_path(), "rdzv_recovery", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
