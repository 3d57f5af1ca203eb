"""The ``trainguard`` command line: one parser, one exit-code map.

Each command module contributes its subcommands through ``register(subparsers)``;
this module wires them together and runs the chosen handler. Handlers return an exit
code or raise; what they raise is mapped by :mod:`trainguard.ops.exits` (the table is
printed by ``trainguard --help``). Command modules import their part (redis, torch,
aiohttp) inside their handlers, so that building the parser, ``--version`` and
``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainguard import __version__
from trainguard.core import settings
from trainguard.ops import (
    ckpt_cli,
    datasets_cli,
    demo,
    ingest_cli,
    nodes_cli,
    probe_cli,
    runs_cli,
)
from trainguard.ops.exits import EPILOG, EXIT_USAGE, describe, exit_code

__all__ = ["build_parser", "main"]

_COMMANDS = (datasets_cli, ckpt_cli, runs_cli, ingest_cli, probe_cli, nodes_cli, demo)
"""Modules with a ``register(subparsers)`` function, in the order --help lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Keeps long training runs alive through crashes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(handler(args) or 0)
    except (Exception, KeyboardInterrupt) as exc:
        code = exit_code(exc)
        if code is None:
            raise  # a bug, not an expected failure: keep its traceback
        redis_url = settings.redis_url(args.redis_url) if "redis_url" in args else None
        print(f"trainguard: {describe(exc, redis_url=redis_url)}", file=sys.stderr)
        return code
