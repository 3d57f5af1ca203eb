"""The trainguard rendezvous: torch's ``DynamicRendezvousHandler`` on Redis.

``torchrun --rdzv-backend=trainguard --rdzv-endpoint=redis://host:6379/0
--rdzv-id=JOB ...`` makes every agent keep the rendezvous in Redis: the state in
:class:`~trainguard.elastic.backend.RedisRendezvousBackend` (compare-and-set, keep-
alives and rounds as torch's handler does them), the store in
:class:`~trainguard.elastic.store.RedisStore`. No agent hosts anything the others
need, so any node, the first one included, may die.

What this handler changes in torch's:

- **Fast close.** A round closes as soon as every node known to be alive (a fresh
  keep-alive in the state: the survivors of the last round and the nodes waiting)
  has joined it, instead of waiting out ``last_call_timeout``. torch's join op does
  the closing: when the condition holds, the locally synced state's last-call
  deadline is moved to now, and torch's handler marks the round complete and writes
  it with the compare-and-set, as it would after the deadline. The first round (no
  node known yet) still waits ``last_call_timeout`` for stragglers.
- **No agent TCPStore.** torch 2.13 by default serves the workers' store from a
  TCPStore inside the first round's rank-0 agent, and keeps using it in later rounds
  (so the death of that node kills the job, pytorch/pytorch#135712). Here the
  handler runs torch's own opt-out (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set in
  the agent's environment when the handler is made): each round's rank-0 agent
  publishes a fresh ``MASTER_ADDR``/``MASTER_PORT`` in the Redis store (used only by
  a worker that builds its process group with torch's default ``env://``: it is then
  served by the round's rank-0 worker). A re-formed group never looks for a store on
  a node of an earlier round.
- **The workers' store in Redis too.** After each round the handler puts
  ``$TRAINGUARD_RDZV_WORKER`` (:mod:`trainguard.elastic.worker`) into the environment
  of the workers it starts: this Redis, the run id and the round's prefix.
  ``trainer_client.init_process_group`` then builds the process group on a
  ``PrefixStore`` of the round over the run's Redis store, so not even the workers'
  store lives on a node (without it, the round's rank-0 worker serves a TCPStore).
- **Job stop.** Before each join the handler reads the run's job stop (a worker's
  "do not restart": the restart-loop breaker's exit 87 writes it); if there is one it
  closes the rendezvous and raises :class:`~trainguard.elastic.errors.JobStoppedError`
  (a ``RendezvousClosedError``): every agent exits instead of restarting its workers.
- **Admission.** Before each join the handler asks ``admit`` whether this node may
  join (by default :class:`~trainguard.elastic.admission.QuarantineAdmission`: no
  quarantine record of this node in the rendezvous' Redis); a refusal makes the node leave the rendezvous (its participation in
  the last round withdrawn, so the others do not wait for its keep-alive to expire)
  and its agent exit through torch's graceful-exit path, leaving the rendezvous open
  (its handler's ``shutdown`` does not close it: see there). This is the one place
  where the rendezvous asks "may this node join?".

Options (``--rdzv-conf key=value,...``; seconds may be fractional):
``join_timeout`` (600), ``last_call_timeout`` (``DEFAULT_LAST_CALL_S``),
``close_timeout`` (``DEFAULT_CLOSE_S``), ``heartbeat_timeout``
(``DEFAULT_HEARTBEAT_S``), ``keep_alive_interval`` (``DEFAULT_KEEP_ALIVE_S``),
``keep_alive_max_attempt`` (``DEFAULT_KEEP_ALIVE_ATTEMPTS``), ``fast_close``
(true), ``redis_retry_timeout`` (60), ``state_ttl`` and ``store_ttl`` (seconds),
``admit`` (``module:function``, see :data:`Admission`), ``quarantine`` (true: the
default admission; false admits every node when no ``admit`` is given).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _RendezvousExitOp,
    _RendezvousState,
    _RendezvousStateHolder,
)

from trainguard.core import settings
from trainguard.core.incidents import RDZV_CLOSED_ENV
from trainguard.elastic import keys
from trainguard.elastic._redis import Connection
from trainguard.elastic.admission import QuarantineAdmission
from trainguard.elastic.backend import DEFAULT_STATE_TTL_S, RedisRendezvousBackend
from trainguard.elastic.errors import ElasticConfigError, JobStoppedError, NodeRefusedError
from trainguard.elastic.store import DEFAULT_KEY_TTL_S, RedisStore
from trainguard.elastic.worker import WorkerRendezvous, read_stop

__all__ = [
    "DEFAULT_CLOSE_S",
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_KEEP_ALIVE_ATTEMPTS",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_LAST_CALL_S",
    "Admission",
    "JoinRequest",
    "TrainguardRendezvousHandler",
    "create_handler",
]

log = logging.getLogger(__name__)

# Defaults from runs on a shared 2-core machine (tests/test_elastic_torchrun.py,
# bench/rdzv_recovery.py, 3 agents, load average 4-9): the agents of a job began to
# rendezvous within 0.6 s of each other, well inside a 3 s first-round last call; a
# keep-alive (one compare-and-set) takes milliseconds, so one a second costs nothing,
# and 3 missed ones (3 s: torch's default is 15 s) was never a live agent here. With
# these, a re-rendezvous after a kill took 1.7-3.0 s (bench), most of it waiting
# for the dead node's keep-alive to expire.
DEFAULT_LAST_CALL_S = 3.0
"""First round only (later rounds close when every live node joined): torch's 30 s."""
DEFAULT_CLOSE_S = 10.0
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_KEEP_ALIVE_S = 1.0
DEFAULT_KEEP_ALIVE_ATTEMPTS = 3


@dataclass(frozen=True)
class JoinRequest:
    """What the admission check is asked about: node ``addr`` (the agent's
    ``--local-addr``, else its FQDN; one per machine in practice) joining round
    ``round`` of rendezvous ``run_id``."""

    run_id: str
    addr: str
    round: int


Admission = Callable[[JoinRequest], str | None]
"""May this node join? ``None`` admits it; a string refuses it, and says why (the
reason goes into the error its agent exits with)."""


def _close_when_all_joined(state: _RendezvousState, min_nodes: int) -> bool:
    """Whether round ``state.round`` may close now: it has ``min_nodes`` participants
    and every node with a live keep-alive is one of them. Round 0 never closes early:
    nobody is known yet, so a node alone would close it at once."""
    if state.complete or state.closed or state.round == 0 or state.deadline is None:
        return False
    if len(state.participants) < min_nodes:
        return False
    return all(node in state.participants for node in state.last_heartbeats)


class _FastCloseStateHolder(_RendezvousStateHolder):
    """torch's state holder, with the last-call deadline of a round every live node
    has joined moved to now (in the local copy only: torch's join op then marks the
    round complete and writes that with the compare-and-set; a concurrent change
    makes the write fail and the op look again)."""

    def __init__(self, inner: _RendezvousStateHolder, min_nodes: int) -> None:
        self._inner = inner
        self._min_nodes = min_nodes

    @property
    def state(self) -> _RendezvousState:
        return self._inner.state

    def sync(self) -> bool | None:
        result = self._inner.sync()
        state = self._inner.state
        if _close_when_all_joined(state, self._min_nodes):
            now = datetime.now(UTC)
            assert state.deadline is not None
            if state.deadline > now:
                state.deadline = now - timedelta(microseconds=1)
        return result

    def mark_dirty(self) -> None:
        self._inner.mark_dirty()


class TrainguardRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous with the admission check before each join and
    without the agent-hosted TCPStore (see the module docstring)."""

    admit: Admission | None = None
    _conn: Connection | None = None
    _refused = False
    _worker: WorkerRendezvous | None = None
    """What the workers are told (its prefix replaced each round)."""
    worker: WorkerRendezvous | None = None
    """What this node's workers were told after its last round."""
    _joined: tuple[int, str] = (0, "")
    """The round this node joined last and a digest of its members."""
    _warmed = False
    """Whether this agent's warm-start zygote was started (before its first join)."""

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_if_stopped()
        if self.admit is not None:
            request = JoinRequest(self._settings.run_id, self._this_node.addr,
                                  self._state_holder.state.round)
            reason = self.admit(request)
            if reason is not None:
                self._withdraw()
                self._refused = True
                raise NodeRefusedError(
                    f"node {request.addr!r} may not join rendezvous {request.run_id!r}: "
                    f"{reason}; its agent leaves, the other nodes go on without it"
                )
        if not self._warmed:
            # Before the first join: a node that joins a running job makes every other
            # node restart its workers, then wait for its own; its torch import must
            # come before that, while the others still train (trainguard.elastic.warm).
            from trainguard.elastic import warm

            self._warmed = True
            warm.prewarm(sys.argv)
        info = super().next_rendezvous()
        # The workers the agent spawns next inherit os.environ: their incidents split
        # the time to the next step at this moment (rendezvous | spawn).
        os.environ[RDZV_CLOSED_ENV] = f"{time.time():.3f}"
        if self._worker is not None:
            round_, members = self._joined
            self.worker = replace(self._worker, prefix=keys.worker_prefix(round_, members))
            os.environ[settings.RDZV_WORKER_ENV] = self.worker.to_env()
        return info

    def _get_world(self) -> tuple[int, int]:
        # torch calls this right after the join op, reading the rank from the state
        # the round completed with: take the round and its members from that same
        # state (the keep-alive thread may sync a newer one later).
        state = self._state_holder.state
        members = sorted(f"{n.addr}:{n.pid}:{n.local_id}" for n in state.participants)
        digest = hashlib.sha256("\n".join(members).encode()).hexdigest()[:12]
        self._joined = (state.round, digest)
        return super()._get_world()

    def _stop_if_stopped(self) -> None:
        """Close the rendezvous and raise JobStoppedError when a worker stopped the job."""
        if self._conn is None:
            return
        stop = read_stop(self._conn, self._settings.run_id)
        if stop is None:
            return
        try:
            self.set_closed()
        except Exception:  # closed or not, this agent must not restart its workers
            log.warning("could not close rendezvous %s after its job stop",
                        self._settings.run_id, exc_info=True)
        raise JobStoppedError(
            f"rendezvous {self._settings.run_id!r}: the job was stopped by its worker "
            f"(rank {stop.get('rank')}, exit {stop.get('exit_code')}): "
            f"{stop.get('reason')} -- this agent exits instead of restarting its workers, "
            "and the rendezvous is closed; launch again with a new --rdzv-id once fixed"
        )

    def _withdraw(self) -> None:
        """Leave the last round (if this node was in it) so that the others need not
        wait for its keep-alive to expire."""
        self._stop_heartbeats()
        deadline = self._get_deadline(self._settings.timeout.close)
        try:
            self._op_executor.run(_RendezvousExitOp(), deadline)
        except Exception:  # the refusal is what matters; an expiry removes it too
            log.warning("could not withdraw node %s from rendezvous %s", self._this_node,
                        self._settings.run_id, exc_info=True)

    def shutdown(self) -> bool:
        """Close the rendezvous (torch's launcher calls this when its agent ends other
        than by a signal), except after a refusal: torch's agent returns nothing from
        a graceful exit, its launcher fails on that and shuts the handler down, and a
        close would end the job for every node, the refused one's only sin being that
        it asked to join."""
        try:
            if self._refused:
                self._stop_heartbeats()
                return True
            return super().shutdown()
        finally:
            if self._conn is not None:
                self._conn.close()


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key, None)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if value <= 0:
        raise ElasticConfigError(
            f"--rdzv-conf {key}={raw!r}: expected a positive number of seconds"
        )
    return value


def _attempts(params: RendezvousParameters) -> int:
    raw = params.get("keep_alive_max_attempt", None)
    if raw is None or raw == "":
        return DEFAULT_KEEP_ALIVE_ATTEMPTS
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise ElasticConfigError(
            f"--rdzv-conf keep_alive_max_attempt={raw!r}: expected an integer >= 1"
        )
    return value


def load_admission(spec: str) -> Admission:
    """The admission callable named ``module:function``."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ElasticConfigError(
            f"--rdzv-conf admit={spec!r}: expected module:function (e.g. "
            "mypkg.quarantine:may_join)"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ElasticConfigError(f"--rdzv-conf admit={spec!r}: cannot load it: {e}") from e
    if not callable(fn):
        raise ElasticConfigError(f"--rdzv-conf admit={spec!r} names a {type(fn).__name__}, "
                                 "not a function")
    return fn  # type: ignore[no-any-return]


def create_handler(params: RendezvousParameters, *, admit: Admission | None = None
                   ) -> TrainguardRendezvousHandler:
    """The handler of ``params`` (what torchrun builds from its ``--rdzv-*`` flags):
    the endpoint is the Redis URL, the run id the rendezvous id. ``admit`` (or the
    ``admit`` option) is the admission check; without one, the quarantine records in
    this Redis are (``quarantine=false`` in ``--rdzv-conf`` admits every node)."""
    endpoint = params.endpoint
    if "://" not in endpoint:
        raise ElasticConfigError(
            f"--rdzv-endpoint {endpoint!r}: the trainguard rendezvous needs a Redis URL, "
            "e.g. redis://10.0.0.5:6379/0 or redis+cluster://10.0.0.5:7000,10.0.0.6:7000"
        )
    fast_close = params.get_as_bool("fast_close", True)
    timeout = RendezvousTimeout(
        join=timedelta(seconds=_seconds(params, "join_timeout", 600.0)),
        last_call=timedelta(seconds=_seconds(params, "last_call_timeout", DEFAULT_LAST_CALL_S)),
        close=timedelta(seconds=_seconds(params, "close_timeout", DEFAULT_CLOSE_S)),
        heartbeat=timedelta(seconds=_seconds(params, "heartbeat_timeout", DEFAULT_HEARTBEAT_S)),
    )
    # torch's opt-out of the agent-hosted TCPStore (see the module docstring): read by
    # torch's handler in this process, inherited by the workers it starts.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    conn = Connection(endpoint, retry_timeout_s=_seconds(params, "redis_retry_timeout", 60.0))
    state_ttl_s = _seconds(params, "state_ttl", DEFAULT_STATE_TTL_S)
    backend = RedisRendezvousBackend(conn, params.run_id, state_ttl_s=state_ttl_s)
    store_ttl_s = _seconds(params, "store_ttl", DEFAULT_KEY_TTL_S)
    store = RedisStore(conn, params.run_id, key_ttl_s=store_ttl_s)
    handler: Any = TrainguardRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes,
        params.local_addr, timeout,
        keep_alive_interval=_seconds(params, "keep_alive_interval",
                                     DEFAULT_KEEP_ALIVE_S),  # type: ignore[arg-type]
        keep_alive_max_attempt=_attempts(params),
    )
    if fast_close:
        handler._state_holder = _FastCloseStateHolder(handler._state_holder, params.min_nodes)
        # torch's op executor holds the holder too: give it the same one.
        handler._op_executor._state_holder = handler._state_holder
    if admit is None and params.get("admit", None):
        admit = load_admission(str(params.get("admit")))
    if admit is None and params.get_as_bool("quarantine", True):
        # The quarantine kept in this Redis is checked before every join by default.
        admit = QuarantineAdmission(conn)
    handler.admit = admit
    handler._conn = conn
    # The stop lives as long as the state: a relaunch under the same id while the
    # closed state holds is refused anyway.
    handler._worker = WorkerRendezvous(url=endpoint, run_id=params.run_id, prefix="",
                                       store_ttl_s=store_ttl_s, stop_ttl_s=state_ttl_s)
    return handler  # type: ignore[no-any-return]
