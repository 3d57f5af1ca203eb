"""A ``torch.distributed.Store`` kept in Redis: the rendezvous' store, on no node.

torch's c10d rendezvous keeps its store in a TCPStore served by one agent; when that
node dies the survivors lose the store with it. :class:`RedisStore` keeps every key
in Redis (one server or a cluster), namespaced by run id, so any set of surviving
agents can go on. It is what torch's elastic agent asks of a store: ``set``, ``get``
(blocks until the key exists), ``add``, ``compare_set``, ``wait``, ``check``,
``delete_key``, ``num_keys`` and the timeout (``set_timeout`` is the base class's:
c10d's ``PrefixStore`` sets it on the C++ side, so it is read back through
``self.timeout``, never shadowed). ``multi_get``/``multi_set`` are the base class's
loops over ``get``/``set``.

Values are bytes; ``add`` keeps a decimal integer, as TCPStore does, so a ``get`` of
a counter reads ``b"3"``. Every key expires ``key_ttl_s`` after its last write, so a
finished or abandoned run leaves nothing behind for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from trainguard.elastic import keys
from trainguard.elastic._redis import Connection
from trainguard.elastic.errors import StoreTimeoutError

T = TypeVar("T")

__all__ = ["DEFAULT_KEY_TTL_S", "RedisStore"]

DEFAULT_KEY_TTL_S = 86400.0

POLL_MIN_S, POLL_MAX_S = 0.002, 0.05
"""A blocking ``get``/``wait`` polls from 2 ms, doubling to 50 ms: a barrier of a
few agents completes within tens of milliseconds of its last arrival."""

# compare_set as c10d's TCPStore does it: a missing key is set only when ``expected``
# is empty (and then the answer is ``desired``; a missing key with another
# expectation answers ``expected``); a present key is replaced when it equals
# ``expected``; the answer is always the value now stored.
_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  if ARGV[1] == '' then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return ARGV[2]
  end
  return ARGV[1]
end
if cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
return cur
"""


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, list):  # c10d hands std::vector<uint8_t> over as a list of ints
        return bytes(value)
    raise TypeError(f"a store value is bytes or str, got {type(value).__name__}")


class RedisStore(dist.Store):
    """The keys of run ``run_id`` in the Redis of ``conn``.

    ``timeout`` is how long ``get`` and ``wait`` wait for a key (c10d may change it
    with ``set_timeout``). Thread-safe: c10d and the agent's keep-alive thread call
    it concurrently."""

    def __init__(self, conn: Connection, run_id: str, *,
                 timeout: timedelta = timedelta(seconds=300),
                 key_ttl_s: float = DEFAULT_KEY_TTL_S) -> None:
        super().__init__()
        keys.run_tag(run_id)  # refuse a bad run id here, not at the first key
        self._conn = conn
        self._run_id = run_id
        self._ttl_ms = int(key_ttl_s * 1000)
        self._cas = conn.script(_COMPARE_SET)
        self.set_timeout(timeout)

    def _timeout_s(self) -> float:
        # The base class's timeout (set_timeout, from Python or C++), not in torch's stubs.
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]
        return timeout.total_seconds()

    def _key(self, key: str) -> str:
        return keys.store_key(self._run_id, key)

    def set(self, key: str, value: Any) -> None:
        self._conn.call(self._conn.client.set, self._key(key), _bytes(value), px=self._ttl_ms)

    def get(self, key: str) -> bytes:
        name = self._key(key)
        limit = self._timeout_s()

        def value() -> bytes | None:
            found = self._conn.call(self._conn.client.get, name)
            return None if found is None else _bytes(found)

        return self._poll(value, limit, f"store key {key!r} of rendezvous {self._run_id!r} "
                          f"did not appear within {limit:.0f} s; an agent that should have "
                          "set it is gone or late: check the other nodes' logs")

    def _poll(self, probe: Callable[[], T | None], limit_s: float, timed_out: str) -> T:
        """``probe()``'s first answer that is not None, asked with a backoff from
        POLL_MIN_S to POLL_MAX_S; StoreTimeoutError(``timed_out``) after ``limit_s``."""
        deadline = time.monotonic() + limit_s
        pause = POLL_MIN_S
        while (answer := probe()) is None:
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(timed_out)
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        return answer

    def add(self, key: str, amount: int) -> int:
        # One MULTI on one key (one slot on a cluster): the counter and its expiry
        # together. A retry after a lost reply could count twice; c10d's barriers
        # count each agent once per round, and a reply lost mid-round is followed by
        # a failed round anyway (its peers time out and rendezvous again).
        def incr() -> int:
            pipe = self._conn.client.pipeline(transaction=True)
            pipe.incrby(self._key(key), int(amount))
            pipe.pexpire(self._key(key), self._ttl_ms)
            return int(pipe.execute()[0])

        return self._conn.call(incr)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        answer = self._conn.call(self._cas, keys=[self._key(key)],
                                 args=[_bytes(expected), _bytes(desired), self._ttl_ms])
        return bytes(answer)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self._timeout_s()
        self._poll(lambda: True if self.check(keys) else None, limit,
                   f"store keys {keys!r} of rendezvous {self._run_id!r} did not all appear "
                   f"within {limit:.0f} s; an agent that should have set them is gone or "
                   "late: check the other nodes' logs")

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        names = [self._key(k) for k in keys]
        # One EXISTS of several keys is one command on one slot (the run's tag).
        found = self._conn.call(self._conn.client.exists, *names)
        return int(found) == len(names)

    def delete_key(self, key: str) -> bool:
        return bool(self._conn.call(self._conn.client.delete, self._key(key)))

    def num_keys(self) -> int:
        pattern = keys.store_pattern(self._run_id)

        def count() -> int:
            return sum(1 for _ in self._conn.client.scan_iter(match=pattern, count=1000))

        return self._conn.call(count)

    # The C++ Store calls these names; pybind's trampoline looks them up as written.
    deleteKey = delete_key
    getNumKeys = num_keys

    def __repr__(self) -> str:
        return f"RedisStore(run_id={self._run_id!r})"
