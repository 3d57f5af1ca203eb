"""Test helper: a fork server for the ledger job, so each restart skips importing torch.

Reads one JSON request per line on stdin (``{"rank": r, "args": [...], "env": {...}}``,
optionally ``"module": "train_gpt"``: a module of ``examples/`` instead), forks a
child that runs the job module's ``main(args)`` (``tests/_client_train.py``, or the
module named as the first argument, or the request's example module) with that
environment, and prints ``<rank>: PID <pid>``, later ``<rank>: EXIT <code>`` (a child
killed by SIGKILL exits with -9). Children are real, separate processes: the tests kill
them with SIGKILL by PID. Torch runs one warm-up step here with OMP_NUM_THREADS=1 (no
thread pool to lose in the fork).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import traceback
from pathlib import Path

job = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "tests._client_train")

_lock = threading.Lock()


def _out(line: str) -> None:
    with _lock:
        os.write(1, (line + "\n").encode())


def _reap(pid: int, rank: int) -> None:
    _, status = os.waitpid(pid, 0)
    _out(f"{rank}: EXIT {os.waitstatus_to_exitcode(status)}")


def _warm_up() -> None:
    """Pay the lazy imports (Adam pulls in torch._dynamo: seconds; the session imports
    checkpoint_store when it makes its store) once, here. Starts no thread."""
    import checkpoint_store

    assert checkpoint_store.CheckpointStore
    _state, model, opt = job.make_state(8)
    model.lin(job.torch.zeros(2, 8)).sum().backward()
    opt.step()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so that neither the fork
    server nor a job outlives the test that started it."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    getattr(job, "warm_up", _warm_up)()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent()
                os.environ.update(req["env"])
                module = req.get("module")
                if module:
                    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
                code = (importlib.import_module(module) if module else job).main(req["args"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _out(f"{req['rank']}: PID {pid}")
        threading.Thread(target=_reap, args=(pid, req["rank"]), daemon=True).start()


if __name__ == "__main__":
    main()
