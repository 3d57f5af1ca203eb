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
- ``msgpack-deep`` / ``json-deep``: lists nested 100,000 deep.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from typing import Any

import aiohttp
import msgpack

__all__ = ["BOMBS", "bomb_phase", "report", "slice_costs"]

_LISTS = [[[]] * 10_000] * 419


def _bombs() -> dict[str, tuple[str, bytes]]:
    lists_json = json.dumps(_LISTS, separators=(",", ":")).encode()
    return {
        "msgpack-lists": ("application/msgpack", msgpack.packb([_LISTS])),
        "json-lists": ("application/json", b"[" + lists_json + b"]"),
        "ndjson-lists": ("application/x-ndjson", lists_json + b"\n"),
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


async def bomb_phase(base: str, dataset: str, token: str, seconds: float) -> dict[str, Any]:
    """The baseline and, per bomb, the worst /healthz latency and the bomb's answers."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        probe = asyncio.ensure_future(_probe(session, base, stop))
        await asyncio.sleep(seconds)
        stop.set()
        base_lat = await probe
        out["baseline"] = {"p50": _pct(base_lat, .5), "p99": _pct(base_lat, .99),
                           "max": max(base_lat), "n": len(base_lat)}
        ctx = multiprocessing.get_context("spawn")
        for name, (_, body) in _bombs().items():
            stop, stopped, ready, results = asyncio.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
            bomber = ctx.Process(target=_bomber, args=(base, dataset, token, name, stopped,
                                                       ready, results))
            bomber.start()
            # From its first answer on: the bomber's start (imports) is not the service's.
            await asyncio.get_running_loop().run_in_executor(None, ready.wait, 60)
            probe = asyncio.ensure_future(_probe(session, base, stop))
            await asyncio.sleep(seconds)
            stop.set()
            stopped.set()
            lat = await probe
            statuses = await asyncio.get_running_loop().run_in_executor(None, results.get)
            bomber.join()
            out[name] = {"worst": max(lat), "p99": _pct(lat, .99), "n": len(lat),
                         "stall": max(lat) - out["baseline"]["p50"], "answers": statuses,
                         "mib": len(body) / 2**20}
    return out


def report(result: dict[str, Any]) -> list[str]:
    b = result["baseline"]
    lines = [f"  no bomb: /healthz p50 {b['p50']:.1f} ms, p99 {b['p99']:.1f} ms, "
             f"max {b['max']:.1f} ms ({b['n']} probes)"]
    for name in BOMBS:
        r = result[name]
        lines.append(f"  {name:>13} ({r['mib']:.1f} MiB, answers {r['answers']}): worst "
                     f"/healthz {r['worst']:.1f} ms, p99 {r['p99']:.1f} ms, loop stall <= "
                     f"{r['stall']:.1f} ms ({r['n']} probes)")
    costs = slice_costs()
    lines.append("  longest parse slice, CPU ms: " + ", ".join(
        f"{n} {costs[n]:.1f}" for n in BOMBS))
    worst = max(result[n]["stall"] for n in BOMBS)
    lines.append(f"  worst stall {worst:.1f} ms (target <= 50 ms and <= 2x the no-bomb p99 "
                 f"{b['p99']:.1f} ms)")
    return lines


def slice_costs() -> dict[str, float]:
    """Per bomb, the longest the parser holds the loop in one slice, in CPU time of
    this thread (not wall time: on a busy machine the scheduler's waits would show),
    in ms: what the loop cannot serve others during, whatever the machine's load."""
    from ingest_service.errors import PushRejectedError
    from ingest_service.push.body import BodyLimits, _parse

    out: dict[str, float] = {}
    for name, (content_type, body) in _bombs().items():
        steps = _parse(body, content_type, 16 * 2**20, BodyLimits())
        worst = 0.0
        while True:
            t = time.thread_time()
            try:
                next(steps)
            except (StopIteration, PushRejectedError):
                worst = max(worst, time.thread_time() - t)
                break
            worst = max(worst, time.thread_time() - t)
        out[name] = worst * 1000
    return out
