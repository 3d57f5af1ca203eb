"""Backoff has one home, ``trainguard.core.backoff``: the push client, the retrier and
the checkpoint uploader take their waits from its ``RetryPolicy``."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from checkpoint_store import TieredCheckpointStore
from checkpoint_store.backends import LocalBackend
from checkpoint_store.upload import UPLOAD_BACKOFF, Uploader
from trainguard.core import backoff, resilience
from trainguard.core.backoff import Backoff, RetryPolicy
from trainguard.core.resilience import object_store_breaker, retry
from trainguard.push import Producer

ROOT = Path(__file__).resolve().parents[1]


def test_backoff_imports_the_standard_library_only() -> None:
    """Every import of trainguard/core/backoff.py is a standard-library module, and
    importing the push client loads neither stamina, the resilience package, redis,
    aiohttp nor torch; the retrier's RetryPolicy and Backoff are the same classes."""
    tree = ast.parse((ROOT / "trainguard/core/backoff.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported
    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys, trainguard.push; print(sorted(m for m in sys.modules if m.split('.')[0] "
         "in ('stamina', 'redis', 'aiohttp', 'torch') "
         "or m.startswith('trainguard.core.resilience')))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
    assert resilience.RetryPolicy is retry.RetryPolicy is backoff.RetryPolicy
    assert resilience.Backoff is retry.Backoff is backoff.Backoff


def test_push_client_waits_are_its_retry_policy() -> None:
    """The push client's backoff_s/max_backoff_s/max_attempts become one RetryPolicy:
    the first wait is backoff_s plus up to backoff_s of jitter, the waits double and
    stop at max_backoff_s; a Producer that would never send is refused at once."""
    p = Producer("http://127.0.0.1:9", "rl", "w-1", token=None, max_attempts=7,
                 backoff_s=0.05, max_backoff_s=0.3)
    assert p.retry_policy == RetryPolicy(attempts=7, timeout_s=None, wait_initial_s=0.05,
                                         wait_max_s=0.3, wait_jitter_s=0.05)
    waits = Backoff(p.retry_policy)
    first, second, *rest = [waits.next_wait_s() for _ in range(6)]
    assert 0.05 <= first <= 0.1
    assert 0.1 <= second <= 0.15
    assert rest[-1] == 0.3
    with pytest.raises(ValueError, match="max_attempts must be >= 1, got 0"):
        Producer("http://127.0.0.1:9", "rl", "w-1", token=None, max_attempts=0)


def _uploader(tmp_path: Path, **kwargs: object) -> Uploader:
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "remote").mkdir(exist_ok=True)
    return Uploader(LocalBackend(str(tmp_path / "local")), LocalBackend(str(tmp_path / "remote")),
                    lambda fn, *args: fn(*args), on_committed=lambda _name: None,
                    **kwargs)  # type: ignore[arg-type]


def test_uploader_takes_a_retry_policy_and_the_old_tuple_with_a_warning(tmp_path: Path) -> None:
    """The uploader's waits are a RetryPolicy (default: 0.2 s doubling to 10 s, no
    jitter). The former (first, max) tuple still gives the same waits for one release,
    with a DeprecationWarning naming the caller's line and the replacement; both at
    once, or a tuple that is not (first, max), is a clear error."""
    policy = RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.05, wait_max_s=0.2,
                         wait_jitter_s=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _uploader(tmp_path).backoff == UPLOAD_BACKOFF
        assert _uploader(tmp_path, backoff=policy).backoff is policy
    assert [UPLOAD_BACKOFF.wait_s(n) for n in (1, 2, 7)] == [0.2, 0.4, 10.0]
    with pytest.warns(DeprecationWarning, match=r"pass backoff=RetryPolicy\(") as caught:
        assert _uploader(tmp_path, backoff_s=(0.05, 0.2)).backoff == policy
    assert caught[0].filename == __file__
    with pytest.raises(ValueError, match="backoff and backoff_s were both given"):
        _uploader(tmp_path, backoff=policy, backoff_s=(0.05, 0.2))
    with pytest.raises(ValueError, match=r"backoff_s must be \(first, max\).*got \(0.2,\)"):
        _uploader(tmp_path, backoff_s=(0.2,))


def test_tiered_store_takes_upload_backoff(tmp_path: Path) -> None:
    """TieredCheckpointStore(upload_backoff=policy) hands the policy to its uploader;
    upload_backoff_s=(first, max) still works with a DeprecationWarning at the caller;
    both at once is refused before any store is opened (no directory is created)."""
    policy = RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.05, wait_max_s=0.2,
                         wait_jitter_s=0.0)

    def tiered(name: str, **kwargs: object) -> TieredCheckpointStore:
        return TieredCheckpointStore(
            tmp_path / name / "local", str(tmp_path / name / "remote"),
            remote_breaker=object_store_breaker(f"test-backoff-{name}"),
            **kwargs)  # type: ignore[arg-type]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = tiered("new", upload_backoff=policy)
    try:
        assert store._uploader.backoff is policy
    finally:
        store.close()
    with pytest.warns(DeprecationWarning, match=r"pass upload_backoff=RetryPolicy\(") as caught:
        old = tiered("old", upload_backoff_s=(0.05, 0.2))
    try:
        assert caught[0].filename == __file__
        assert old._uploader.backoff == policy
    finally:
        old.close()
    with pytest.raises(ValueError, match="upload_backoff and upload_backoff_s were both given"):
        tiered("both", upload_backoff=policy, upload_backoff_s=(0.05, 0.2))
    assert not (tmp_path / "both").exists()
