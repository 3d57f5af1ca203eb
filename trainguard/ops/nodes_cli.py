"""``trainguard node gate|fail`` and ``trainguard nodes ls|clear``: bad nodes stay out.

A launcher runs the gate on each node before torchrun, and reports a failed launch::

    trainguard node gate --wait || exit $?     # quarantined or CRITICAL: not here
    torchrun ... train.py; code=$?
    [ $code -ne 0 ] && trainguard node fail --exit-code $code

``node gate`` refuses (exit 4) while the node's quarantine record holds, probes the
GPUs (:mod:`trainer_client.health`) and, on a CRITICAL report, writes the record and
exits 75; with ``--wait`` it waits instead, printing why and until when, and returns
0 once the node is admitted and healthy. ``node fail`` counts a failure; the
``max_failures``-th within the window quarantines the node (exit 4). ``nodes ls``
and ``nodes clear`` are the operator's view (the same as the admin API's
``/admin/nodes``). Records: :mod:`trainguard.core.quarantine`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from trainguard.core import settings
from trainguard.ops.datasets_cli import with_redis
from trainguard.ops.exits import EXIT_GPU_CRITICAL, EXIT_OK, EXIT_PEER_CRITICAL, EXIT_REFUSED
from trainguard.ops.output import emit, table

if TYPE_CHECKING:
    from trainer_client.health import HealthProbe
    from trainguard.core.quarantine import QuarantinePolicy

__all__ = ["gate", "register"]


def _client(args: argparse.Namespace) -> Any:
    from trainer_client import redis_client

    return redis_client.client(settings.redis_url(args.redis_url), socket_timeout=10,
                               socket_connect_timeout=5)


def _say(line: str) -> None:
    print(f"trainguard node: {line}", file=sys.stderr, flush=True)


def gate(r: Any, node: str, *, probe: HealthProbe | None, policy: QuarantinePolicy,
         wait: bool = False, poll_s: float = 30.0) -> int:
    """The gate of ``trainguard node gate``: 0 admitted and healthy; raises
    NodeQuarantinedError (exit 4) while a record holds; 75 after writing a record for
    a CRITICAL report. ``wait``: poll every ``poll_s`` until admitted and healthy."""
    from trainer_client.health import Status
    from trainguard.core import quarantine as qr

    while True:
        try:
            qr.check_admission(r, node)
        except qr.NodeQuarantinedError as exc:
            if not wait:
                raise
            _say(f"{exc} Waiting, checking again every {poll_s:g} s.")
            time.sleep(poll_s)
            continue
        if probe is None:
            _say(f"node {node!r} admitted (no GPU probe)")
            return EXIT_OK
        report = probe.probe()
        if report.status is not Status.CRITICAL:
            _say(f"node {node!r} admitted, GPU health {report.status.name}"
                 + (" (no GPU)" if report.no_gpu else ""))
            return EXIT_OK
        rec = qr.quarantine(r, node, "GPU health " + "; ".join(report.problems()),
                            source="probe", report=report.to_dict(), policy=policy)
        _say(rec.describe() if rec is not None else
             f"node {node!r} GPU health CRITICAL ({'; '.join(report.problems())}); "
             "quarantine is disabled, so no record was written")
        if not wait:
            return EXIT_GPU_CRITICAL
        if rec is None:
            time.sleep(poll_s)  # nothing to wait out: probe again


def _gate(args: argparse.Namespace) -> int:
    from trainer_client.health import HealthProbe, HealthThresholds
    from trainguard.core import quarantine as qr

    node = qr.node_id(args.node)
    probe = None if args.no_probe else HealthProbe(HealthThresholds(expected_gpus=args.expected_gpus))
    r = _client(args)
    try:
        return gate(r, node, probe=probe, policy=qr.QuarantinePolicy.from_env(),
                    wait=args.wait, poll_s=args.poll_s)
    finally:
        r.close()
        if probe is not None:
            probe.close()


def _fail(args: argparse.Namespace) -> int:
    from trainguard.core import quarantine as qr

    node = qr.node_id(args.node)
    if args.exit_code == EXIT_PEER_CRITICAL:
        _say(f"exit code {EXIT_PEER_CRITICAL}: another node's GPU turned CRITICAL; "
             f"not a failure of {node!r}, not counted")
        return EXIT_OK
    reason = args.reason or (f"exit code {args.exit_code}" if args.exit_code is not None
                             else "reported failure")
    policy = qr.QuarantinePolicy.from_env()
    r = _client(args)
    try:
        count, rec = qr.record_failure(r, node, reason, policy=policy)
    finally:
        r.close()
    if rec is not None:
        _say(rec.describe())
        return EXIT_REFUSED
    _say(f"node {node!r}: {count} of {policy.max_failures} failures within "
         f"{policy.window_s:g} s before quarantine")
    return EXIT_OK


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _ls(args: argparse.Namespace) -> int:
    from ingest_service.service.nodes import list_nodes

    rows = with_redis(args, list_nodes)
    emit(args, rows, lambda rows: table(
        [(x["node"], x["source"], _when(x["created_at"]), _when(x["expires_at"]),
          f"{x['remaining_s']:.0f}s", x["reason"]) for x in rows],
        ["NODE", "SOURCE", "SINCE", "UNTIL", "LEFT", "REASON"],
    ) if rows else "no quarantined nodes")
    return EXIT_OK


def _clear(args: argparse.Namespace) -> int:
    from ingest_service.service.nodes import clear_node

    out = with_redis(args, lambda r: clear_node(r, args.node))
    emit(args, out, lambda o: f"node {o['node']} cleared (was: {o['record']['reason']}): it "
                              "may join again")
    return EXIT_OK


def _redis(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None,
                   help=f"Redis (default: ${settings.REDIS_URL_ENV} or "
                        f"{settings.DEFAULT_REDIS_URL})")


def _node(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", default=None,
                   help=f"node id (default: ${settings.NODE_ID_ENV}, else the host name)")
    _redis(p)


def register(sub: Any) -> None:
    node = sub.add_parser("node", help="this node: the health gate before a launch, failures")
    nsub = node.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    p = nsub.add_parser(
        "gate", help="may this node join a job? (run before torchrun)",
        description="Exit 0 when the node has no quarantine record and its GPUs are not "
                    f"CRITICAL; {EXIT_REFUSED} while a record holds; {EXIT_GPU_CRITICAL} "
                    "after quarantining it for a CRITICAL probe. --wait: wait instead.")
    _node(p)
    p.add_argument("--wait", action="store_true",
                   help="wait (printing why) until the node is admitted and healthy")
    p.add_argument("--poll-s", type=float, default=30.0, help="seconds between checks (--wait)")
    p.add_argument("--no-probe", action="store_true", help="check the record only")
    p.add_argument("--expected-gpus", type=int, default=None,
                   help="fewer visible GPUs than this is CRITICAL (default: any number)")
    p.set_defaults(handler=_gate)
    p = nsub.add_parser(
        "fail", help="count a failed launch of this node (N within the window quarantine)",
        description=f"Exit {EXIT_REFUSED} when this failure quarantined the node. Exit code "
                    f"{EXIT_PEER_CRITICAL} (another node's GPU was CRITICAL) is not counted.")
    _node(p)
    p.add_argument("--reason", default=None, help="what failed (shown in the record)")
    p.add_argument("--exit-code", type=int, default=None, help="torchrun's exit code")
    p.set_defaults(handler=_fail)

    nodes = sub.add_parser("nodes", help="quarantined nodes: list, clear")
    ssub = nodes.add_subparsers(dest="nodes_command", metavar="ACTION", required=True)
    p = ssub.add_parser("ls", help="quarantine records that hold now, with their reasons")
    _redis(p)
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    p.set_defaults(handler=_ls)
    p = ssub.add_parser("clear", help="remove a node's record so it may join again")
    p.add_argument("node", help="the node's name, as `nodes ls` shows it")
    _redis(p)
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    p.set_defaults(handler=_clear)
