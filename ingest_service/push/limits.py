"""A push body's limits (:class:`BodyLimits`: size, records, timeouts, the memory
held in flight, one record's containers and depth) and the 413 of too many records.
:mod:`ingest_service.push.body` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass

from ingest_service.errors import PushTooLargeError

__all__ = ["BodyLimits", "too_many"]


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 16 * 1024 * 1024
    max_records: int = 10_000
    chunk_timeout_s: float = 10.0
    total_timeout_s: float = 60.0
    big_body_bytes: int = 1024 * 1024
    """Bodies above this parse one at a time, at ``big_body_share`` of the loop."""
    big_body_share: float = 0.25
    heavy_slice_cpu_ms: float = 1.0
    """A parsing slice that took more CPU than this (a record of thousands of lists:
    one record is decoded in one call, 3-6 ms) rests after it at ``big_body_share``,
    whatever the body's size: a request needing several loop steps then waits behind
    one such slice, not one per step."""
    max_inflight_bytes: int = 64 * 1024 * 1024
    """All push bodies in memory at once, from reading until appended; past it a request
    is answered 503 (busy)."""
    token_share: float = 0.25
    """The share of ``max_inflight_bytes`` one producer token may hold (at least two
    bodies of ``max_bytes``, at most all): one token's slow bodies cannot hold all the
    room, and one big body does not stop the token's other producers."""
    min_rate_bytes_s: int = 128 * 1024
    """After ``min_rate_grace_s``, a body must have arrived at this rate on average, else
    408: a body trickled to hold room gives it back within seconds."""
    min_rate_grace_s: float = 2.0
    max_record_containers: int = 10_000
    """Lists and maps in one record (413 past it, before the rest is decoded)."""
    max_record_depth: int = 64
    """How deep one record's lists and maps may nest (413 past it)."""
    decode_workers: int = 2
    """Decode worker processes (:mod:`~ingest_service.push.decode_pool`); 0: every body
    is parsed on the event loop, in slices."""
    decode_queue: int = 16
    """Bodies that may wait for a busy pool's next free worker (503 busy past it)."""
    decode_timeout_s: float = 30.0
    """A worker decoding one body longer than this is killed: 413."""
    decode_wait_s: float = 30.0
    """How long a body waits for a free worker (one starting included): 503 busy after."""
    inline_bytes: int = 128 * 1024
    """Bodies up to this size holding at most ``inline_values`` values (msgpack; JSON:
    brackets) are parsed on the loop: for them the trip to a worker costs the loop more."""
    inline_values: int = 500

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_records < 1:
            raise ValueError(f"push limits must be >= 1, got {self}")
        if self.max_inflight_bytes < self.max_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must hold at least one body of "
                f"max_bytes ({self.max_bytes})"
            )
        if self.decode_workers < 0 or self.decode_queue < 0 or min(self.decode_timeout_s, self.decode_wait_s) <= 0:
            raise ValueError(f"decode_workers and decode_queue must be >= 0 and "
                             f"decode_timeout_s, decode_wait_s > 0, got {self}")
        if not 0 < self.token_share <= 1 or self.min_rate_bytes_s < 0:
            raise ValueError(f"token_share must be in (0, 1] and min_rate_bytes_s >= 0, got {self}")

    @property
    def token_inflight_bytes(self) -> int:
        """What one producer token may hold of ``max_inflight_bytes``."""
        return min(self.max_inflight_bytes,
                   max(2 * self.max_bytes, int(self.max_inflight_bytes * self.token_share)))


def too_many(limits: BodyLimits, found: str) -> PushTooLargeError:
    return PushTooLargeError(
        f"the batch holds {found} records: the limit is {limits.max_records} per request; "
        "send smaller batches"
    )
