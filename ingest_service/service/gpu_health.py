"""GPU health of the training nodes, from the metrics their health daemons export.

Each node runs ``trainguard probe`` (:mod:`trainguard.ops.probe`), which serves its
latest NVML report as Prometheus text at ``/metrics``. The service reads the daemons
named in ``TRAINGUARD_PROBES`` (``node=http://host:port,...``) when asked (no
background scraping: Prometheus does that), and reduces each to the node's status and,
per GPU, the worst check and its readings. A daemon that does not answer is
``UNREACHABLE``; its URL is never shown (only the node's name).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from trainguard.core import lists
from trainguard.core import probe_metrics as pm

__all__ = ["STATUS_NAMES", "nodes_health", "parse_probes", "summarize_metrics"]

STATUS_NAMES = pm.STATUS_NAMES
SCRAPE_TIMEOUT_S = 3.0
MAX_METRICS_BYTES = 1 << 20
"""A probe's /metrics is a few KB; past 1 MiB the body is not read further."""


def parse_probes(text: str) -> dict[str, str]:
    """``"a=http://h:9400,b=http://g:9400"`` -> {node: URL}."""
    expected = "node=http://host:port"
    out = lists.pairs(text, what="probe", expected=expected)
    for name, url in out.items():
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"probe {f'{name}={url}'!r} is not valid: expected {expected}, "
                             "comma-separated")
        out[name] = url.rstrip("/")
    return out


def _status(value: float) -> str:
    if not math.isfinite(value):
        return "UNKNOWN"
    i = int(value)
    return STATUS_NAMES[i] if 0 <= i < len(STATUS_NAMES) and i == value else "UNKNOWN"


def _finite(value: float) -> float | None:
    # JSON has no +Inf or NaN: a reading that is not a number shows as null.
    return value if math.isfinite(value) else None


def summarize_metrics(text: str) -> dict[str, Any]:
    """A probe's /metrics text -> node status, GPU count and per-GPU status/readings."""
    node: dict[str, Any] = {"status": "UNKNOWN", "no_gpu": None, "gpus": [],
                            "taken_at": None}
    gpus: dict[int, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == pm.NODE_STATUS:
                node["status"] = _status(value)
            elif name == pm.NODE_NO_GPU:
                node["no_gpu"] = value == 1
            elif name == pm.PROBE_TIMESTAMP:
                node["taken_at"] = _finite(value)
            elif name.startswith(pm.GPU_PREFIX) and "gpu" in labels:
                gpu = gpus.setdefault(int(labels["gpu"]), {
                    "gpu": int(labels["gpu"]), "status": "OK", "problems": [],
                    "readings": {}})
                if name == pm.GPU_CHECK_STATUS:
                    status = _status(value)
                    rank = STATUS_NAMES.index(status) if status in STATUS_NAMES else 99
                    old = STATUS_NAMES.index(gpu["status"]) if gpu["status"] in STATUS_NAMES \
                        else 99
                    if rank > old:
                        gpu["status"] = status
                    if status != "OK":
                        gpu["problems"].append(f"{labels.get(pm.SIGNAL_LABEL)}: {status}")
                else:
                    gpu["readings"][name.removeprefix(pm.GPU_PREFIX)] = _finite(value)
    node["gpus"] = [gpus[i] for i in sorted(gpus)]
    return node


async def _node(session: aiohttp.ClientSession, name: str, url: str) -> dict[str, Any]:
    try:
        async with session.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return {"node": name, "status": "UNREACHABLE", "reason": f"HTTP {resp.status}",
                        "gpus": []}
            raw = b""
            while len(raw) <= MAX_METRICS_BYTES:
                part = await resp.content.read(MAX_METRICS_BYTES + 1 - len(raw))
                if not part:
                    break
                raw += part
            if len(raw) > MAX_METRICS_BYTES:
                return {"node": name, "status": "UNREACHABLE", "gpus": [],
                        "reason": f"metrics larger than {MAX_METRICS_BYTES >> 20} MiB"}
            text = raw.decode("utf-8", "replace")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        # The type only: a message could carry the URL.
        return {"node": name, "status": "UNREACHABLE", "reason": type(exc).__name__,
                "gpus": []}
    try:
        return {"node": name, **summarize_metrics(text)}
    except (ValueError, TypeError, OverflowError, KeyError, IndexError):
        return {"node": name, "status": "UNREACHABLE", "reason": "unreadable metrics",
                "gpus": []}


async def nodes_health(probes: dict[str, str]) -> list[dict[str, Any]]:
    """Every configured node's health, read now (concurrently, a few seconds at most)."""
    if not probes:
        return []
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(_node(session, n, u) for n, u in probes.items())))
