"""Every Redis key of the trainguard rendezvous, in one place.

All keys of one run share the hash tag ``{<run id>}``, so on a Redis Cluster they sit
in one slot: the rendezvous state's compare-and-set is one Lua call on one key, and
the store's keys live on the same master (one failover affects all of them at once,
never half).
"""

from __future__ import annotations

__all__ = ["PREFIX", "WORKER_STORE_PREFIX", "run_tag", "state_key", "stop_key", "store_key",
           "store_pattern", "worker_prefix"]

PREFIX = "tg:rdzv"
WORKER_STORE_PREFIX = "worker"
"""The workers' process-group stores sit in the run's store under this, per round."""


def run_tag(run_id: str) -> str:
    if not run_id or any(c in run_id for c in "{}"):
        # A brace would end the hash tag early and scatter the run over slots.
        raise ValueError(
            f"rendezvous run id {run_id!r} must be non-empty and contain no braces; "
            "pass another --rdzv-id"
        )
    return f"{PREFIX}:{{{run_id}}}"


def state_key(run_id: str) -> str:
    """The rendezvous state (a hash: ``t`` the fencing token, ``s`` the state bytes)."""
    return f"{run_tag(run_id)}:state"


def store_key(run_id: str, key: str) -> str:
    """Key ``key`` of the run's ``torch.distributed.Store``."""
    return f"{run_tag(run_id)}:k:{key}"


def store_pattern(run_id: str) -> str:
    """A SCAN pattern matching every store key of the run (braces escaped: in a
    pattern they are literal only so)."""
    return f"{PREFIX}:\\{{{run_id}\\}}:k:*"


def stop_key(run_id: str) -> str:
    """The job stop: a worker's "do not restart" (the restart-loop breaker's exit 87),
    read by every agent before it joins a round."""
    return f"{run_tag(run_id)}:stop"


def worker_prefix(round_: int, members: str) -> str:
    """The prefix, inside the run's store, of round ``round_``'s worker process-group
    store; ``members`` tells apart two launches that reused a run id (their round
    numbers start over, their members' pids differ)."""
    return f"{WORKER_STORE_PREFIX}/{round_}/{members}"
