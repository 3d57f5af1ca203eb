"""What a worker of the trainguard rendezvous takes from it: its process group's store
in Redis, and the job stop.

After each round the handler (:mod:`trainguard.elastic.rendezvous`, in the agent)
puts ``$TRAINGUARD_RDZV_WORKER`` into the environment of the workers it starts: the
rendezvous' Redis URL, the run id and the round's store prefix
(:func:`~trainguard.elastic.keys.worker_prefix`). In the worker:

- :func:`process_group_store` is the store ``trainer_client.init_process_group``
  hands ``torch.distributed.init_process_group``: a ``PrefixStore`` of the round over
  a :class:`~trainguard.elastic.store.RedisStore` of the run. torch's default
  (``env://``) makes the round's rank-0 worker serve a TCPStore, on a node that can
  die. The prefix is the round's, so a zombie worker of an older round (one its agent
  has not reaped yet) reads and writes its own round's keys only, never the new
  round's.
- :func:`record_stop` writes the restart-loop breaker's "stop, a person must look"
  (exit 87) to :func:`~trainguard.elastic.keys.stop_key` before the worker exits.
  Every agent's handler reads it before it joins a round, closes the rendezvous and
  raises :class:`~trainguard.elastic.errors.JobStoppedError`: every agent exits
  instead of restarting its workers until ``--max-restarts`` runs out.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.core import settings
from trainguard.elastic import keys
from trainguard.elastic._redis import Connection
from trainguard.elastic.errors import ElasticConfigError
from trainguard.elastic.store import RedisStore

__all__ = [
    "WorkerRendezvous", "process_group_store", "read_stop", "record_stop", "stop_job",
]

log = logging.getLogger(__name__)

STOP_WRITE_TIMEOUT_S = 10.0
"""How long a stopping worker retries the stop's write through a Redis outage. Past
it the worker exits anyway: its agent restarts it, the breaker refuses the restart
and that attempt writes the stop again."""


_KEPT: list[RedisStore] = []
"""The process group stores of this process (see :func:`process_group_store`)."""


@dataclass(frozen=True)
class WorkerRendezvous:
    """``$TRAINGUARD_RDZV_WORKER``: where this worker's round keeps its store."""

    url: str
    run_id: str
    prefix: str
    store_ttl_s: float
    stop_ttl_s: float

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, raw: str | None = None) -> WorkerRendezvous | None:
        """The variable (or ``raw``) parsed; None when unset (no trainguard rendezvous)."""
        text = (settings.rdzv_worker() if raw is None else raw).strip()
        if not text:
            return None
        try:
            doc = json.loads(text)
            info = cls(url=str(doc["url"]), run_id=str(doc["run_id"]),
                       prefix=str(doc["prefix"]), store_ttl_s=float(doc["store_ttl_s"]),
                       stop_ttl_s=float(doc["stop_ttl_s"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ElasticConfigError(
                f"${settings.RDZV_WORKER_ENV}: expected the JSON the trainguard rendezvous "
                "sets (url, run_id, prefix, store_ttl_s, stop_ttl_s), found "
                f"{text[:200]!r} ({type(e).__name__}: {e}); unset it to use torch's "
                "default store"
            ) from e
        keys.run_tag(info.run_id)  # a bad id fails here, not at the first key
        return info

    @classmethod
    def of_this_worker(cls) -> WorkerRendezvous | None:
        """The variable when torchrun started this process under its rendezvous: its
        run id is ``$TORCHELASTIC_RUN_ID``, which the agent sets for each worker. A
        variable inherited from elsewhere (a process that ran a handler itself, an
        exported shell variable, a worker's own child) names a Redis and a round this
        process is not part of: it is ignored, with a warning, and torch's default
        store is used."""
        info = cls.from_env()
        if info is None:
            return None
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        if run != info.run_id:
            log.warning("$%s names rendezvous %r but this process was not started by "
                        "torchrun for it ($TORCHELASTIC_RUN_ID=%r): ignored; the process "
                        "group uses torch's default store", settings.RDZV_WORKER_ENV,
                        info.run_id, run)
            return None
        return info


def process_group_store(info: WorkerRendezvous, *, timeout: timedelta) -> dist.Store:
    """The store of this worker's round: its keys live in the rendezvous' Redis under
    the run's hash tag (one slot of a cluster) and the round's prefix. ``timeout``
    is how long a ``get``/``wait`` of it waits (the process group's timeout)."""
    conn = Connection(info.url)
    store = RedisStore(conn, info.run_id, timeout=timeout, key_ttl_s=info.store_ttl_s)
    # The PrefixStore holds the store on the C++ side only: without a Python reference
    # the Python half of the object (its methods) would be collected under it.
    _KEPT.append(store)
    return dist.PrefixStore(info.prefix, store)


def record_stop(info: WorkerRendezvous, *, reason: str, exit_code: int,
                rank: int | None = None) -> bool:
    """Write the job stop (the first writer's stays: every rank of a stopping job
    writes it, so that no agent restarts its worker before the stop is there).
    True when this call wrote it."""
    doc = {"reason": reason, "exit_code": exit_code, "at": time.time(),
           "host": socket.gethostname(), "pid": os.getpid(), "rank": rank}
    conn = Connection(info.url, retry_timeout_s=STOP_WRITE_TIMEOUT_S)
    try:
        written = conn.call(conn.client.set, keys.stop_key(info.run_id), json.dumps(doc),
                            nx=True, px=int(info.stop_ttl_s * 1000))
    finally:
        conn.close()
    return bool(written)


def stop_job(*, reason: str, exit_code: int, rank: int | None = None) -> bool:
    """:func:`record_stop` for the rendezvous of ``$TRAINGUARD_RDZV_WORKER`` (nothing
    when unset). Every rank of a stopping job calls it before it exits, so that
    whichever agent sees its worker exit first finds the stop there. A failure is
    logged, not raised: the exit code matters more, and an agent that restarts the
    worker anyway gets a refusal, which calls this again."""
    try:
        info = WorkerRendezvous.of_this_worker()
        if info is None:
            return False
        return record_stop(info, reason=reason, exit_code=exit_code, rank=rank)
    except Exception as exc:
        log.warning("could not record the job stop in the rendezvous' Redis (%s: %s); "
                    "the agent may restart this worker, which the breaker refuses",
                    type(exc).__name__, exc)
        return False


def read_stop(conn: Connection, run_id: str) -> dict[str, Any] | None:
    """The job stop of run ``run_id``, if a worker wrote one."""
    raw = conn.call(conn.client.get, keys.stop_key(run_id))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    # Not ours to judge: a stop written by hand (or damaged) still stops the job.
    return doc if isinstance(doc, dict) else {"reason": repr(raw)[:500]}
