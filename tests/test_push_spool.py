"""A push body bound for a decode worker never becomes one buffer of the service's:
it is written chunk by chunk into an anonymous file the worker receives
(:mod:`ingest_service.push.spool`), against a real Redis, the real app and real worker
processes, the client in a process of its own (so its buffers are not the service's).

Properties, measured exactly in bytes (``tracemalloc``: every Python allocation of
the service's process, whatever thread), not by time:
- while an 8 MiB body is read, handed to a worker and refused there (413: a record
  past the container bound), the service's traced memory rises by at most
  ``_BOUND`` (2 MiB: aiohttp's read buffers and one transport read, a few hundred KiB;
  the body, a quarter of it, never), with a declared length and with none (chunked:
  the first ``inline_bytes`` gathered, then moved to the file once);
- a chunked body that passes ``inline_bytes`` midway lands whole, in order, once: the
  bytes gathered before the move and those written after it are the body.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tracemalloc
from pathlib import Path

import msgpack
import pytest

from ingest_service.push.body import BodyLimits
from ingest_service.service.push_route import PUSH_KEY
from tests.servers import RedisServer
from tests.test_push_decode import TOKEN, URL, _dataset, _service, _stream

MIB = 1024 * 1024
_BOUND = 2 * MIB
_CLIENT = """
import http.client, json, sys
host, port, path, content_type, body_file, chunked = sys.argv[1:7]
body = open(body_file, "rb").read()
conn = http.client.HTTPConnection(host, int(port), timeout=120)
headers = {"Content-Type": content_type, "Authorization": "Bearer %s" % sys.argv[7]}
if chunked == "1":
    parts = (body[i:i + 65536] for i in range(0, len(body), 65536))
    conn.request("POST", path, body=parts, headers=headers, encode_chunked=True)
else:
    conn.request("POST", path, body=body, headers=headers)
resp = conn.getresponse()
print(json.dumps({"status": resp.status, "body": resp.read().decode()}))
"""


async def _push_from_another_process(port: int, producer: str, content_type: str, body: Path,
                                     *, chunked: bool) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLIENT, "127.0.0.1", str(port),
        f"{URL}?producer_id={producer}&seq=0", content_type, str(body), "1" if chunked else "0",
        TOKEN, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, "the client process failed"
    return json.loads(out)  # type: ignore[no-any-return]


def _bomb(size: int) -> bytes:
    """A JSON array of records of 10,001 empty lists each (one past the bound): about
    ``size`` bytes, refused (413) by the worker at its first record."""
    record = "[" + ",".join(["[]"] * 10_001) + "]"
    return ("[" + ",".join([record] * (size // len(record))) + "]").encode()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_bound_for_a_worker_is_never_held_whole_by_the_service(
        redis_server: RedisServer, tmp_path: Path, chunked: bool) -> None:
    """An 8 MiB body read, handed to a decode worker and refused there raises the
    service's traced memory by at most 2 MiB (a buffer of the body would be 8)."""
    r = await _dataset(redis_server.url)
    body = tmp_path / "bomb.json"
    body.write_bytes(_bomb(8 * MIB))
    assert body.stat().st_size > 3 * _BOUND
    async with _service(redis_server) as client:
        port = client.server.port
        assert port is not None
        # A worker started first: what is measured is a body's path, not a process start.
        warm = await _push_from_another_process(port, "w-0", "application/json",
                                                _small(tmp_path), chunked=False)
        assert warm["status"] == 200, warm
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            answer = await _push_from_another_process(port, "w-1", "application/json", body,
                                                      chunked=chunked)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    assert answer["status"] == 413, answer
    assert "10000" in str(answer["body"]).replace(",", ""), answer  # the container bound
    assert peak <= _BOUND, f"the service's traced memory rose by {peak} bytes"
    assert await _stream(r, "w-1") == []
    await r.aclose()


def _small(tmp_path: Path) -> Path:
    """A JSON body of 600 small lists: over inline_values, so a worker parses it."""
    path = tmp_path / "small.json"
    path.write_bytes(json.dumps([[i] for i in range(600)]).encode())
    return path


async def test_a_chunked_body_moved_to_the_file_midway_lands_whole_in_order(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A chunked msgpack body of 300 distinct 1 KiB records (over inline_bytes midway)
    is parsed by a worker and its 300 records land once, in order."""
    r = await _dataset(redis_server.url)
    records = [bytes([i % 251]) * 1000 + i.to_bytes(4, "big") for i in range(300)]
    path = tmp_path / "records.msgpack"
    path.write_bytes(msgpack.packb(records))
    assert path.stat().st_size > BodyLimits().inline_bytes
    async with _service(redis_server) as client:
        port = client.server.port
        assert port is not None
        answer = await _push_from_another_process(port, "w-2", "application/msgpack", path,
                                                  chunked=True)
        assert client.app[PUSH_KEY].decoders.pids  # type: ignore[union-attr]
    assert answer["status"] == 200, answer
    assert json.loads(str(answer["body"]))["count"] == 300
    assert await _stream(r, "w-2") == records
    await r.aclose()
