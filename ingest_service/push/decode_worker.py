"""A decode worker: a process of its own that parses push bodies for the service
(``python -m ingest_service.push.decode_worker``, started and replaced by
:mod:`~ingest_service.push.decode_pool`).

Why a process: a record of ten thousand lists is one C call of msgpack's or JSON's
decoder, 2-9 ms that hold the GIL, so a thread decoding it holds the event loop's
thread as long. In a process of its own, the decode holds nothing of the service's.

The wire, over the worker's stdin (a Unix socket) and stdout (its stderr is the
service's log):

- the worker writes ``READY`` (one byte) once imported, then serves one job at a time;
- a job: ``>IQ`` (header length, body length) and the header (a pickle of the content
  type, ``max_record_bytes`` and the :class:`~ingest_service.push.limits.BodyLimits`),
  with the descriptor of the file holding the body
  (:class:`~ingest_service.push.spool.SpooledBody`) passed beside its first bytes
  (``SCM_RIGHTS``): the worker reads the body from it and closes it, the last holder,
  so the file's pages are freed here, not on the service's loop;
- the answer: frames of ``>BI`` (kind, length) and a payload. ``RECORDS``: a pickle of
  (entries, sizes) of at most ``FRAME_RECORDS`` records or about ``FRAME_BYTES``
  (the service unpickles one frame per loop turn); then ``DONE``: a pickle of
  (data_bytes, digest); or, instead of ``DONE``, ``REFUSED``: a pickle of (HTTP status,
  message), the 400 or 413 the parse raised. The records are the stream entries
  :func:`~ingest_service.push.body.parse_records` built, already validated: the loop
  only appends them.

The worker runs at nice 10, below the service's loop. The garbage collector is
paused while a body is parsed (decoded values hold no
cycles: reference counting frees them) and the imported modules are frozen out of
its passes. End of stdin (the service ended, even by kill -9) ends the worker.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import struct
import sys
from typing import BinaryIO

from ingest_service.errors import PushRejectedError
from ingest_service.push.body import parse_records

__all__ = ["DONE", "FRAME", "FRAME_BYTES", "FRAME_RECORDS", "JOB", "READY", "RECORDS",
           "REFUSED", "main"]

READY = b"R"
JOB = struct.Struct(">IQ")
FRAME = struct.Struct(">BI")
RECORDS, DONE, REFUSED = 1, 2, 3
_NICE = 10
FRAME_RECORDS = 256
FRAME_BYTES = 256 * 1024
"""A frame's records: its unpickling on the service's loop stays well under a
millisecond (a frame of 256 KiB of 1 KB records: about 0.25 ms)."""


def _read_exactly(stream: BinaryIO | socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = (stream.recv_into(view[got:]) if isinstance(stream, socket.socket)
             else stream.readinto(view[got:]))  # type: ignore[attr-defined]
        if not k:
            return None  # the service went away
        got += k
    view.release()
    return buf


def _receive_job(sock: socket.socket) -> tuple[bytearray, bytearray] | None:
    """The next job's header and body (None: the service went away). The body's file
    is read whole and closed here."""
    data, fds, _, _ = socket.recv_fds(sock, JOB.size, 1)
    if not data:
        return None
    head = _read_exactly(sock, JOB.size - len(data)) if len(data) < JOB.size else b""
    if head is None or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if head is None:
            return None
        raise RuntimeError(f"a decode job came with {len(fds)} file descriptors, not 1: "
                           "the service and this worker do not speak the same wire")
    head_len, body_len = JOB.unpack(bytes(data) + bytes(head))
    with open(fds[0], "rb", buffering=0) as body_file:  # closed: ours was the last
        header = _read_exactly(sock, head_len)
        body_file.seek(0)  # the service's writes moved the offset this file shares
        body = _read_exactly(body_file, body_len)
    if header is None:
        return None
    if body is None:
        raise RuntimeError(f"the body's file holds fewer than the {body_len} bytes the job "
                           "says: the service and this worker do not speak the same wire")
    return header, body


def _frame(out: BinaryIO, kind: int, payload: object) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(FRAME.pack(kind, len(data)))
    out.write(data)


def serve(inp: socket.socket, out: BinaryIO) -> None:
    """Answer jobs from ``inp`` on ``out`` until ``inp`` ends."""
    out.write(READY)
    out.flush()
    while True:
        job = _receive_job(inp)
        if job is None:
            return
        header, body = job
        content_type, max_record_bytes, limits = pickle.loads(header)
        try:
            batch = parse_records(body, content_type, max_record_bytes, limits)
        except PushRejectedError as exc:
            del body
            _frame(out, REFUSED, (exc.status, str(exc)))
            out.flush()
            continue
        del body
        records, sizes = batch.records, batch.sizes
        start, size = 0, 0
        for i, n in enumerate(sizes):
            size += n
            if i + 1 - start >= FRAME_RECORDS or size >= FRAME_BYTES:
                _frame(out, RECORDS, (records[start:i + 1], sizes[start:i + 1]))
                start, size = i + 1, 0
        if start < len(records):
            _frame(out, RECORDS, (records[start:], sizes[start:]))
        _frame(out, DONE, (batch.data_bytes, batch.digest))
        out.flush()
        del batch, records


def main() -> None:
    # Ctrl-C at the service's terminal reaches its whole process group: the service
    # stops its workers itself (and a worker whose stdin ends stops anyway).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below the service in the scheduler's eyes: on a machine whose cores are all busy,
    # a worker decoding a bomb in a loop took the service's core turns, and /healthz
    # waited behind the scheduler instead of behind the GIL (at load 11-17, a /healthz
    # up to 0.7 s beside a client sending 2.9 MiB JSON bodies without a rest).
    os.nice(_NICE)
    gc.freeze()
    try:
        serve(socket.socket(fileno=sys.stdin.fileno()), sys.stdout.buffer)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the service went away mid-answer (killed, or it timed this body out)


if __name__ == "__main__":
    main()
