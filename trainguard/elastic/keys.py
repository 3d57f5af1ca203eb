"""Every Redis key of the trainguard rendezvous, in one place.

All keys of one run share the hash tag ``{<run id>}``, so on a Redis Cluster they sit
in one slot: the rendezvous state's compare-and-set is one Lua call on one key, and
the store's keys live on the same master (one failover affects all of them at once,
never half).
"""

from __future__ import annotations

__all__ = ["PREFIX", "run_tag", "state_key", "store_key", "store_pattern"]

PREFIX = "tg:rdzv"


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
