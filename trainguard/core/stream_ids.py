"""Stream IDs of the stream contract (:mod:`trainguard.core.streams` re-exports every
name here): the ``<ms>-<seq>`` form Redis orders by, the deterministic IDs of
replayable sources (``<epoch + 1>-<index>``), and offsets (partition -> last ID) as
they go into JSON manifests and Redis hashes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard.core.errors import ContractError

__all__ = [
    "ZERO_ID", "StreamId", "format_id", "id_epoch_index", "make_id", "max_id", "min_id",
    "offsets_from_wire", "offsets_to_wire", "parse_id",
]

StreamId = tuple[int, int]
"""A parsed stream ID ``(ms, seq)``; tuples compare the way Redis orders IDs."""

ZERO_ID = "0-0"


def make_id(epoch: int, index: int) -> str:
    """The deterministic ID of record ``index`` of a partition in ``epoch`` (from 0)."""
    if epoch < 0 or index < 0:
        raise ContractError(f"epoch and index must be >= 0, got epoch={epoch} index={index}")
    return f"{epoch + 1}-{index}"


_U64_DIGITS = 20
_U64 = 2**64


def parse_id(stream_id: str | bytes) -> StreamId:
    """``b"3-17"`` -> ``(3, 17)``: ASCII digits, each part below 2^64 (as Redis has
    them). Raises ContractError on anything else."""
    text = stream_id.decode("utf-8", "replace") if isinstance(stream_id, bytes) else stream_id
    ms, sep, seq = text.partition("-")
    for part in (ms, seq):
        if not sep or not part.isascii() or not part.isdigit() or len(part) > _U64_DIGITS \
                or int(part) >= _U64:
            raise ContractError(
                f"stream ID {text[:60]!r} is not of the form '<ms>-<seq>' (ASCII digits, each "
                "below 2^64)"
            )
    return int(ms), int(seq)


def format_id(parsed: StreamId) -> str:
    return f"{parsed[0]}-{parsed[1]}"


def id_epoch_index(stream_id: str | bytes) -> tuple[int, int]:
    """For deterministic IDs: ``"3-17"`` -> ``(epoch=2, index=17)``."""
    ms, seq = parse_id(stream_id)
    if ms < 1:
        raise ContractError(f"stream ID {stream_id!r} is not a deterministic ID (ms >= 1)")
    return ms - 1, seq


def max_id(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if parse_id(a) >= parse_id(b) else b


def min_id(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if parse_id(a) <= parse_id(b) else b


def offsets_to_wire(offsets: Mapping[int, str]) -> dict[str, str]:
    """Offsets as they go into JSON manifests and Redis hashes: ``{"7": "1-42"}``."""
    return {str(p): str(i) for p, i in sorted(offsets.items())}


def offsets_from_wire(raw: Mapping[Any, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else str(k)
        val = v.decode() if isinstance(v, bytes) else str(v)
        parse_id(val)
        out[int(key)] = val
    return out
