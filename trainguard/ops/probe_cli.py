"""``trainguard probe``: the GPU health node daemon (:mod:`trainguard.ops.probe`).

Registered without importing the probe (or torch, through ``trainer_client``): the
daemon is imported when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.core import settings
from trainguard.ops.exits import EXIT_GPU_CRITICAL

__all__ = ["register"]

DEFAULT_PORT = 9435


def _run(args: argparse.Namespace) -> int:
    from trainguard.ops.probe import run_probe

    return run_probe(args)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "probe",
        help="GPU health node daemon (/metrics, /healthz) or a one-shot check",
        description="Probes every --interval-s seconds and serves GET /metrics (Prometheus) "
                    "and GET /healthz (503 while CRITICAL); --once probes once and exits "
                    f"0 for OK and WARN, {EXIT_GPU_CRITICAL} for CRITICAL.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--interval-s", type=float, default=15.0, help="seconds between probes")
    p.add_argument("--once", action="store_true", help="probe once, print, exit with status")
    p.add_argument("--json", action="store_true", help="with --once: print JSON")
    p.add_argument("--fail-on-warn", action="store_true",
                   help=f"with --once: exit {EXIT_GPU_CRITICAL} on WARN as well")
    p.add_argument("--expected-gpus", type=int, default=None,
                   help="fewer visible GPUs than this is CRITICAL (default: any number)")
    p.add_argument("--temperature-warn-c", type=float, default=None,
                   help="WARN at or above this GPU temperature (default 85)")
    p.add_argument("--temperature-critical-c", type=float, default=None,
                   help="CRITICAL at or above this GPU temperature (default 95)")
    p.add_argument("--quarantine", action="store_true",
                   help="daemon: on the first CRITICAL report, write this node's quarantine "
                        "record (trainguard nodes ls) so that its gate refuses it")
    p.add_argument("--node", default=None,
                   help=f"node id for --quarantine (default: ${settings.NODE_ID_ENV}, else "
                        "the host name)")
    p.add_argument("--redis-url", default=None,
                   help=f"Redis for --quarantine (default: ${settings.REDIS_URL_ENV} or "
                        f"{settings.DEFAULT_REDIS_URL})")
    p.set_defaults(handler=_run)
