"""``trainguard runs ls|show``: training runs, their checkpoints, restarts and rollbacks,
their attempts and incidents, and the checkpoint interval advice, from the manifests
and Redis.

The same operations as the admin API's ``/admin/runs`` (:mod:`ingest_service.service.runs`),
run here against Redis and the checkpoint stores named on the command line (or in
``TRAINGUARD_CHECKPOINT_STORES``), so they work with or without a running service.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from trainguard.core import settings
from trainguard.ops.exits import EXIT_OK
from trainguard.ops.output import cell, emit, table

__all__ = ["register"]


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 120:
        return f"{v:.1f}s"
    return f"{v / 60:.1f}min" if v < 7200 else f"{v / 3600:.1f}h"


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _run(args: argparse.Namespace, op: Any) -> Any:
    import asyncio

    from ingest_service import redis_client
    from ingest_service.service.admin_checkpoints import StoreSet, parse_store_roots
    from trainguard.core.interval import IntervalPolicy

    roots = parse_store_roots(args.stores if args.stores is not None
                              else settings.checkpoint_stores(), settings.tier_servers())
    policy = IntervalPolicy(prior_mtbf_s=args.prior_mtbf_h * 3600,
                            prior_weight=args.prior_weight)

    async def main() -> Any:
        r = redis_client.client(settings.redis_url(args.redis_url), socket_timeout=10)
        stores = StoreSet(roots)
        try:
            return await op(r, stores, policy)
        finally:
            await r.aclose()
            stores.close()

    return asyncio.run(main())


def _ls(args: argparse.Namespace) -> int:
    from ingest_service.service.runs import collect_runs, summary

    errors: dict[str, str] = {}
    rows = [summary(h) for h in _run(args, lambda r, s, p: collect_runs(r, s, policy=p,
                                                                       errors=errors))]
    for store, why in sorted(errors.items()):
        # The other stores' runs are listed; this one's are missing, and says so.
        print(f"warning: store {cell(store)} could not be read: {why}", file=sys.stderr)
    emit(args, rows, lambda rows: table(
        [(x["run"], x["dataset"], x["store"], x["checkpoints"], x["last_step"],
          _when(x["last_commit_at"]), x["generation"], x["restarts"], x["rollbacks"], x["lag"],
          _seconds(x["current_s"]), _seconds(x["recommended_s"])) for x in rows],
        ["RUN", "DATASET", "STORE", "CKPTS", "STEP", "LAST COMMIT", "GEN", "RESTARTS",
         "ROLLBACKS", "LAG", "INTERVAL", "RECOMMENDED"],
    ) if rows else "no runs")
    return EXIT_OK


def _advice_lines(a: dict[str, Any] | None) -> list[str]:
    if a is None:
        return ["interval advice: no measured save yet"]
    bound = f" (held at the {a['bound']} bound)" if a["bound"] else ""
    return [
        f"interval: recommended {_seconds(a['recommended_s'])}{bound}, current "
        f"{_seconds(a['current_s'])}",
        f"lost work per failure: {_seconds(a['lost_recommended_s'])} at the recommended, "
        f"{_seconds(a['lost_current_s'])} at the current interval",
        f"inputs: save blocks {_seconds(a['blocked_s'])}, durable after "
        f"{_seconds(a['durable_s'])}; MTBF {_seconds(a['mtbf_s'])} from {a['failures']} "
        f"restarts in {_seconds(a['observed_s'])} (with the prior)",
        f"formula: {a['formula']}",
    ]


def _show_human(h: dict[str, Any]) -> str:
    out = [f"run {h['run']} on dataset {h['dataset']} (store {h['store'] or '-'}), "
           f"lag {h['group']['lag'] if h['group']['lag'] is not None else '-'}",
           *_advice_lines(h["advice"]), ""]
    out.append(table(
        [(c["step"], _when(c["created_at"]), c["generation"], c["nbytes"],
          _seconds(c["blocked_s"]), _seconds(c["durable_s"]),
          f"{c['world_size']}x{c['num_workers']}", ",".join(c.get("status", [])))
         for c in h["checkpoints"]],
        ["STEP", "COMMITTED", "GEN", "BYTES", "BLOCKED", "DURABLE", "WORLD", "STATUS"],
    ) if h["checkpoints"] else "no checkpoints")
    if h["restarts"]:
        out += ["", table([(_when(x["at"]), f"{x['from_generation']}->{x['generation']}",
                            x["resumed_step"], x["last_committed_step"],
                            ("" if x["steps_redone_exact"] else ">=") + str(x["steps_redone"]))
                           for x in h["restarts"]],
                          ["RESTART AT", "GEN", "RESUMED AT", "LAST COMMITTED", "REDONE"])]
    if h["rollbacks"]:
        out += ["", table([(_when(x["at"]), x["to_step"], x["last_step"],
                            ",".join(x["skipped"]) or "-") for x in h["rollbacks"]],
                          ["ROLLBACK AT", "TO STEP", "FROM STEP", "SKIPPED"])]
    return "\n".join(out + _incident_lines(h))


def _incident_lines(h: dict[str, Any]) -> list[str]:
    tried = h.get("attempts") or []
    out = ["", f"attempts: {len(tried)} ("
           + ", ".join(f"{a['attempt']} {a.get('outcome')}" for a in tried) + ")"] if tried else []
    rows = []
    for i in h.get("incidents") or ():
        rec = i.get("recovery") or {}
        phases = rec.get("phases_s") or {}
        split = " ".join(f"{k} {_seconds(v)}" for k, v in phases.items() if v is not None)
        rows.append((i.get("attempt"), i.get("cause"), i.get("step"), i.get("detected_by"),
                     _seconds(i.get("detection_latency_s")),
                     (i.get("remedy") or {}).get("action") or "-",
                     f"{rec.get('steps_redone', '-')}/{rec.get('records_redone', '-')}"
                     if rec else "-", split or "-"))
    if rows:
        out += ["", table(rows, ["ATTEMPT", "CAUSE", "STEP", "DETECTED BY", "LATENCY",
                                 "REMEDY", "REDONE STEPS/RECORDS", "TO NEXT STEP"])]
    for i in h.get("incidents") or ():
        if i.get("cause") == "restart_loop":
            out += [f"restart loop stopped at attempt {i.get('attempt')}: {i.get('signature')} "
                    f"came back {i.get('repeats')} times after {', '.join(i.get('tried') or [])}."
                    f" {i.get('look_at')}"]
    return out


def _show(args: argparse.Namespace) -> int:
    from ingest_service.service.runs import run_detail

    h = _run(args, lambda r, s, p: run_detail(r, s, args.run, args.dataset, policy=p,
                                              stacks=True))
    emit(args, h, _show_human)
    return EXIT_OK


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    p.add_argument("--redis-url", default=None,
                   help=f"Redis (default: ${settings.REDIS_URL_ENV} or "
                        f"{settings.DEFAULT_REDIS_URL})")
    p.add_argument("--stores", default=None, metavar="NAME=URL,...",
                   help="checkpoint stores to read (default: $TRAINGUARD_CHECKPOINT_STORES)")
    p.add_argument("--prior-mtbf-h", type=float, default=24.0,
                   help="MTBF assumed for a run without restarts yet, in hours (default 24)")
    p.add_argument("--prior-weight", type=float, default=1.0,
                   help="how many observed failures the prior is worth (default 1)")


def register(sub: Any) -> None:
    runs = sub.add_parser("runs", help="training runs: checkpoints, restarts, interval advice")
    rsub = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    p = rsub.add_parser("ls", help="every run with its last checkpoint, restarts and lag")
    _common(p)
    p.set_defaults(handler=_ls)
    p = rsub.add_parser("show", help="a run's checkpoints, restarts, rollbacks and advice")
    p.add_argument("run", help="the run's name")
    p.add_argument("--dataset", help="the run's dataset, when the name is used on several")
    _common(p)
    p.set_defaults(handler=_show)
