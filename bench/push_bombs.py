"""Phase 5 of ``bench/push.py``: the event loop's worst stall while one client sends
each kind of decoding bomb.

A probe sends ``GET /healthz`` one after the other on a connection of its own and
times each answer: first for ``seconds`` with no bomb (its p99 is the baseline), then
for ``seconds`` per bomb while one more client sends that bomb in a loop. A /healthz
answered late waited behind whatever held the service's loop, so the worst probe
latency during a bomb, less the baseline's median, is the loop's worst stall it caused
(the bomb client runs in a process of its own; on a busy machine the scheduler's
waits show too, so this is an upper bound). Targets: <= 50 ms, and <= 2x the baseline p99.

Bombs (each one record of a push body to a dataset with 16 MiB records, so the byte
limits do not stop them first):
- ``msgpack-lists``: ``[[ [] x 10,000 ] x 419]``, 4,190,000 empty lists in 4 MiB;
- ``json-lists`` / ``ndjson-lists``: the same as JSON (about 12 MiB);
- ``msgpack-under`` / ``json-under``: 100 records of 9,998 empty lists, each within the
  bound of 10,000 containers: accepted (the first push; the next ones are its resends);
- ``msgpack-deep`` / ``json-deep``: lists nested 100,000 deep.

``--bomb-rounds`` rounds, each the no-bomb baseline and then every bomb, interleaved:
per bomb, the median and range over rounds of its stall and of its worst /healthz over
that round's no-bomb p99 (the paired ratio).

With ``--compare-inline`` (:func:`paired_bomb_phase`), each round runs against two
services on the same Redis, one decoding big bodies in its worker processes (the
default) and one with ``--decode-workers 0`` (every body parsed on the loop, in slices:
the code before the pool), in alternating order; per bomb it also prints the median and
range of the paired ratio of their stalls, and the load average of each round.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgpack

__all__ = ["BOMBS", "bomb_phase", "paired_bomb_phase", "paired_report", "report", "slice_costs"]

_LISTS: list[list[list[Any]]] = [[[]] * 10_000] * 419
_UNDER: list[list[list[Any]]] = [[[]] * 9_998] * 100
"""100 records of 9,998 empty lists each: just within the bound, accepted (1 MiB)."""


def _bombs() -> dict[str, tuple[str, bytes]]:
    lists_json = json.dumps(_LISTS, separators=(",", ":")).encode()
    return {
        "msgpack-lists": ("application/msgpack", msgpack.packb([_LISTS])),
        "json-lists": ("application/json", b"[" + lists_json + b"]"),
        "ndjson-lists": ("application/x-ndjson", lists_json + b"\n"),
        "msgpack-under": ("application/msgpack", msgpack.packb(_UNDER)),
        "json-under": ("application/json", json.dumps(_UNDER, separators=(",", ":")).encode()),
        "msgpack-deep": ("application/msgpack", b"\x91" * 100_000 + b"\x90"),
        "json-deep": ("application/json", b"[" + b"[" * 100_000 + b"]" * 100_000 + b"]"),
    }


BOMBS = tuple(_bombs())


async def _probe(session: aiohttp.ClientSession, base: str, stop: asyncio.Event
                 ) -> list[float]:
    lat: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        async with session.get(f"{base}/healthz") as resp:
            await resp.read()
        lat.append((time.perf_counter() - t) * 1000)
    return lat


async def _bomb_loop(base: str, dataset: str, token: str, content_type: str, body: bytes,
                     stop: Any, ready: Any) -> dict[int, int]:
    statuses: dict[int, int] = {}
    headers = {"Content-Type": content_type, "Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.post(f"{base}/v1/datasets/{dataset}/records",
                                    params={"producer_id": "bomber", "seq": "0"},
                                    headers=headers, data=body) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            ready.set()
    return statuses


def _bomber(base: str, dataset: str, token: str, name: str, stop: Any, ready: Any,
            out: Any) -> None:
    """In a process of its own: the bomb client's encoding and sending do not delay
    the probe."""
    content_type, body = _bombs()[name]
    out.put(asyncio.run(_bomb_loop(base, dataset, token, content_type, body, stop, ready)))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _waited_ms(pid: int | None) -> float:
    """Milliseconds the service's main thread (its event loop) has spent runnable but
    waiting for a core (``/proc/<pid>/schedstat``, second field, ns): the scheduler's
    share of a stall, which no change to the loop's code removes. NaN: not known."""
    if pid is None:
        return float("nan")
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return float("nan")


async def _round(session: aiohttp.ClientSession, base: str, dataset: str, token: str,
                 seconds: float, pid: int | None = None) -> dict[str, Any]:
    """One round: /healthz with no bomb, then beside each bomb in turn (with ``pid``,
    the service's: its loop thread's run-queue wait per second of each phase)."""
    out: dict[str, Any] = {}
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_probe(session, base, stop))
    waited, started, since = _waited_ms(pid), time.perf_counter(), time.time()
    await asyncio.sleep(seconds)
    stop.set()
    base_lat = await probe
    out["baseline"] = {"p50": _pct(base_lat, .5), "p99": _pct(base_lat, .99),
                       "max": max(base_lat), "n": len(base_lat), "window": (since, time.time()),
                       "runq": (_waited_ms(pid) - waited) / (time.perf_counter() - started)}
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    for name, (_, body) in _bombs().items():
        stop, stopped, ready, results = asyncio.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        bomber = ctx.Process(target=_bomber, args=(base, dataset, token, name, stopped,
                                                   ready, results))
        # On stderr: where each bomb starts, to match with a --steps log.
        print(f"bomb {name} from {time.time():.2f}", file=sys.stderr, flush=True)
        bomber.start()
        # From its first answer on: the bomber's start (imports) is not the service's.
        await loop.run_in_executor(None, ready.wait, 60)
        probe = asyncio.ensure_future(_probe(session, base, stop))
        waited, started, since = _waited_ms(pid), time.perf_counter(), time.time()
        await asyncio.sleep(seconds)
        stop.set()
        stopped.set()
        lat = await probe
        window = (since, time.time())
        runq = (_waited_ms(pid) - waited) / (time.perf_counter() - started)
        statuses = await loop.run_in_executor(None, results.get)
        bomber.join()
        out[name] = {"worst": max(lat), "p99": _pct(lat, .99), "n": len(lat),
                     "stall": max(lat) - out["baseline"]["p50"], "answers": statuses,
                     "ratio": max(lat) / out["baseline"]["p99"], "mib": len(body) / 2**20,
                     "runq": runq, "window": window}
    return out


async def bomb_phase(base: str, dataset: str, token: str, seconds: float, rounds: int = 3,
                     pid: int | None = None) -> list[dict[str, Any]]:
    """Per round (the baseline and the bombs interleaved, so that a change of the
    machine's load shows in both): the no-bomb /healthz figures and, per bomb, the
    worst /healthz latency, its ratio to that round's no-bomb p99, and the answers."""
    async with aiohttp.ClientSession() as session:
        return [await _round(session, base, dataset, token, seconds, pid) for _ in range(rounds)]


def _median_range(values: list[float], fmt: str) -> str:
    s = sorted(values)
    return f"{format(statistics.median(s), fmt)} (range {format(s[0], fmt)}-{format(s[-1], fmt)})"


async def paired_bomb_phase(bases: dict[str, tuple[str, str, int | None]], token: str,
                            seconds: float, rounds: int = 3) -> dict[str, list[dict[str, Any]]]:
    """Per service (label: its base URL, dataset and pid), the rounds of :func:`bomb_phase`,
    the services taking turns within each round (A B, then B A, ...), each round with
    the load average at its end."""
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in bases}
    async with aiohttp.ClientSession() as session:
        for n in range(rounds):
            for label in (list(bases) if n % 2 == 0 else list(reversed(bases))):
                base, dataset, pid = bases[label]
                result = await _round(session, base, dataset, token, seconds, pid)
                result["load"] = os.getloadavg()[0]
                out[label].append(result)
    return out


def paired_report(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each service's report, then per bomb the paired ratio of the stalls (the
    second service's over the first's, round by round)."""
    lines: list[str] = []
    for label, rounds in runs.items():
        loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
        lines.append(f" {label} (load average at the end of each round: {loads})")
        lines += report(rounds, costs=False)
    first, second = list(runs)
    lines.append(f" paired, per bomb: {second}'s worst /healthz over {first}'s, round by round")
    for name in BOMBS:
        ratios = [b[name]["worst"] / a[name]["worst"]
                  for a, b in zip(runs[first], runs[second], strict=True)]
        lines.append(f"  {name:>13}: median {_median_range(ratios, '.2f')}")
    return lines


def report(rounds: list[dict[str, Any]], *, costs: bool = True) -> list[str]:
    p99s = [r["baseline"]["p99"] for r in rounds]
    # The control of the ratio below: the same statistic (worst over p99) with no bomb.
    control = [r["baseline"]["max"] / r["baseline"]["p99"] for r in rounds]
    lines = [f"  no bomb: /healthz p99 median {_median_range(p99s, '.1f')} ms, p50 median "
             f"{statistics.median(r['baseline']['p50'] for r in rounds):.1f} ms "
             f"({len(rounds)} rounds, {sum(r['baseline']['n'] for r in rounds)} probes); its "
             f"own worst over its p99: median {_median_range(control, '.2f')}; the loop "
             f"thread's run-queue wait {_median_range([r['baseline']['runq'] for r in rounds], '.0f')}"
             " ms/s"]
    for name in BOMBS:
        runs = [r[name] for r in rounds]
        answers: dict[int, int] = {}
        for run in runs:
            for status, n in run["answers"].items():
                answers[status] = answers.get(status, 0) + n
        lines.append(
            f"  {name:>13} ({runs[0]['mib']:.1f} MiB, answers {answers}): loop stall <= "
            f"{_median_range([x['stall'] for x in runs], '.1f')} ms; worst /healthz over the "
            f"round's no-bomb p99: median {_median_range([x['ratio'] for x in runs], '.2f')}; "
            f"run-queue wait {_median_range([x['runq'] for x in runs], '.0f')} ms/s")
    if costs:
        slices = slice_costs()
        lines.append("  longest parse slice on the loop (decode-workers 0), CPU ms: " + ", ".join(
            f"{n} {slices[n]:.1f}" for n in BOMBS))
    worst = max(r[n]["stall"] for r in rounds for n in BOMBS)
    worst_ratio = max(r[n]["ratio"] for r in rounds for n in BOMBS)
    lines.append(f"  worst stall of all rounds {worst:.1f} ms, worst ratio {worst_ratio:.2f} "
                 f"(target <= 50 ms and <= 2x the no-bomb p99)")
    return lines


def step_report(rounds: list[dict[str, Any]], log: Path) -> list[str]:
    """The loop's worst stall as the service measured it (``bench/_serve_steps.py``: each
    loop step over ``TRAINGUARD_SLOW_STEP_MS`` of the loop thread's CPU, logged): per
    bomb, the longest step inside its windows, against 2x the round's no-bomb /healthz
    p99. CPU, not wall time: what the loop cannot serve anyone else during, where the
    probe's worst answer also holds the scheduler's waits for a core."""
    from push_bomb_steps import _steps

    def longest(window: tuple[float, float]) -> float:
        return _steps(log, *window)

    quiet = [longest(r["baseline"]["window"]) for r in rounds]
    lines = [f"  longest loop step (CPU ms of the loop's thread; 0: none over the log's "
             f"threshold): no bomb {_median_range(quiet, '.1f')}"]
    worst = 0.0
    for name in BOMBS:
        steps = [longest(r[name]["window"]) for r in rounds]
        over = [s / r["baseline"]["p99"] for s, r in zip(steps, rounds, strict=True)]
        worst = max(worst, *over)
        lines.append(f"  {name:>13}: longest step {_median_range(steps, '.1f')} ms; over the "
                     f"round's no-bomb /healthz p99 {_median_range(over, '.2f')}")
    lines.append(f"  worst longest step over the no-bomb p99 of all rounds {worst:.2f} "
                 "(target <= 2x)")
    return lines


def slice_costs() -> dict[str, float]:
    """Per bomb, the longest the parser holds the loop in one slice, in CPU time of
    this thread (not wall time: on a busy machine the scheduler's waits would show),
    in ms: what the loop cannot serve others during, whatever the machine's load."""
    from ingest_service.errors import PushRejectedError
    from ingest_service.push.body import BodyLimits, _gc_paused, _parse

    out: dict[str, float] = {}
    for name, (content_type, body) in _bombs().items():
        steps = _parse(body, content_type, 16 * 2**20, BodyLimits())
        worst = 0.0
        while True:
            t = time.thread_time()
            try:
                with _gc_paused():  # as parse_records_sliced runs each slice
                    next(steps)
            except (StopIteration, PushRejectedError):
                worst = max(worst, time.thread_time() - t)
                break
            worst = max(worst, time.thread_time() - t)
        out[name] = worst * 1000
    return out
