"""torch's ``RendezvousBackend`` on Redis: the rendezvous state under one key.

The state is a hash ``{t: token, s: state bytes}`` at ``keys.state_key(run_id)``,
changed only by one Lua compare-and-set (so it is one command on one slot of a Redis
Cluster). The fencing token is a random value each writer draws, never a counter:
after a failover that lost the newest write, a counter would hand out again the
number of the lost write, and a node still holding that number would overwrite a
state it never read; a random token cannot come back.

A write whose reply was lost (a failover between the script and its answer) is
retried with the same new token, and the script takes "the stored token is already
mine" as success, so a retry never reads its own write as a conflict.
"""

from __future__ import annotations

import secrets

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from trainguard.elastic import keys
from trainguard.elastic._redis import Connection

__all__ = ["DEFAULT_STATE_TTL_S", "RedisRendezvousBackend"]

DEFAULT_STATE_TTL_S = 3600.0
"""The state key expires this long after its last write. Every live node writes a
keep-alive every few seconds, so only a run whose agents are all gone expires; a
later run may then reuse its id."""

# KEYS[1] the state hash; ARGV: expected token ('' = no state yet), new token, state,
# ttl in ms. Answers {1, token, state} when written, {0, token, state} with what is
# stored when not, {0} when nothing is stored and a token was expected.
_SET_STATE = """
local cur = redis.call('HGET', KEYS[1], 't')
if cur and cur == ARGV[2] then
  return {1, cur, redis.call('HGET', KEYS[1], 's')}
end
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  redis.call('HSET', KEYS[1], 't', ARGV[2], 's', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {1, ARGV[2], ARGV[3]}
end
if not cur then
  return {0}
end
return {0, cur, redis.call('HGET', KEYS[1], 's')}
"""


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class RedisRendezvousBackend(RendezvousBackend):
    """The state of rendezvous ``run_id`` in the Redis of ``conn``."""

    def __init__(self, conn: Connection, run_id: str, *,
                 state_ttl_s: float = DEFAULT_STATE_TTL_S) -> None:
        self._conn = conn
        self._key = keys.state_key(run_id)
        self._ttl_ms = int(state_ttl_s * 1000)
        self._script = conn.script(_SET_STATE)

    @property
    def name(self) -> str:
        return "trainguard"  # torch checks it against --rdzv-backend

    def get_state(self) -> tuple[bytes, Token] | None:
        token, state = self._conn.call(self._conn.client.hmget, self._key, ["t", "s"])
        if token is None or state is None:
            return None
        return _raw(state), _raw(token)

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        expected = token if isinstance(token, bytes) else b""
        if token is not None and not isinstance(token, bytes):
            # Not a token of ours (torch hands back only what get/set returned):
            # it can match nothing, so answer with what is stored.
            got = self.get_state()
            return None if got is None else (got[0], got[1], False)
        mine = secrets.token_hex(16).encode()
        reply = self._conn.call(self._script, keys=[self._key],
                                args=[expected, mine, state, self._ttl_ms])
        if len(reply) < 3:
            return None
        written, stored_token, stored_state = reply
        return bytes(stored_state), bytes(stored_token), bool(written)
