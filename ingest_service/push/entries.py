"""A push body's records as they are decoded: each encoded into its stream entry at once
(:class:`Entries`), and the pacing of the parse's slices (:class:`Pacer`: when a slice
has done enough to hand the loop back). The parsers are :mod:`ingest_service.push.body`'s."""

from __future__ import annotations

from collections.abc import Generator

from ingest_service.errors import MalformedPushError, PushTooLargeError
from ingest_service.push.digest import BatchDigest
from ingest_service.push.limits import BodyLimits, too_many
from trainguard.core import streams

__all__ = ["ENCODE_SLICE_RECORDS", "SLICE_CHARS", "SLICE_TEXT", "Body", "Entries", "Pacer", "Steps",
           "label"]


def label(kind: str, where: int) -> str:
    return f"{kind} {where}"


_RAW_ENTRY_BYTES = streams.record_size(streams.encode_record(b""))
"""An entry's bytes besides its payload when the record is raw bytes."""


def _encode(value: object, kind: str, where: int, max_record_bytes: int
            ) -> tuple[dict[bytes, bytes], int]:
    if value.__class__ is bytes:  # the common case (msgpack bin): its entry as encode_record's
        fields = {streams.F_KIND: streams.KIND_RAW, streams.F_DATA: value}
        size = _RAW_ENTRY_BYTES + len(value)  # type: ignore[arg-type]
    else:
        try:
            fields = streams.encode_record(value)
        except streams.ContractError as exc:
            raise MalformedPushError(f"{label(kind, where)}: {exc}") from exc
        size = streams.record_size(fields)
    if size > max_record_bytes:
        raise PushTooLargeError(
            f"{label(kind, where)} is {size} bytes: the limit is {max_record_bytes} per record")
    return fields, size


_SLICE_RECORDS = 64
SLICE_CHARS = 128 * 1024
"""Bytes of msgpack per slice (decoding them takes microseconds)."""
SLICE_TEXT = 32 * 1024
"""Characters of JSON per slice: about a millisecond to decode (a 15 MiB body of
integer arrays in slices of 128 KiB held the loop 3 ms at a time)."""
ENCODE_SLICE_RECORDS = 256


_SLICE_CONTAINERS = 4096
"""Lists and maps decoded per slice: a decode costs what it builds, not its bytes
(128 KiB of msgpack, 13 records of 10,000 lists each, held the loop 170 ms)."""


class Pacer:
    """Says when a parsing slice has done enough work to hand the loop back."""

    def __init__(self, chars: int) -> None:
        self.limit = chars
        self.records = self.chars = self.containers = 0

    def due(self, chars: int, containers: int = 0) -> bool:
        self.records += 1
        self.chars += chars
        self.containers += containers
        if (self.records >= _SLICE_RECORDS or self.chars >= self.limit
                or self.containers >= _SLICE_CONTAINERS):
            self.records = self.chars = self.containers = 0
            return True
        return False


class Entries:
    """Each decoded record encoded into its stream entry as soon as it is decoded, so a
    big body's decoded values (lists, dicts) are garbage at once. Kept until the end
    they were promoted by the garbage collector, whose passes over the ten thousand
    lists of a 15 MiB body then took 10-30 ms of the loop each (and 60 MB of memory)."""

    def __init__(self, kind: str, max_record_bytes: int, limits: BodyLimits) -> None:
        self.kind, self.max_record_bytes, self.limits = kind, max_record_bytes, limits
        self.records: list[dict[bytes, bytes]] = []
        self.sizes: list[int] = []
        self.data_bytes = 0
        self.digest = BatchDigest()

    def add(self, value: object, where: int) -> None:
        if len(self.records) >= self.limits.max_records:
            raise too_many(self.limits, f"more than {self.limits.max_records}")
        fields, size = _encode(value, self.kind, where, self.max_record_bytes)
        self.records.append(fields)
        self.digest.add(fields)
        self.sizes.append(size)
        self.data_bytes += len(fields[streams.F_DATA])


Body = bytes | bytearray
"""A push body as read (:func:`ingest_service.push.read.read_body` fills a bytearray)."""

Steps = Generator[None, None, None]
"""A parser: adds the records to its ``Entries``, yields between slices."""
