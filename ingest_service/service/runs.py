"""Run history and dataset detail for the operator: the JSON behind ``/ui`` and
``trainguard runs``.

Routes (read-only, no token; documented in :mod:`ingest_service.service.runs_openapi`)::

    GET /admin/runs                         every run (consumer group) with its summary
    GET /admin/runs/{group}[?dataset=D]     one run: checkpoints, restarts, rollbacks,
                                            world changes, advice, its partitions' lag,
                                            its attempts and incidents (from Redis),
                                            what the loop logged (training: loss,
                                            steps/s, ETA, heartbeat)
    GET /admin/datasets/{dataset}/detail    partitions, groups' lag, dead letters,
                                            throughput over time
    GET /admin/health                       GPU health of the nodes in TRAINGUARD_PROBES
                                            (:mod:`ingest_service.service.gpu_health`)

Everything is derived from what the system keeps: the manifests of the configured
checkpoint stores (:func:`trainguard.core.history.history`) and Redis
(:mod:`ingest_service.inspection`), plus the service's throughput ring
(:mod:`ingest_service.service.throughput`). No database of its own.

What an unauthenticated reader sees is names and figures: no store URL, no dataset
source, no record payload; a dead letter's position keeps only its file name.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from ingest_service import inspection
from ingest_service.errors import BadRequest, NotFound, Refused
from ingest_service.service.admin import READ_REDIS_KEY, STORES_KEY
from ingest_service.service.admin_checkpoints import Catalog, StoreRoot, StoreSet
from ingest_service.service.catalog import Cancel
from ingest_service.service.config import METRICS_KEY, REDIS_KEY
from ingest_service.service.gpu_health import nodes_health, parse_probes
from ingest_service.service.lag import fill_lag
from ingest_service.service.paging import page, until_gone
from ingest_service.service.restarts import merged_restarts
from ingest_service.service.throughput import ThroughputSampler
from ingest_service.service.training import training
from trainguard.core import incidents as inc
from trainguard.core import settings, streams
from trainguard.core.checkpoints import CorruptCheckpointError, ManifestView
from trainguard.core.history import Skips, history, with_recorded_failures
from trainguard.core.history import histories as run_histories
from trainguard.core.interval import IntervalPolicy
from trainguard.core.rank_record import checkpoint_skipped
from trainguard.core.record import RecordError, SessionRecord
from trainguard.core.urls import redact_text

__all__ = ["DEAD_LETTERS_SHOWN", "SAMPLER_KEY", "attempts", "collect_runs", "dataset_detail", "run_detail",
           "setup_runs", "summary"]

log = logging.getLogger(__name__)

SAMPLER_KEY = web.AppKey("trainguard_runs_sampler", ThroughputSampler)
PROBES_KEY = web.AppKey("trainguard_runs_probes", dict)
RUNS_PAGE = 200
"""Runs per page of ``/admin/runs`` unless ``?limit=`` says otherwise."""
DEAD_LETTERS_SHOWN = 20
"""How many of the newest dead letters the dataset detail lists."""


def _position(pos: str) -> str:
    # Positions are "<source path>:<index>": keep the file name, never the directory
    # or an URL's host and credentials.
    return pos.rsplit("/", 1)[-1]


async def dead_letters(r: aioredis.Redis, dataset: str, count: int) -> list[dict[str, Any]]:
    rows: list[Any] = await r.xrevrange(streams.dlq_key(dataset), count=count) or []
    out = []
    for entry_id, raw in rows:
        fields: dict[bytes, bytes] = raw or {}
        out.append({
            "id": inspection.as_text(entry_id),
            "reason": inspection.as_text(fields.get(streams.DL_REASON, b"")),
            "position": _position(str(inspection.as_text(fields.get(streams.DL_POS, b"")))),
            "size": int(fields.get(streams.DL_SIZE, b"0") or 0),
            "epoch": (int(fields[streams.DL_EPOCH]) if streams.DL_EPOCH in fields else None),
        })
    return out


async def _groups(r: aioredis.Redis, dataset: str,
                  info: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The dataset's groups with their lag filled in where Redis cannot tell."""
    info = info or await inspection.show_dataset(r, dataset)
    spec = await inspection.dataset_spec(r, dataset)
    last = {p["partition"]: p["last_generated_id"] for p in info["partitions"]}
    groups = await inspection.dataset_groups(r, dataset)
    for g in groups:
        await fill_lag(r, spec, g["partitions"], last)
    return groups


def _lag_total(partitions: list[dict[str, Any]]) -> int | None:
    lags = [p["lag"] for p in partitions if p["exists"]]
    return None if not lags or any(v is None for v in lags) else int(sum(lags))


async def dataset_detail(r: aioredis.Redis, dataset: str,
                         sampler: ThroughputSampler | None = None) -> dict[str, Any]:
    """A dataset as the dashboard shows it (names and figures only)."""
    info = await inspection.show_dataset(r, dataset)
    spec = dict(info["spec"])
    spec.pop("source", None)
    spec.pop("options", None)
    groups = await _groups(r, dataset, info)
    return {
        "name": dataset,
        "spec": spec,
        "partitions": info["partitions"],
        "producer": info["producer"],
        "paused": sum(1 for p in info["partitions"] if p["paused"]),
        "length": sum(p["length"] for p in info["partitions"]),
        "dead_letters": {"count": info["dead_letters"],
                         "newest": await dead_letters(r, dataset, DEAD_LETTERS_SHOWN)},
        "groups": [{"group": g["group"], "lag": _lag_total(g["partitions"]),
                    "partitions": g["partitions"]} for g in groups],
        "throughput": sampler.series(dataset) if sampler is not None else [],
    }


async def _docs(r: aioredis.Redis, key: str) -> list[dict[str, Any]]:
    """A hash of attempt/incident documents, by attempt number (unreadable ones left
    out: the history must show what it can)."""
    out = list(inc.documents(await r.hgetall(key)).values())
    # An attempt's rollbacks came before the failure that ended it.
    return sorted(out, key=lambda d: (int(d.get("attempt") or 0),
                                      float(d.get("detected_at") or 0.0)))


async def attempts(r: aioredis.Redis, dataset: str, run: str) -> dict[str, Any]:
    """The run's attempts and incidents as Redis recorded them
    (:mod:`trainguard.core.incidents`), and the failures they count."""
    tried = await _docs(r, inc.attempts_key(dataset, run))
    found = await _docs(r, inc.incidents_key(dataset, run))
    return {"attempts": tried, "incidents": found,
            "failures": sum(1 for i in found if i.get("cause") not in inc.NOT_FAILURES)}


def _without_stacks(incident: dict[str, Any]) -> dict[str, Any]:
    # The open API shows names and figures: a thread's stack and an error's message
    # may quote data. `trainguard runs show --json` has them.
    reports = [{**{k: v for k, v in rep.items() if k not in ("stacks", "heartbeat")},
                "threads": len(rep.get("stacks") or {}),
                "error": {"type": (rep.get("error") or {}).get("type")}}
               for rep in incident.get("reports") or ()]
    return {**incident, "reports": reports, "look_at": None if incident.get("look_at") is None
            else "see `trainguard runs show` (it quotes the error)"}


def _skips(stores: StoreSet, root: StoreRoot) -> Skips:
    """Each checkpoint's skipped batches: the manifest's, or from session record 4 on
    its rank objects' (one read per rank, once per listing). A damaged or missing
    object counts none and is logged: the history shows what it can."""
    store = stores.opened(root)

    def skips(m: ManifestView, rec: SessionRecord) -> tuple[str, ...] | None:
        try:
            return checkpoint_skipped(store, m, rec)
        except (RecordError, CorruptCheckpointError, OSError) as exc:
            log.warning("store %r: skipped batches of checkpoint %s unreadable: %s",
                        root.name, m.name, redact_text(f"{type(exc).__name__}: {exc}"))
            return None

    return skips


def _root_histories(stores: StoreSet, policy: IntervalPolicy | None, root: StoreRoot,
                    cancel: Cancel) -> list[dict[str, Any]]:
    """A root's run histories (blocking), derived once per listing of the root."""
    catalog = stores.read_catalog(root, cancel)

    def make(c: Catalog) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for h in run_histories(c.manifests, policy=policy, skips=_skips(stores, root)):
            for ckpt in h["checkpoints"]:
                ckpt["status"] = c.labels.get(ckpt["name"], ["committed"])
                ckpt["tiers"] = c.tiers.get(ckpt["name"], [])
            out.append({"store": root.name, **h})
        return out

    return stores.derived(root, f"histories:{policy!r}", catalog, make)


async def _store_histories(stores: StoreSet, policy: IntervalPolicy | None,
                           errors: dict[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in sorted(stores.roots):
        try:
            found = await stores.shared(name, f"histories:{policy!r}",
                                        functools.partial(_root_histories, stores, policy))
        except Exception as exc:
            # One root that cannot be read must not hide the others' runs.
            log.warning("store %r: run histories unavailable: %s", name,
                        redact_text(f"{type(exc).__name__}: {exc}"))
            errors[name] = f"unreachable ({type(exc).__name__})"
            continue
        # Copies: the caller adds each run's lag, the cached histories stay as derived.
        out.extend({**h} for h in found)
    return out


async def collect_runs(r: aioredis.Redis, stores: StoreSet, *,
                       policy: IntervalPolicy | None = None,
                       errors: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every run known to a configured store or to Redis (a group of a dataset), with
    its history; a run with no checkpoint yet has an empty one. A store that cannot be
    read is left out and named in ``errors`` (store -> reason)."""
    histories = await _store_histories(stores, policy, {} if errors is None else errors)
    for h in histories:
        # The attempts and incidents Redis recorded (the cached histories stay as
        # derived from the manifests: these are copies).
        found = await attempts(r, h["dataset"], h["run"])
        h.update(with_recorded_failures(h, found["failures"], policy), **found)
        # Retention may have pruned the manifests that showed a restart; the attempts
        # still know it (a new list: the cached history's stays as derived).
        h["restarts"] = merged_restarts(h["restarts"], found["attempts"], found["incidents"])
    seen = {(h["dataset"], h["run"]) for h in histories}
    lag: dict[tuple[str, str], dict[str, Any]] = {}
    for d in sorted(inspection.as_text(n) for n in await r.smembers(streams.datasets_key())):
        try:
            groups = await _groups(r, d)
        except (NotFound, Refused):
            continue
        for g in groups:
            lag[(d, g["group"])] = {"lag": _lag_total(g["partitions"]),
                                    "partitions": g["partitions"]}
            if (d, g["group"]) not in seen:
                seen.add((d, g["group"]))
                seen_here = await attempts(r, d, g["group"])
                empty = history([], dataset=d, run=g["group"], policy=policy,
                                failures=seen_here["failures"])
                empty["restarts"] = merged_restarts([], seen_here["attempts"],
                                                    seen_here["incidents"])
                histories.append({"store": None, **empty, **seen_here})
    for h in histories:
        h["group"] = lag.get((h["dataset"], h["run"]), {"lag": None, "partitions": []})
    return histories


def summary(h: dict[str, Any]) -> dict[str, Any]:
    """One row of ``/admin/runs``: a run's history in a few figures."""
    last = h["checkpoints"][-1] if h["checkpoints"] else None
    advice = h["advice"] or {}
    return {
        "run": h["run"], "dataset": h["dataset"], "store": h["store"],
        "checkpoints": len(h["checkpoints"]),
        "last_step": last["step"] if last else None,
        "last_commit_at": last["created_at"] if last else None,
        "generation": last["generation"] if last else None,
        "restarts": h["totals"]["failures"],
        "rollbacks": len(h["rollbacks"]),
        "attempts": len(h.get("attempts") or ()),
        "last_incident": (h["incidents"][-1].get("cause") if h.get("incidents") else None),
        "lag": h["group"]["lag"],
        "recommended_s": advice.get("recommended_s"),
        "current_s": advice.get("current_s"),
    }


async def run_detail(r: aioredis.Redis, stores: StoreSet, group: str, dataset: str | None,
                     *, policy: IntervalPolicy | None = None,
                     stacks: bool = False) -> dict[str, Any]:
    """One run's history; ``stacks``: keep the incidents' thread stacks and error
    messages (the CLI's; the open API leaves them out)."""
    try:
        streams.check_name("run", group)
        if dataset is not None:
            streams.check_name("dataset", dataset)
    except streams.ContractError as exc:
        raise BadRequest("bad_name", str(exc)) from exc
    found = [h for h in await collect_runs(r, stores, policy=policy)
             if h["run"] == group and dataset in (None, h["dataset"])]
    if not found:
        raise NotFound("run_not_found",
                       f"no run {group!r} in the configured stores or Redis groups: "
                       "`trainguard runs ls` lists the runs")
    if len({h["dataset"] for h in found}) > 1:
        raise Refused("ambiguous_run",
                      f"run {group!r} exists on datasets {sorted({h['dataset'] for h in found})}:"
                      " add ?dataset=<name>")
    # One dataset; several stores could hold the run: the one with checkpoints first.
    found.sort(key=lambda h: -len(h["checkpoints"]))
    found[0]["training"] = await training(r, found[0]["dataset"], group,
                                          found[0].get("attempts") or [])
    if not stacks:
        found[0]["incidents"] = [_without_stacks(i) for i in found[0].get("incidents") or ()]
    return found[0]


async def _list(request: web.Request) -> web.Response:
    offset, limit = page(request, default_limit=RUNS_PAGE)
    errors: dict[str, str] = {}
    runs = await until_gone(request, collect_runs(request.app[READ_REDIS_KEY],
                                                  request.app[STORES_KEY], errors=errors))
    return web.json_response({"runs": [summary(h) for h in runs[offset:offset + limit]],
                              "total": len(runs), "offset": offset, "limit": limit,
                              "store_errors": errors})


async def _show(request: web.Request) -> web.Response:
    return web.json_response(await until_gone(request, run_detail(
        request.app[READ_REDIS_KEY], request.app[STORES_KEY], request.match_info["group"],
        request.query.get("dataset"))))


async def _detail(request: web.Request) -> web.Response:
    return web.json_response(await dataset_detail(
        request.app[READ_REDIS_KEY], request.match_info["dataset"], request.app[SAMPLER_KEY]))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"nodes": await nodes_health(request.app[PROBES_KEY])})


ROUTES = (
    ("GET", "/admin/runs", _list),
    ("GET", "/admin/runs/{group}", _show),
    ("GET", "/admin/datasets/{dataset}/detail", _detail),
    ("GET", "/admin/health", _health),
)


def setup_runs(app: web.Application, *, sample_interval_s: float = 1.0,
               probes: str | None = None) -> None:
    """Add the routes above and the throughput sampler to the service ``app`` (made
    by ``create_app``: it needs its Redis client, metrics and the admin stores).
    ``probes``: ``node=url,...`` (default ``$TRAINGUARD_PROBES``)."""
    sampler = ThroughputSampler(app[METRICS_KEY].registry, interval_s=sample_interval_s)
    app[SAMPLER_KEY] = sampler
    app[PROBES_KEY] = parse_probes(settings.probes() if probes is None else probes)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)

    async def _sampling(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(sampler.run(app[REDIS_KEY], stop), name="trainguard-sampler")
        try:
            yield
        finally:
            stop.set()
            await task

    app.cleanup_ctx.append(_sampling)
