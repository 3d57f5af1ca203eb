"""Node quarantine: the Redis records that keep a bad node out of a job.

A node (a machine; its id is ``$TRAINGUARD_NODE_ID``, else its host name) is
quarantined when its GPU health probe reports CRITICAL (the trainer on that node, or
``trainguard node gate`` before a launch), or when it failed ``max_failures`` times
within ``window_s`` (``trainguard node fail`` after a failed launch). While its record
holds, :func:`check_admission` raises :class:`NodeQuarantinedError`: the launcher's
gate refuses to start torchrun there, and a rendezvous backend given
:func:`check_admission` as its admission callable refuses the join.

Layout (one hash slot, ``{nodes}``, so that a Redis Cluster keeps it on one server)::

    tg:{nodes}:quarantine          hash: node id -> the record's JSON (below)
    tg:{nodes}:failures:<node>     sorted set: one member per failure, score = time

A record is versioned JSON: ``version``, ``node``, ``reason``, ``source`` (``probe``,
``trainer``, ``failures``), ``report`` (the probe report's dict, or null),
``created_at`` and ``expires_at`` (Unix seconds from the Redis server's clock, so the
nodes' own clocks do not matter). An expired record is no record: reads ignore it and
remove it. Clearing deletes it (and the node's failure count).

The operations take a *sync* redis-py client (any object with its methods): the
foundation imports no client library; the admin API reads the same keys with its
asyncio client (:mod:`ingest_service.service.nodes`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, cast, get_args

from trainguard.core import settings
from trainguard.core.errors import TrainguardError
from trainguard.core.streams import PREFIX, ContractError, check_name

__all__ = [
    "DELETE_IF_UNCHANGED",
    "QUARANTINE_VERSION",
    "NodeQuarantinedError",
    "QuarantineDoc",
    "QuarantinePolicy",
    "QuarantineRecord",
    "SOURCES",
    "Source",
    "WrittenSource",
    "check_admission",
    "clear",
    "failures_key",
    "list_quarantined",
    "node_id",
    "quarantine",
    "quarantine_key",
    "record_failure",
    "server_time",
    "sort_entries",
]

QUARANTINE_VERSION = 1
Source = Literal["probe", "trainer", "failures", "unreadable"]
"""Who wrote a record: the gate's probe, the trainer on a CRITICAL report, the
failure count; ``unreadable`` stands for a stored record that does not parse (made
when listing, never written)."""
WrittenSource = Literal["probe", "trainer", "failures"]
"""The sources :func:`quarantine` writes."""
SOURCES: tuple[WrittenSource, ...] = get_args(WrittenSource)


class QuarantineDoc(TypedDict):
    """A record as JSON data: what Redis holds, ``GET /admin/nodes`` sends (with
    ``remaining_s`` added) and ``trainguard nodes ls --json`` prints; the OpenAPI
    schema is tested against these keys (test_document_shapes)."""

    version: int
    node: str
    reason: str
    source: Source
    report: dict[str, Any] | None
    created_at: float
    expires_at: float


def _source(value: object) -> Source:
    # A stored record is untyped JSON: a source outside the type makes it unreadable.
    if value not in get_args(Source):
        raise ValueError(f"source {value!r}, expected one of {get_args(Source)}")
    return cast(Source, value)


def quarantine_key() -> str:
    return f"{PREFIX}:{{nodes}}:quarantine"


def failures_key(node: str) -> str:
    return f"{PREFIX}:{{nodes}}:failures:{check_name('node', node)}"


@dataclass(frozen=True)
class QuarantinePolicy:
    """How long a record holds and how many failures within a window make one.

    ``quarantine_s <= 0`` disables quarantine: nothing is written, and admission
    still refuses a node whose existing record holds (clear those by hand)."""

    quarantine_s: float = 3600.0
    max_failures: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    @property
    def enabled(self) -> bool:
        return self.quarantine_s > 0

    @classmethod
    def from_env(cls) -> QuarantinePolicy:
        """From ``TRAINGUARD_QUARANTINE_S``, ``TRAINGUARD_QUARANTINE_FAILURES`` and
        ``TRAINGUARD_QUARANTINE_WINDOW_S`` (see :mod:`trainguard.core.settings`)."""
        s, n, w = settings.quarantine()
        return cls(quarantine_s=s, max_failures=n, window_s=w)


@dataclass(frozen=True)
class QuarantineRecord:
    node: str
    reason: str
    source: Source
    created_at: float
    expires_at: float
    report: Mapping[str, Any] | None = None
    version: int = QUARANTINE_VERSION

    def to_json(self) -> str:
        doc: QuarantineDoc = {
            "version": self.version, "node": self.node, "reason": self.reason,
            "source": self.source, "report": None if self.report is None else dict(self.report),
            "created_at": self.created_at, "expires_at": self.expires_at,
        }
        return json.dumps(doc, sort_keys=True)

    def to_dict(self) -> QuarantineDoc:
        # The JSON round trip, so that the report holds only JSON types.
        return cast(QuarantineDoc, json.loads(self.to_json()))

    @classmethod
    def parse(cls, raw: str | bytes) -> QuarantineRecord:
        """One record as stored; raises ContractError naming what is wrong."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise TypeError(f"a {type(doc).__name__}, not an object")
            if doc.get("version") != QUARANTINE_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {QUARANTINE_VERSION}")
            report = doc.get("report")
            return cls(node=str(doc["node"]), reason=str(doc["reason"]),
                       source=_source(doc["source"]), created_at=float(doc["created_at"]),
                       expires_at=float(doc["expires_at"]),
                       report=dict(report) if isinstance(report, dict) else None)
        except (ValueError, TypeError, KeyError) as exc:
            raise ContractError(
                f"quarantine record {raw!r:.200} is not valid ({type(exc).__name__}: {exc}): "
                f"expected the JSON of trainguard.core.quarantine version {QUARANTINE_VERSION}; "
                "`trainguard nodes clear <node>` removes it") from exc

    def holds(self, now: float) -> bool:
        return now < self.expires_at

    def describe(self, now: float | None = None) -> str:
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.expires_at))
        left = "" if now is None else f", {max(0.0, self.expires_at - now):.0f} s from now"
        return (f"node {self.node!r} is quarantined ({self.source}): {self.reason}; "
                f"since {time.strftime('%H:%M:%S UTC', time.gmtime(self.created_at))}, "
                f"until {until}{left}")


class NodeQuarantinedError(TrainguardError, PermissionError):
    """The node's quarantine record holds: it may not join a job until it expires or
    is cleared. ``record`` is the :class:`QuarantineRecord`."""

    def __init__(self, record: QuarantineRecord, now: float) -> None:
        super().__init__(
            f"{record.describe(now)}. Expected no quarantine record for this node in "
            f"Redis hash {quarantine_key()} field {record.node!r}. Fix the node (see the "
            f"probe report: `trainguard nodes ls --json`), then clear it with "
            f"`trainguard nodes clear {record.node}` (or the dashboard); otherwise it "
            "is admitted again once the record expires."
        )
        self.record = record


def server_time(r: Any) -> float:
    """Unix seconds on the Redis server (one clock for every node)."""
    sec, usec = r.time()
    return float(sec) + float(usec) / 1e6


def node_id(explicit: str | None = None) -> str:
    """``explicit``, else ``$TRAINGUARD_NODE_ID``, else the host name: checked to be a
    plain name (it is part of Redis keys)."""
    return check_name("node", settings.node_id(explicit))


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _read(r: Any, node: str, now: float) -> QuarantineRecord | None:
    raw = r.hget(quarantine_key(), node)
    if raw is None:
        return None
    rec = QuarantineRecord.parse(raw)
    if rec.holds(now):
        return rec
    # Expired: remove it, unless it was replaced meanwhile (a new quarantine wins).
    _delete_if_unchanged(r, node, raw)
    return None


# Lua (KEYS[1] the hash, ARGV node and value): delete a field only if it still holds
# the value read, so that removing an expired record never removes a newer one.
DELETE_IF_UNCHANGED = ("if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then "
                       "return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0")


def _delete_if_unchanged(r: Any, node: str, raw: Any) -> None:
    r.eval(DELETE_IF_UNCHANGED, 1, quarantine_key(), node, raw)


def check_admission(r: Any, node: str) -> None:
    """The admission callable: None when ``node`` may join, else raises
    :class:`NodeQuarantinedError` (which record, why, until when, how to clear). A
    record that does not parse refuses too (ContractError, naming how to clear it):
    a node is never admitted on a record nobody can read. Redis errors propagate."""
    check_name("node", node)
    now = server_time(r)
    rec = _read(r, node, now)
    if rec is not None:
        raise NodeQuarantinedError(rec, now)


def quarantine(
    r: Any,
    node: str,
    reason: str,
    *,
    source: WrittenSource,
    report: Mapping[str, Any] | None = None,
    policy: QuarantinePolicy | None = None,
) -> QuarantineRecord | None:
    """Write ``node``'s quarantine record (replacing an older one); returns it, or
    None when the policy disables quarantine."""
    check_name("node", node)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    policy = policy or QuarantinePolicy.from_env()
    if not policy.enabled:
        return None
    now = server_time(r)
    rec = QuarantineRecord(node=node, reason=reason, source=source, created_at=now,
                           expires_at=now + policy.quarantine_s, report=report)
    r.hset(quarantine_key(), node, rec.to_json())
    return rec


# Lua (KEYS[1] the node's failures; ARGV now, a unique member, the window's start,
# the key's TTL): add this failure, forget those before the window, count the rest.
# One script, so concurrent reports of one node never lose a count (and it runs on
# one slot of a Redis Cluster, where a MULTI over keys may not).
_COUNT_FAILURE = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return redis.call('ZCARD', KEYS[1])
"""


def record_failure(
    r: Any, node: str, reason: str, *, policy: QuarantinePolicy | None = None
) -> tuple[int, QuarantineRecord | None]:
    """Count a failure of ``node``; the failures within the policy's window, and the
    quarantine record written when they reached ``max_failures`` (else None). The
    count starts over once a quarantine is written."""
    policy = policy or QuarantinePolicy.from_env()
    key = failures_key(node)
    now = server_time(r)
    count = int(r.eval(_COUNT_FAILURE, 1, key, now, f"{now:.6f}:{uuid.uuid4().hex[:8]}",
                       now - policy.window_s, max(1, math.ceil(policy.window_s))))
    if count < policy.max_failures:
        return count, None
    rec = quarantine(r, node, f"{count} failures within {policy.window_s:g} s, the last: "
                     f"{reason}", source="failures", policy=policy)
    if rec is not None:
        r.delete(key)
    return count, rec


def sort_entries(
    entries: Mapping[Any, Any], now: float
) -> tuple[list[QuarantineRecord], list[tuple[str, Any]]]:
    """The quarantine hash's ``entries`` (field -> stored JSON) at ``now``: the
    records that hold, by node id, and the (field, raw value) of the expired ones (to
    delete with :data:`DELETE_IF_UNCHANGED`). An unreadable value is listed as a record
    of source ``unreadable`` (an operator must see it, and clear it)."""
    holding, expired = [], []
    for field, raw in sorted(entries.items()):
        try:
            rec = QuarantineRecord.parse(raw)
        except ContractError:
            holding.append(QuarantineRecord(
                node=_text(field), reason=f"unreadable record {raw!r:.80}", source="unreadable",
                created_at=0.0, expires_at=0.0))
            continue
        if rec.holds(now):
            holding.append(rec)
        else:
            expired.append((_text(field), raw))
    return holding, expired


def list_quarantined(r: Any) -> list[QuarantineRecord]:
    """Every record that holds now, by node id (expired ones are removed)."""
    holding, expired = sort_entries(r.hgetall(quarantine_key()) or {}, server_time(r))
    for field, raw in expired:
        _delete_if_unchanged(r, field, raw)
    return holding


def clear(r: Any, node: str) -> bool:
    """Remove ``node``'s record and failure count; True if a record was there."""
    check_name("node", node)
    removed = bool(r.hdel(quarantine_key(), node))
    r.delete(failures_key(node))
    return removed
