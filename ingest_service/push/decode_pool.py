"""Push bodies decoded off the event loop: a small bounded pool of decode worker
processes (:mod:`~ingest_service.push.decode_worker`), and which bodies go to it.

A body goes to the pool (:func:`needs_worker`) when it is over ``inline_bytes`` or
holds more than ``inline_values`` values (msgpack: its headers walked, payloads
skipped in C; JSON: its brackets counted, an estimate that at worst sends a small body
to a worker);
the others are parsed on the loop in slices, as before
(:func:`~ingest_service.push.body.parse_records_sliced`): for those, the trip to a
worker costs more of the loop than their parse.

The pool holds at most ``decode_workers`` processes, started as demand needs them;
a request waits for a free one, and when ``decode_queue`` requests already wait, it
is answered 503 busy with ``Retry-After`` (the body budget bounds the bytes waiting,
this their number). The loop's share of a body is its chunks written into a
:class:`~ingest_service.push.spool.SpooledBody` as they arrive (by
:func:`~ingest_service.push.read.read_body`), one small message handing the worker
that file's descriptor over its Unix socket (no copy of the body, no pickle of it),
and the records' frames unpickled one per loop turn.

A worker that dies while it decodes (kill -9, out of memory) is a 503 for that
request (nothing was appended: the producer resends the same seq), one that takes
over ``decode_timeout_s`` is killed and the request is a 413; either way the pool
starts another and the service goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import sys
from pathlib import Path

import msgpack

from ingest_service.errors import (
    MalformedPushError,
    PushBusyError,
    PushRejectedError,
    PushTooLargeError,
)
from ingest_service.push import decode_worker as wire
from ingest_service.push.body import JSON_TYPE, MSGPACK_TYPES, NDJSON_TYPE, ParsedBatch
from ingest_service.push.entries import Body
from ingest_service.push.limits import BodyLimits
from ingest_service.push.spool import SpooledBody

__all__ = ["DecodePool", "needs_worker"]

log = logging.getLogger(__name__)

_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_REFUSALS: dict[int, type[PushRejectedError]] = {400: MalformedPushError, 413: PushTooLargeError}
_ROOT = str(Path(__file__).resolve().parents[2])


def needs_worker(body: Body, content_type: str, limits: BodyLimits) -> bool:
    """Whether ``body`` is parsed by a worker rather than on the loop: over
    ``inline_bytes``, or holding more than ``inline_values`` values (msgpack: walked
    header by header, payloads skipped in C, up to that many) or JSON brackets."""
    if len(body) > limits.inline_bytes:
        return True
    if content_type in MSGPACK_TYPES:
        return _msgpack_values(body, limits.inline_values) > limits.inline_values
    if content_type in (JSON_TYPE, NDJSON_TYPE):
        return body.count(b"[") + body.count(b"{") > limits.inline_values
    return False


def _msgpack_values(body: Body, budget: int) -> int:
    """How many values (containers and scalars, at every depth) a msgpack body holds,
    counted up to ``budget + 1``: each container's header is read and each scalar or
    payload skipped (``Unpacker.skip``, in C), nothing built. Counting the bytes that
    may head a container instead sent most bodies of random ``bin`` payloads to a
    worker: one byte in seven of them looks like one. A malformed body counts as far
    as it goes; the parse on the loop then says what is wrong (400)."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(body), 1))
    unpacker.feed(body)
    pending, seen = 1, 0
    try:
        while pending and seen <= budget:
            head = body[unpacker.tell()]
            seen, pending = seen + 1, pending - 1
            if head in _ARRAY_HEADS:
                pending += unpacker.read_array_header()
            elif head in _MAP_HEADS:
                pending += 2 * unpacker.read_map_header()
            else:
                unpacker.skip()
    except (IndexError, ValueError, msgpack.OutOfData, msgpack.FormatError, msgpack.StackError):
        pass
    return seen


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        """``sock``: the service's end of the worker's stdin, a Unix socket (jobs, each
        with its body's file descriptor)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def parse(self, body: Body | SpooledBody, content_type: str, max_record_bytes: int,
                    limits: BodyLimits) -> ParsedBatch:
        stdout = self.proc.stdout
        assert stdout is not None
        spool = body if isinstance(body, SpooledBody) else SpooledBody.of(body)
        header = pickle.dumps((content_type, max_record_bytes, limits))
        try:
            await _send_with_fd(self.sock, wire.JOB.pack(len(header), len(spool)) + header,
                                spool.fileno())
        finally:
            # The worker has its own descriptor now (in flight or received): closing ours
            # leaves the last one to the worker, which frees the pages when it is done.
            # Should the worker be dead, the body is not needed again (503: resent).
            spool.close()
        records: list[dict[bytes, bytes]] = []
        sizes: list[int] = []
        while True:
            kind, length = wire.FRAME.unpack(await stdout.readexactly(wire.FRAME.size))
            payload = pickle.loads(await stdout.readexactly(length))
            if kind == wire.RECORDS:
                records += payload[0]
                sizes += payload[1]
                await asyncio.sleep(0)  # a frame unpickled: the loop's turn
            elif kind == wire.DONE:
                return ParsedBatch(records, sizes, payload[0], payload[1])
            else:
                status, message = payload
                raise _REFUSALS.get(status, MalformedPushError)(message)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.sock.close()


async def _send_with_fd(sock: socket.socket, message: bytes, fd: int) -> None:
    """``message`` on the non-blocking ``sock``, ``fd`` passed with its first bytes
    (``SCM_RIGHTS``). A job's message is under a kilobyte into a socket the idle worker
    has emptied: it goes at once, but a full socket is waited for, never spun on."""
    loop = asyncio.get_running_loop()
    sent = 0
    while sent < len(message):
        try:
            if sent == 0:
                sent = socket.send_fds(sock, [message], [fd])
            else:
                sent += sock.send(message[sent:])
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock.fileno(), _wake, writable)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class DecodePool:
    """At most ``limits.decode_workers`` decode processes, one body each at a time."""

    def __init__(self, limits: BodyLimits, *, retry_after_s: int = 1) -> None:
        self.limits = limits
        self.retry_after_s = retry_after_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._live: set[_Worker] = set()
        self._starting = 0
        self._waiting = 0
        self._closed = False
        self._reaping: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (tests and operators: which to look at)."""
        return sorted(w.pid for w in self._live)

    async def _start(self) -> None:
        """Start one worker and put it among the idle ones once it is ready."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        worker: _Worker | None = None
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "ingest_service.push.decode_worker",
                    stdin=theirs.fileno(), stdout=asyncio.subprocess.PIPE, env=env,
                    limit=2 * wire.FRAME_BYTES)
            finally:
                theirs.close()  # the worker's end is the worker's alone
            worker = _Worker(proc, ours)
            assert proc.stdout is not None
            ready = await proc.stdout.readexactly(len(wire.READY))
            if ready != wire.READY or self._closed:
                worker.kill()
                await proc.wait()
                return
        except (OSError, asyncio.IncompleteReadError) as exc:
            if worker is not None:
                worker.kill()
            log.error("a push decode worker did not start (%s: %s); bodies wait for the "
                      "next one", type(exc).__name__, exc)
            return
        finally:
            self._starting -= 1
            if worker is None:
                ours.close()
        self._live.add(worker)
        self._idle.put_nowait(worker)

    def _grow(self) -> None:
        if self._closed or len(self._live) + self._starting >= self.limits.decode_workers:
            return
        self._starting += 1
        task = asyncio.ensure_future(self._start())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _take(self) -> _Worker:
        full = len(self._live) + self._starting >= self.limits.decode_workers
        if self._idle.empty() and full:
            # Every worker busy (or starting for a body that waits already).
            if self._waiting - self._starting >= self.limits.decode_queue:
                raise PushBusyError(
                    f"all {self.limits.decode_workers} push decode workers are busy and "
                    f"{self._waiting} bodies wait for one (the bound, decode_queue): retry "
                    f"after {self.retry_after_s} s")
        elif self._idle.empty():
            self._grow()  # a worker more for this body, which waits for it
        self._waiting += 1
        try:
            async with asyncio.timeout(self.limits.decode_wait_s):
                return await self._idle.get()
        except TimeoutError:
            raise PushBusyError(
                f"no push decode worker was free within {self.limits.decode_wait_s:g} s: "
                "retry later") from None
        finally:
            self._waiting -= 1

    def _drop(self, worker: _Worker) -> None:
        """Kill ``worker`` (its state is unknown), reap it, and start another."""
        worker.kill()
        self._live.discard(worker)
        task = asyncio.ensure_future(worker.proc.wait())
        self._reaping.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._reaping.discard)  # type: ignore[arg-type]
        self._grow()

    async def parse(self, body: Body | SpooledBody, content_type: str, max_record_bytes: int
                    ) -> ParsedBatch:
        """``body``'s records as stream entries, parsed by a worker; raises what
        :func:`~ingest_service.push.body.parse_records` raises (400, 413), PushBusyError
        (503) when the pool is full or the worker died, PushTooLargeError (413) when it
        took over ``decode_timeout_s``. A :class:`SpooledBody` is closed once handed to
        the worker (the caller may close it again: nothing)."""
        worker, size = await self._take(), len(body)
        keep = False
        try:
            async with asyncio.timeout(self.limits.decode_timeout_s):
                batch = await worker.parse(body, content_type, max_record_bytes, self.limits)
            keep = True
            return batch
        except PushRejectedError:
            keep = True  # refused by the parse: the worker answered whole, and goes on
            raise
        except TimeoutError:
            raise PushTooLargeError(
                f"decoding this body took over {self.limits.decode_timeout_s:g} s (the "
                "limit, decode_timeout_s): it was stopped and nothing was appended; send "
                "smaller or flatter batches") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            code = await _exit_code(worker)
            log.error("push decode worker %d ended (exit code %s) while decoding a %d-byte "
                      "body; starting another", worker.pid, code, size)
            raise PushBusyError(
                f"the decode worker ended (exit code {code}) while decoding this body: nothing "
                f"was appended; resend the same batch under the same seq") from exc
        finally:
            if keep and not self._closed:
                self._idle.put_nowait(worker)
            else:
                self._drop(worker)

    async def close(self) -> None:
        """Stop every worker (killed, their job socket closed) and wait for them."""
        self._closed = True
        for worker in list(self._live):
            worker.kill()
        waits = [w.proc.wait() for w in self._live] + list(self._reaping)
        self._live.clear()
        await asyncio.gather(*waits, return_exceptions=True)


async def _exit_code(worker: _Worker) -> int | None:
    """The dead worker's exit status (negative: the signal), if it is known soon."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            return await worker.proc.wait()
    return None
