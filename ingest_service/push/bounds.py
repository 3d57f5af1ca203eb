"""A pushed record's shape, bounded before or while it is decoded.

Decoding is one C call per record (msgpack's ``unpack``, JSON's ``raw_decode``) that
holds the event loop, and its cost is in the containers it builds, not in the bytes:
4 MiB of msgpack is four million empty lists (6.5 s of the loop with the garbage
collector running, then 200 MB). So every record is bounded to
``max_record_containers`` lists and maps, nested at most ``max_record_depth`` deep
(ten thousand containers decode in about 2 ms), and a record past either is refused
with 413 before the rest of it is built:

- msgpack: the decoder calls :class:`MsgpackBounds`'s hooks as each container is
  completed (``list_hook``, ``object_hook``), which count them and raise once the
  record passes a bound: the decode stops there.
- JSON: the C decoder has no hook for lists, so :func:`scan_json` reads the record's
  brackets first (strings skipped by one regular expression each), in slices, and
  refuses it before it is decoded. A body whose brackets all together are within
  both bounds needs no scan (:func:`needs_scan`).
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any

from ingest_service.errors import IngestError, PushTooLargeError

__all__ = ["BoundsOverflow", "MsgpackBounds", "RecordShapeError", "needs_scan", "scan_json"]


class RecordShapeError(PushTooLargeError):
    """A record holds more containers, or nests deeper, than the service decodes."""


def _too_many(where: str, limit: int) -> RecordShapeError:
    return RecordShapeError(
        f"{where} holds more than {limit} lists and maps: the limit is {limit} per record "
        "(max_record_containers; decoding more would hold the service); send flatter "
        "records, e.g. numbers as one bytes or array value")


def _too_deep(where: str, limit: int) -> RecordShapeError:
    return RecordShapeError(
        f"{where} nests lists and maps more than {limit} deep: the limit is {limit} "
        "(max_record_depth); send flatter records")


_CONTAINERS = frozenset({list, dict})


class BoundsOverflow(IngestError):
    """Raised through the msgpack decoder by a hook; :meth:`MsgpackBounds.error` turns
    it into the 413. Not a ``PushRejectedError`` nor a ``ValueError``: the decode's
    handlers for malformed bodies must not catch it first."""

    def __init__(self, deep: bool) -> None:
        self.deep = deep


class MsgpackBounds:
    """``list_hook`` and ``object_hook`` of an Unpacker: count the containers of the
    value being decoded and their nesting, and stop the decode past either bound.

    The decoder completes containers in post-order (children before their parent), so
    the depths of the containers not yet claimed by a parent sit on a stack, and a
    completed container claims the top ``k`` of them, ``k`` being how many of its
    items are containers (counted in C: ``map(type, ...)``)."""

    def __init__(self, max_containers: int, max_depth: int) -> None:
        self.max_containers, self.max_depth = max_containers, max_depth
        self.count = 0
        self._depths: list[int] = []

    def reset(self, max_containers: int | None = None, max_depth: int | None = None) -> None:
        self.count = 0
        self._depths.clear()
        if max_containers is not None:
            self.max_containers = max_containers
        if max_depth is not None:
            self.max_depth = max_depth

    def _done(self, items: Any) -> None:
        self.count += 1
        if self.count > self.max_containers:
            raise BoundsOverflow(False)
        k = sum(map(_CONTAINERS.__contains__, map(type, items)))
        depth = 1
        if k:
            children = self._depths[-k:]
            del self._depths[-k:]
            depth += max(children)
            if depth > self.max_depth:
                raise BoundsOverflow(True)
        self._depths.append(depth)

    def list_hook(self, value: list[Any]) -> list[Any]:
        # An empty list is counted here, one call (a bomb is millions of them: the two
        # calls and the item count of _done made this hook 16x the decode's own cost).
        if value:
            self._done(value)
            return value
        self.count += 1
        if self.count > self.max_containers:
            raise BoundsOverflow(False)
        self._depths.append(1)
        return value

    def object_hook(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._done(value.values())
        return value

    def error(self, exc: BoundsOverflow, where: str) -> RecordShapeError:
        """The 413 for an overflow raised through the decoder at ``where``."""
        return (_too_deep(where, self.max_depth) if exc.deep
                else _too_many(where, self.max_containers))


def needs_scan(text: str | bytes | bytearray, max_containers: int, max_depth: int, start: int = 0,
               end: int | None = None) -> bool:
    """Whether a JSON text (or ``text[start:end]``) may hold a record past a bound: not
    when all its brackets together (counted in C, no copy) are within both."""
    end = len(text) if end is None else end
    if not isinstance(text, str):
        opened = text.count(b"[", start, end) + text.count(b"{", start, end)
    else:
        opened = text.count("[", start, end) + text.count("{", start, end)
    return opened > min(max_containers, max_depth)


_TOKENS: dict[type, Any] = {str: re.compile(r'[\[\]{}"]'), bytes: re.compile(rb'[\[\]{}"]')}
_STRING_RESTS: dict[type, Any] = {str: re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S),
                 bytes: re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.S)}
_KINDS: dict[str | bytes, int] = {'"': 0, b'"': 0, "[": 1, b"[": 1, "{": 1, b"{": 1,
                                  "]": 2, b"]": 2, "}": 2, b"}": 2}
_SCAN_TOKENS = 4096
"""Brackets and strings read per slice of a scan (a millisecond or two)."""


def scan_json(text: str | bytes | bytearray, start: int, where: str, max_containers: int, max_depth: int,
              end: int | None = None) -> Generator[None, None, int | None]:
    """Read the JSON value at ``text[start]`` (a ``[`` or ``{``; text or UTF-8 bytes)
    as far as its end (or ``end``), yielding every few thousand tokens, and return the
    position just after it; raises RecordShapeError once it holds more than
    ``max_containers`` containers or nests deeper than ``max_depth``. A value that is
    not well-formed is left for the decoder to report (None: no end found)."""
    depth = containers = 0
    pos, budget = start, _SCAN_TOKENS
    end = len(text) if end is None else end
    kind_of = str if isinstance(text, str) else bytes  # a bytearray reads as bytes do
    search, rest = _TOKENS[kind_of].search, _STRING_RESTS[kind_of].match
    while True:
        m = search(text, pos, end)
        if m is None:
            return None
        kind, pos = _KINDS[m.group()], m.end()
        if kind == 0:
            s = rest(text, pos, end)
            if s is None:
                return None
            pos = s.end()
        elif kind == 1:
            depth += 1
            containers += 1
            if containers > max_containers:
                raise _too_many(where, max_containers)
            if depth > max_depth:
                raise _too_deep(where, max_depth)
        else:
            depth -= 1
            if depth <= 0:
                return pos
        budget -= 1
        if not budget:
            budget = _SCAN_TOKENS
            yield
