"""``trainguard serve`` with every slow loop step logged: where it started and ended.

A diagnostic for ``bench/push.py --bombs-only --steps``: run in place of
``python -m trainguard serve``. Each callback the event loop runs is timed in CPU time
of the loop's thread (not wall time: the scheduler's waits on a busy machine would
show); one over ``TRAINGUARD_SLOW_STEP_MS`` (2 by default) is written to stderr with
the await chain of its task before and after the step, so the code it ran is the code
between those two lines, and the garbage collections inside it (generation, CPU ms). Tasks are made Python tasks so that a step's task is known.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from asyncio import events, tasks
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_SLOW_S = float(os.environ.get("TRAINGUARD_SLOW_STEP_MS", "2")) / 1000


def _where(coro: Any) -> str:
    """The await chain of a coroutine: the innermost few project frames."""
    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            name = frame.f_code.co_filename
            if "site-packages" not in name and "/lib/python" not in name:
                out.append(f"{Path(name).name}:{frame.f_lineno}:{frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(out[-4:]) or "-"


_run = events.Handle._run
_LOOP_THREAD = threading.get_ident()
_gc_spent: list[tuple[int, float]] = []  # (generation, CPU s) of the collections in a step
_gc_began = 0.0


def _on_gc(phase: str, info: dict[str, int]) -> None:
    """Collections on the loop's thread, timed, so that a slow step says how much of it
    was the garbage collector's."""
    global _gc_began
    if threading.get_ident() != _LOOP_THREAD:
        return
    if phase == "start":
        _gc_began = time.thread_time()
    else:
        _gc_spent.append((info["generation"], time.thread_time() - _gc_began))


def _timed_run(self: events.Handle) -> None:
    owner = getattr(self._callback, "__self__", None)
    coro = owner.get_coro() if isinstance(owner, asyncio.Task) else None
    before = _where(coro) if coro is not None else repr(self._callback)[:120]
    _gc_spent.clear()
    t = time.thread_time()
    _run(self)
    cpu = time.thread_time() - t
    if cpu > _SLOW_S:
        after = _where(coro) if coro is not None else "-"
        gcs = "".join(f" gc{g} {s * 1000:.1f} ms" for g, s in _gc_spent if s * 1000 >= 0.1)
        sys.stderr.write(f"SLOW {time.time():.2f} {cpu * 1000:.1f} ms:{gcs} from {before}\n"
                         f"    to {after}\n")


def main() -> int:
    events.Handle._run = _timed_run  # type: ignore[method-assign]
    gc.callbacks.append(_on_gc)
    tasks.Task = tasks._PyTask  # type: ignore[attr-defined, misc]
    asyncio.Task = tasks._PyTask  # type: ignore[attr-defined, misc]
    new_loop = asyncio.new_event_loop

    def _loop() -> asyncio.AbstractEventLoop:
        loop = new_loop()
        loop.set_task_factory(lambda lp, c, **kw: tasks._PyTask(c, loop=lp, **kw))  # type: ignore[attr-defined]
        return loop

    asyncio.new_event_loop = _loop  # type: ignore[assignment]
    from trainguard.ops.cli import main as cli

    return cli(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
