"""``SaveHandle``: the future of one save."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from checkpoint_store.manifest import Manifest

__all__ = ["SaveHandle"]

log = logging.getLogger("checkpoint_store")


class SaveHandle:
    """Completes when the manifest is committed (``manifest``) or the save failed
    (``error``). Callbacks run once, in the thread that completes the save, or at once
    when added to a finished handle."""

    def __init__(self, step: int):
        self.step = step
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self.error_reported = False
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[SaveHandle], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Manifest:
        """The committed manifest; raises the save's error, or TimeoutError."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"save of step {self.step} still running after {timeout_s} s")
        if self.error is not None:
            self.error_reported = True
            raise self.error
        assert self.manifest is not None
        return self.manifest

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._run(fn)

    def _run(self, fn: Callable[[SaveHandle], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a done-callback of the save of step %d raised", self.step)

    def _finish(self, manifest: Manifest | None, error: BaseException | None) -> None:
        with self._lock:
            self.manifest, self.error = manifest, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._run(fn)

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.manifest else "running"
        return f"<SaveHandle step={self.step} {state}>"
