"""What the training loop reports about itself: ``session.log(loss=...)``, read by the
dashboard (loss, steps/s, ETA, and when the trainer last made progress).

Redis, not the checkpoint: the dashboard needs it between checkpoints (a checkpoint
every few minutes would show a loss minutes old and could not tell a hung trainer
from a slow one), and a retention that prunes manifests must not take the curve with
it. It stays small and bounded: one capped stream per run, beside the run's attempts
(:mod:`trainguard.core.incidents`), in the dataset's hash slot::

    tg:{D}:trainlog:<R>   STREAM  entries {"doc": JSON}, trimmed to about KEPT entries

    doc  {"version", "attempt", "rank", "step", "at" (unix s), "values" {name: float},
          "steps_left" (loop iterations to the end of the run's epochs; null: unknown)}

A writer sends at most one entry per ``INTERVAL_S`` (the newest values win), so a loop
that logs every step costs one Redis write a second, not one a step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.core.streams import PREFIX

__all__ = ["INTERVAL_S", "KEPT", "MAX_VALUES", "TRAINLOG_VERSION", "TrainLogError", "as_floats", "check_values",
           "decode", "encode", "trainlog_key"]

TRAINLOG_VERSION = 1
KEPT = 2000
"""Entries kept per run (``XADD MAXLEN ~``): over half an hour at one a second."""
INTERVAL_S = 1.0
"""Seconds between two entries of one writer."""
MAX_VALUES = 16
"""Values per entry: a log line, not a metrics store."""


class TrainLogError(TrainguardError, ValueError):
    """A value ``session.log`` cannot record."""


def trainlog_key(dataset: str, run: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:trainlog:{run}"


def check_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values, checked but not converted (a clear error: what was expected, what
    was found). A one-element tensor is kept as it is (detached): converting it is a
    device sync, done only when an entry is written (:func:`as_floats`)."""
    if len(values) > MAX_VALUES:
        raise TrainLogError(f"session.log takes at most {MAX_VALUES} values, got "
                            f"{len(values)}: log the few a person watches (loss, lr, ...)")
    out: dict[str, Any] = {}
    for name, value in values.items():
        numel = getattr(value, "numel", None)
        if callable(numel) and numel() == 1:
            detach = getattr(value, "detach", None)
            out[name] = detach() if callable(detach) else value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
        else:
            raise TrainLogError(f"session.log({name}=...) expects a number or a one-element "
                                f"tensor, got {type(value).__name__}"
                                f"{' of ' + str(numel()) + ' elements' if callable(numel) else ''}: "
                                "pass a float (e.g. loss.item()) or the loss tensor itself")
    return out


def as_floats(values: Mapping[str, Any]) -> dict[str, float]:
    """Checked values as floats (NaN and infinities as NaN: JSON has no infinity)."""
    out = {}
    for name, value in values.items():
        number = float(value)
        out[name] = number if math.isfinite(number) else float("nan")
    return out


def encode(doc: Mapping[str, Any]) -> dict[str, str]:
    values = {k: (None if isinstance(v, float) and math.isnan(v) else v)
              for k, v in doc["values"].items()}
    return {"doc": json.dumps({"version": TRAINLOG_VERSION, **doc, "values": values},
                              separators=(",", ":"))}


def decode(fields: Mapping[Any, Any]) -> dict[str, Any] | None:
    """An entry's document; None when unreadable or of a newer version (skipped: the
    dashboard shows what it can)."""
    raw = fields.get(b"doc", fields.get("doc"))
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(doc, dict) or int(doc.get("version") or 0) > TRAINLOG_VERSION:
        return None
    return doc
