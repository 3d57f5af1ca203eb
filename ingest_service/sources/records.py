"""What a source yields: a record to append or a bad record to dead-letter.

The one home of a record's shape (payload, position, shared small fields) and of the
checks every reader applies alike (required fields, msgpack-representable, size), so
the file, Hugging Face and WebDataset readers build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from trainguard.core import streams

__all__ = ["BadRecord", "GoodRecord", "MSGPACK", "Meta", "RAW", "SourceItem", "check_size",
           "fixed_size", "required_fields", "structured"]


Meta = tuple[tuple[bytes, bytes], ...]
"""The small fields a record shares with the other records of its file (kind, dtype,
shape), as (name, value) pairs: one tuple object for many records, so that the
producer encodes it once, not per record."""


class GoodRecord(NamedTuple):
    """A record to append: its payload (``F_DATA``), its source position (``F_POS``)
    and the shared small fields. A named tuple because records are made by the
    hundred thousand a second: ``tuple.__new__`` builds them from C, without a Python
    ``__init__`` per record."""

    data: bytes
    pos: bytes
    meta: Meta

    @property
    def size(self) -> int:
        """Payload bytes: what backlog and buffer bounds count."""
        return len(self.data)

    @property
    def fields(self) -> dict[bytes, bytes]:
        """The stream entry, as the consumers will read it."""
        return {**dict(self.meta), streams.F_DATA: self.data, streams.F_POS: self.pos}


@dataclass(frozen=True, slots=True)
class BadRecord:
    pos: str
    reason: str
    """One of ``streams.DL_REASONS``."""
    detail: str
    payload: bytes


SourceItem = GoodRecord | BadRecord

MSGPACK: Meta = ((streams.F_KIND, streams.KIND_MSGPACK),)
RAW: Meta = ((streams.F_KIND, streams.KIND_RAW),)
def required_fields(spec: streams.DatasetSpec) -> tuple[str, ...]:
    return tuple(spec.options.get("required_fields", ()))


def fixed_size(meta: Meta) -> int:
    """``streams.record_size`` of a record of ``meta`` without its payload and position
    values (each record adds ``len(data) + len(pos)``)."""
    return sum(len(k) + len(v) for k, v in meta) + len(streams.F_DATA) + len(streams.F_POS)


def check_size(spec: streams.DatasetSpec, pos: str, meta: Meta, data: bytes) -> SourceItem:
    pos_b = pos.encode()
    size = fixed_size(meta) + len(data) + len(pos_b)
    if size > spec.max_record_bytes:
        return BadRecord(pos, "oversized", f"{size} bytes, limit {spec.max_record_bytes}", data)
    return GoodRecord(data, pos_b, meta)


def structured(spec: streams.DatasetSpec, pos: str, value: Any, raw: bytes) -> SourceItem:
    required = required_fields(spec)
    if required:
        if not isinstance(value, dict):
            return BadRecord(pos, "schema", f"expected an object, got {type(value).__name__}", raw)
        missing = [k for k in required if k not in value]
        if missing:
            return BadRecord(pos, "schema", f"missing fields {missing}", raw)
    try:
        packed = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return BadRecord(pos, "schema", f"not representable in msgpack: {exc}", raw)
    return check_size(spec, pos, MSGPACK, packed)
