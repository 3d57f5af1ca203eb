"""What the integrations forward to ``session.log``: the numbers a framework logged
(Lightning's ``callback_metrics`` and the step's loss, the HF Trainer's ``logs``),
without the ones the run page could not show (strings, lists, tensors of many
elements), and at most as many as a trainlog entry holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard.core.trainlog import MAX_VALUES

__all__ = ["scalars"]


def scalars(*sources: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scalar values of ``sources`` (the first source wins a name), numbers and
    one-element tensors kept as they are (converting a tensor is a device sync: the
    session does it when it writes an entry)."""
    out: dict[str, Any] = {}
    for source in sources:
        for name, value in (source or {}).items():
            if len(out) >= MAX_VALUES:
                return out
            if name in out or not isinstance(name, str):
                continue
            numel = getattr(value, "numel", None)
            if (callable(numel) and numel() == 1) or (
                    isinstance(value, (int, float)) and not isinstance(value, bool)):
                out[name] = value
    return out
