"""A push producer that keeps the service's exactly-once contract: ``Producer``.

For processes that generate records live (RL rollout workers, evaluators) and send
them to a push dataset of ``trainguard serve``::

    from trainguard.push import Producer

    with Producer("http://127.0.0.1:8080", "rollouts", "actor-3", token=TOKEN) as p:
        for episode in run_episodes():
            p.send(episode.records)          # one batch; returns once it is in

The contract it keeps (see :mod:`ingest_service.push.ingest`): batches of one producer_id
are numbered 0, 1, 2, ... without gaps and sent one at a time; a batch is resent,
with the same seq and the same records, until it is answered 200, so a lost reply
or a service or Redis restart never loses or duplicates it. On a 409 the service says
its mark: when the producer starts (or restarts) it asks the mark with an empty probe
and continues from ``mark + 1`` (:meth:`Producer.resume`), so a restarted worker does
not resend what is in. Retries wait with jittered exponential backoff, honouring
``Retry-After`` (429 backlog full, 503 Redis down); the waits are those of
:attr:`Producer.retry_policy`, the one description of backoff
(:mod:`trainguard.core.backoff`). A batch that was never
acknowledged (``send`` raised :class:`PushError`) is kept and resent whole, under its
seq, before the next records are taken: a seq never carries two batches (the service
refuses that with 409 ``batch_mismatch``). When Redis lost batches the service had
acknowledged (restarted from an older snapshot, or empty), ``send`` raises
:class:`PushDataLostError` naming their seqs, then goes on from the service's mark.

Depends only on the standard library and msgpack: no aiohttp, redis or torch.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from trainguard.core import push_wire
from trainguard.core.backoff import Backoff, RetryPolicy
from trainguard.core.errors import TrainguardError

__all__ = ["Producer", "PushDataLostError", "PushError", "PushRefusedError", "PushRejectedError",
           "PushReply"]

_RETRIED = frozenset({408, 429, 502, 503, 504})


class PushError(TrainguardError):
    """Base of the push client's errors."""


class PushDataLostError(PushError):
    """Redis lost batches of this producer that the service had acknowledged:
    ``lost_seqs`` are their seqs, ``mark`` the producer's mark now (None: none). Their
    records are not in the dataset; the producer goes on from ``mark + 1``."""

    def __init__(self, message: str, *, lost_seqs: range, mark: int | None):
        super().__init__(message)
        self.lost_seqs, self.mark = lost_seqs, mark


class PushRejectedError(PushError, ValueError):
    """The service rejected a batch for good (4xx other than 408/409/429): resending
    the same request cannot succeed. ``status`` and ``code`` are the service's: the
    client side of the service's :class:`ingest_service.errors.PushRejectedError`
    (one name for the one 4xx on both sides)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"push rejected ({status} {code}): {message}")
        self.status, self.code = status, code


PushRefusedError = PushRejectedError
"""The former name of :class:`PushRejectedError`, kept so that existing callers'
``except PushRefusedError`` still catches it."""


@dataclass(frozen=True)
class PushReply:
    appended: bool
    seq: int
    count: int
    partition: int
    first_id: str | None
    last_id: str | None


class Producer:
    """Sends batches of one producer_id to one dataset, exactly once each.

    ``next_seq`` is the seq the next :meth:`send` uses; ``resume()`` (called by the
    first send) sets it from the service's mark. Not thread-safe: one Producer per
    thread, each with its own producer_id.

    ``max_attempts`` tries per batch; the first retry waits ``backoff_s`` plus up to
    ``backoff_s`` of jitter, each next one twice as long, at most ``max_backoff_s``
    (a longer ``Retry-After`` wins): :attr:`retry_policy` holds these."""

    def __init__(self, base_url: str, dataset: str, producer_id: str, *, token: str | None,
                 timeout_s: float = 30.0, max_attempts: int = 20, backoff_s: float = 0.05,
                 max_backoff_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url {base_url!r} is not valid: expected http(s)://host[:port]")
        self._url = url
        self._path = f"{url.path.rstrip('/')}{push_wire.records_path(dataset)}"
        self.dataset, self.producer_id = dataset, producer_id
        self._headers = {"Content-Type": push_wire.MSGPACK_TYPE}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}: a batch is "
                             "sent at least once")
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        # Jitter as large as the first wait spreads producers that failed together
        # (the former shape was the doubled wait times uniform(0.5, 1.5)).
        self.retry_policy = RetryPolicy(attempts=max_attempts, timeout_s=None,
                                        wait_initial_s=backoff_s, wait_max_s=max_backoff_s,
                                        wait_jitter_s=backoff_s)
        self.next_seq: int | None = None
        self._acked: int | None = None
        """The last seq the service acknowledged to this Producer (or its mark at resume)."""
        self._pending: tuple[int, bytes] | None = None
        self._conn: http.client.HTTPConnection | None = None

    # -- plumbing ---------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = (http.client.HTTPSConnection if self._url.scheme == "https"
                   else http.client.HTTPConnection)
            self._conn = cls(self._url.hostname or "", self._url.port, timeout=self.timeout_s)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, seq: int, body: bytes) -> tuple[int, dict[str, Any], str | None]:
        query = urllib.parse.urlencode({push_wire.PRODUCER_ID: self.producer_id,
                                        push_wire.SEQ: seq})
        conn = self._connection()
        try:
            conn.request("POST", f"{self._path}?{query}", body=body, headers=self._headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            self.close()  # a fresh connection for the retry
            raise
        if resp.getheader("Connection", "").lower() == "close":
            self.close()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {}
        return resp.status, payload if isinstance(payload, dict) else {}, resp.getheader("Retry-After")

    @staticmethod
    def _wait(backoff: Backoff, retry_after: str | None) -> None:
        delay = backoff.next_wait_s()
        if retry_after and retry_after.isascii() and retry_after.isdigit():
            delay = max(delay, float(retry_after))
        time.sleep(delay)

    # -- the contract -----------------------------------------------------------------

    def resume(self) -> int:
        """Ask the service where this producer stands; sets and returns ``next_seq``.

        A probe at the largest seq is refused with 409 and the mark (nothing is
        appended: a skip-ahead is never stored). Raises PushDataLostError when the
        service answers that Redis lost batches it acknowledged (``next_seq`` is set
        to go on after the mark all the same)."""
        status, payload, _ = self._send_with_retries(push_wire.PROBE_SEQ, msgpack.packb([None]))
        error = payload.get("error", {})
        if status != 409 or "mark" not in error:
            raise PushError(f"the service did not say this producer's mark (answer {status}: "
                            f"{error or payload})")
        mark = error["mark"]
        self.next_seq = 0 if mark is None else int(mark) + 1
        if error.get("code") == push_wire.LOST_ACKNOWLEDGED_DATA:
            self._lost(mark, int(error.get("acknowledged", -1)), str(error.get("message", "")))
        self._acked = None if mark is None else int(mark)
        return self.next_seq

    @property
    def pending(self) -> int | None:
        """The seq of a batch sent but not acknowledged (a send that raised PushError),
        which the next :meth:`send` resends whole, under that seq, before its own."""
        return None if self._pending is None else self._pending[0]

    def send(self, records: Sequence[Any]) -> PushReply:
        """Send one batch (a sequence of msgpack-able records, ``bytes`` kept raw) and
        return once the service has it all; then ``next_seq`` moves on.

        A batch that was not acknowledged (this method raised PushError after its
        retries) is kept and sent again, whole and under its seq, before these records
        are taken: a seq never carries two batches. Should that resend fail too, this
        raises before sending ``records`` (send them again)."""
        if not records:
            raise ValueError("a batch holds at least one record")
        body = msgpack.packb(list(records), use_bin_type=True)
        if self.next_seq is None:
            self.resume()
        if self._pending is not None:
            self._deliver(*self._pending)
        seq = self.next_seq
        assert seq is not None
        self._pending = (seq, body)
        return self._deliver(seq, body)

    def _deliver(self, seq: int, body: bytes) -> PushReply:
        status, payload, _ = self._send_with_retries(seq, body)
        if status == 409:
            error = payload.get("error", {})
            code, mark = error.get("code"), error.get("mark")
            if code == push_wire.LOST_ACKNOWLEDGED_DATA:
                acked = max(int(error.get("acknowledged", -1)), -1 if self._acked is None
                            else self._acked)
                self._lost(mark, acked, str(error.get("message", "")))
            if code == push_wire.BATCH_MISMATCH:
                raise PushRejectedError(409, code, str(error.get("message", error)))
            if self._acked is not None and (mark is None or int(mark) < self._acked):
                # The service acknowledged up to _acked, and now its mark is lower: Redis
                # lost them (a service that restarted too cannot tell; we can).
                self._lost(mark, self._acked,
                           f"the service's mark for this producer is {mark}")
            if mark is not None and int(mark) >= seq:  # in already (a lost reply)
                status, payload = 200, {"appended": False, "seq": seq, "count": 0}
            else:
                raise PushError(
                    f"seq {seq} of producer {self.producer_id!r} is out of order (the service's "
                    f"mark is {mark}): another process is sending as this producer_id"
                )
        self._pending = None
        self.next_seq = seq + 1
        self._acked = seq
        return PushReply(bool(payload.get("appended")), seq, int(payload.get("count", 0)),
                         int(payload.get("partition", -1)), payload.get("first_id"),
                         payload.get("last_id"))

    def _lost(self, mark: object, acknowledged: int, why: str) -> None:
        """Redis lost batches the service acknowledged: raise PushDataLostError naming
        them, and go on after the mark (the batch pending is dropped: the caller gets
        this error for it and still holds its records)."""
        m = None if mark is None else int(mark)  # type: ignore[call-overload]
        first = 0 if m is None else m + 1
        self._pending = None
        self.next_seq, self._acked = first, m
        raise PushDataLostError(
            f"batches seq {first} to {acknowledged} of producer {self.producer_id!r} were "
            f"acknowledged and are no longer in dataset {self.dataset!r}: Redis lost them "
            f"(restarted from an older snapshot or without persistence). The batch being "
            f"sent was not sent; the next send goes on from seq {first}. ({why})",
            lost_seqs=range(first, acknowledged + 1), mark=m)

    def _send_with_retries(self, seq: int, body: bytes) -> tuple[int, dict[str, Any], str | None]:
        last: BaseException | None = None
        backoff = Backoff(self.retry_policy)
        for _ in range(self.max_attempts):
            try:
                status, payload, retry_after = self._post(seq, body)
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                self._wait(backoff, None)
                continue
            if status == 200 or status == 409:
                return status, payload, retry_after
            if status in _RETRIED:
                last = PushError(f"answer {status}: {payload.get('error', payload)}")
                self._wait(backoff, retry_after)
                continue
            error = payload.get("error", {})
            raise PushRejectedError(status, str(error.get("code", "error")),
                                   str(error.get("message", payload)))
        raise PushError(f"batch seq {seq} of producer {self.producer_id!r} was not acknowledged "
                        f"after {self.max_attempts} attempts; last: {last}") from last
