"""The ``trainguard`` command line.

Each part contributes its own subcommands through a ``register(subparsers)`` function
in its ``cli`` module, listed in ``_PARTS``; this module only wires them together, so
that ``trainguard --version`` stays fast and no part imports another's dependencies.

Exit codes: 0 success, 1 the operation failed, 2 bad usage or input,
3 not found, 4 refused (conflict, not allowed), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from trainguard import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130

_PARTS: tuple[str, ...] = ("trainguard.admin_cli", "ingest_service.cli", "trainer_client.cli")
"""Modules with a ``register(subparsers)`` function, e.g. ``"ingest_service.cli"``."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Keeps long training runs alive through crashes.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _PARTS:
        importlib.import_module(name).register(sub)
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
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
