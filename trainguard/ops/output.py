"""What the commands print: plain tables for people, JSON for scripts, a progress bar
on a terminal."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Progress", "cell", "emit", "table"]


def cell(value: Any) -> str:
    """A value as a table cell, control characters escaped (``\\x1b``): a name read
    from a manifest or Redis must not move the cursor or recolour a terminal."""
    text = "-" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain left-aligned text table (no dependencies, pipes well)."""
    cells = [[cell(h) for h in header]] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells
    )


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """``data`` as indented JSON with ``--json``, else ``human(data)``."""
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(human(data))


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.enabled = sys.stderr.isatty()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            width = 30
            filled = int(width * self.done / self.total)
            sys.stderr.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
