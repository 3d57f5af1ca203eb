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
    when added to a finished handle; ``wait()`` returns after they ran, so whatever a
    callback does on commit (acknowledging stream offsets) is done by then."""

    def __init__(self, step: int):
        self.step = step
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self.error_reported = False
        self._result = threading.Event()  # manifest or error is set
        self._done = threading.Event()  # ... and every callback has run
        self._finisher: int | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[SaveHandle], None]] = []

    def done(self) -> bool:
        return self._result.is_set()

    def wait(self, timeout_s: float | None = None) -> Manifest:
        """The committed manifest; raises the save's error, or TimeoutError. Returns
        after the done-callbacks have run (inside a callback: at once)."""
        if not self._settle(timeout_s):
            raise TimeoutError(f"save of step {self.step} still running after {timeout_s} s")
        if self.error is not None:
            self.error_reported = True
            raise self.error
        assert self.manifest is not None
        return self.manifest

    def _settle(self, timeout_s: float | None = None) -> bool:
        """Wait until done and the callbacks ran; inside a callback, only until done
        (waiting for the callbacks there would wait for itself)."""
        inside_callback = self._finisher == threading.get_ident()
        return (self._result if inside_callback else self._done).wait(timeout_s)

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Run ``fn(handle)`` after the commit or the failure. It runs in the store's
        writer thread, before the next save starts writing: keep it short, and do
        not call ``save()`` from it (the save would wait for the writer thread)."""
        with self._lock:
            if not self._result.is_set():
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
            self._finisher = threading.get_ident()
            self._result.set()
            callbacks, self._callbacks = self._callbacks, []
        try:
            for fn in callbacks:
                self._run(fn)
        finally:
            self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.manifest else "running"
        return f"<SaveHandle step={self.step} {state}>"
