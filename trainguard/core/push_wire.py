"""The push HTTP contract: what the push client (:mod:`trainguard.push`) sends and the
push route (:mod:`ingest_service.service.push_route`) answers, written once.

``POST /v1/datasets/<name>/records?producer_id=<id>&seq=<n>`` with a batch of records;
200 ``{"appended", "partition", "seq", "mark", "count", ...}``; 409 with an error
``code`` of :data:`OUT_OF_ORDER` (and the producer's ``mark``), :data:`BATCH_MISMATCH`
or :data:`LOST_ACKNOWLEDGED_DATA` (with ``mark`` and ``acknowledged``); 429 and 503
with ``Retry-After``. A push at :data:`PROBE_SEQ` appends nothing: it asks the mark.
Standard library only: the push client imports nothing heavier.
"""

from __future__ import annotations

import urllib.parse

__all__ = ["BATCH_MISMATCH", "LOST_ACKNOWLEDGED_DATA", "MAX_SEQ", "MSGPACK_TYPE",
           "OUT_OF_ORDER", "PARAMS", "PROBE_SEQ", "PRODUCER_ID", "RECORDS_ROUTE", "SEQ",
           "records_path"]

RECORDS_ROUTE = "/v1/datasets/{name}/records"
PRODUCER_ID, SEQ = "producer_id", "seq"
PARAMS = frozenset({PRODUCER_ID, SEQ})
MSGPACK_TYPE = "application/msgpack"

MAX_SEQ = 2**53 - 2
"""The largest seq of a batch (Lua compares seqs as doubles: exact up to 2^53)."""
PROBE_SEQ = MAX_SEQ + 1
"""Never appended: a push with this seq is answered 409 with the producer's mark, which
is how a (re)starting client learns where it stands."""

OUT_OF_ORDER = "out_of_order"
BATCH_MISMATCH = "batch_mismatch"
LOST_ACKNOWLEDGED_DATA = "lost_acknowledged_data"


def records_path(dataset: str) -> str:
    """The route of ``dataset``'s pushes, the name quoted."""
    return RECORDS_ROUTE.format(name=urllib.parse.quote(dataset, safe=""))
