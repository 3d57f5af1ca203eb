"""Shared helpers of the tiered checkpoint tests (importable by subprocess workers)."""

from __future__ import annotations

import itertools
import os
from typing import Any

from checkpoint_store import TieredCheckpointStore
from trainguard.core.resilience import RetryPolicy, object_store_breaker

_ids = itertools.count()

FAST_POLICY = RetryPolicy(attempts=2, timeout_s=5.0, wait_initial_s=0.05, wait_max_s=0.2,
                          wait_jitter_s=0.05)
"""Per remote call: two quick tries (the uploader's own backoff retries after that)."""

UPLOAD_BACKOFF = RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.1, wait_max_s=0.5,
                             wait_jitter_s=0.0)
"""The uploader's waits between its own attempts: 0.1 s doubling to 0.5 s."""

READ_POLICY = RetryPolicy(attempts=20, timeout_s=30.0, wait_initial_s=0.05, wait_max_s=0.5,
                          wait_jitter_s=0.05)


def fast_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """moto storage options whose failures surface at once: botocore's own retries and
    long connect timeouts would hide an outage from the breaker for seconds."""
    return {
        **storage_options,
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                          "connect_timeout": 2, "read_timeout": 10},
    }


def open_tiered(local: str, remote: str, storage_options: dict[str, Any],
                **kwargs: Any) -> TieredCheckpointStore:
    """A tiered store tuned for tests: a breaker that opens after 2 failures and
    probes again after 0.3 s, short retry policies, short uploader backoff."""
    kwargs.setdefault("remote_breaker", object_store_breaker(
        f"test-tier-{os.getpid()}-{next(_ids)}", failure_threshold=2, reset_timeout_s=0.3))
    kwargs.setdefault("upload_policy", FAST_POLICY)
    kwargs.setdefault("remote_read_policy", READ_POLICY)
    kwargs.setdefault("upload_backoff", UPLOAD_BACKOFF)
    kwargs.setdefault("keep_last", 2)
    return TieredCheckpointStore(local, remote, storage_options=fast_options(storage_options),
                                 **kwargs)
