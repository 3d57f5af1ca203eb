"""The zygote of :mod:`trainguard.elastic.warm`: one per torchrun agent, it imports
torch and trainguard's parts once and forks a worker for each wrapper that asks.

``python -m trainguard.elastic._zygote SOCKET AGENT_PID`` (the first wrapper of an
agent starts it, detached). It imports ``torch``, ``torch.distributed``,
``trainer_client``, ``checkpoint_store`` and ``$TRAINGUARD_WARM_PRELOAD``, then serves
on SOCKET. Each connection is one worker: the wrapper's request (what to run, its
environment and working directory; its fds 0/1/2 by SCM_RIGHTS), then signal numbers
to forward, one byte each. The zygote answers ``{"pid": ...}`` once forked and
``{"status": ...}`` (the wait status) once it reaped the child; when the wrapper's
connection closes first (the wrapper was killed) it SIGKILLs the child, stopped or
not. It exits, killing what it forked, once the agent is gone (polled: a node killed
with kill -9 leaves nothing behind), and after ``$TRAINGUARD_WARM_IDLE_S`` without a
worker.

A fork copies only the calling thread, so the zygote must have exactly one (a lock
held by another thread would stay held in the child) and must never initialize CUDA
(a CUDA context does not survive a fork: the child initializes its own); both are
checked before every fork. numpy's OpenBLAS starts a thread pool when it is loaded,
so the zygote loads it with ``OPENBLAS_NUM_THREADS=1`` (unless set): the workers'
numpy BLAS runs on one thread; torch's own threads are set per worker from
``OMP_NUM_THREADS``, as a fresh process would.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from trainguard.core import lists, settings
from trainguard.core.process import pid_alive, started_at
from trainguard.elastic import warm

__all__ = ["DEFAULT_PRELOAD", "NotForkable", "check_forkable", "main"]

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "trainer_client",
                   "checkpoint_store")
"""torch._dynamo: every torch.optim optimizer imports it when made (torch._compile's
``_disable_dynamo``), 3 to 8 s on a loaded 2-core node, which a cold worker pays
inside its "session" phase, after the imports it was measured apart from."""
AGENT_POLL_S = 0.25
"""How often the zygote looks whether its agent still runs."""
DEFAULT_IDLE_S = 600.0
MAX_REQUEST = 16 << 20


class NotForkable(RuntimeError):
    """The zygote is in a state a fork would not copy faithfully (threads, CUDA)."""


def _log(line: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} trainguard zygote {os.getpid()}: {line}\n")
    sys.stderr.flush()


def check_forkable() -> None:
    """Raise :class:`NotForkable` unless this process has one thread and no CUDA."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1:
        names = []
        for task in tasks:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        raise NotForkable(
            f"the zygote runs {len(tasks)} threads ({', '.join(names)}), expected exactly 1: "
            "a fork copies only the calling thread, and a lock another thread holds would "
            "stay held in the child. A preloaded module started them: take it out of "
            f"${settings.WARM_PRELOAD_ENV}, or set its thread count to 1 for the zygote")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise NotForkable(
            "CUDA was initialized in the zygote, expected it untouched: a CUDA context "
            "does not survive a fork, so the child could not use the GPU. A preloaded "
            f"module initialized it at import: take it out of ${settings.WARM_PRELOAD_ENV}")


def preload(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise SystemExit(f"trainguard zygote: preloading {name!r} failed: "
                             f"{type(e).__name__}: {e}; expected an importable module "
                             f"(check ${settings.WARM_PRELOAD_ENV} and PYTHONPATH)") from None


@dataclass
class Child:
    pid: int
    conn: socket.socket | None


@dataclass
class Job:
    """What a forked child runs (returned out of the serve loop, in the child only)."""
    request: dict[str, Any]
    fds: list[int]
    started_at: float | None
    forked_at: float


@dataclass
class Zygote:
    path: str
    agent: int
    idle_s: float = DEFAULT_IDLE_S
    pid: int = field(default_factory=os.getpid)
    children: dict[int, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.agent_started = started_at(self.agent)
        self.sel = selectors.DefaultSelector()
        self.stopping = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead zygote's: the wrapper found nobody serving it
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.inode = os.stat(self.path).st_ino
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def agent_alive(self) -> bool:
        """The agent still runs: its pid exists with the start time it had (not a
        process that got its pid after it died)."""
        if not pid_alive(self.agent):
            return False
        now = started_at(self.agent)
        return self.agent_started is None or now is None or abs(now - self.agent_started) < 1.0

    def serve(self) -> Job | None:
        """Serve until the agent is gone or idle: None in the zygote; in a forked
        child, the child's :class:`Job` (the loop's state is left behind)."""
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select (wakeup fd)
        signal.signal(signal.SIGTERM, self._stop)
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        busy = time.monotonic()
        _log(f"serving agent {self.agent} on {self.path}")
        while True:
            for key, _ in self.sel.select(AGENT_POLL_S):
                if key.fileobj is self.listener:
                    job = self._accept()
                    if job is not None:
                        return job
                elif key.fileobj == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                else:
                    self._from_wrapper(key.fileobj)  # type: ignore[arg-type]
            self._reap()
            if self.children:
                busy = time.monotonic()
            if self.stopping or not self.agent_alive():
                _log("stopping" if self.stopping else f"agent {self.agent} is gone: exiting")
                self._kill_all()
                if not self.stopping:  # no wrapper of that agent comes again: tidy up
                    stem = self.path[:-len(".sock")]
                    for leftover in (stem + ".lock", stem + ".log"):
                        with contextlib.suppress(OSError):
                            os.unlink(leftover)
                return None
            if time.monotonic() - busy > self.idle_s:
                _log(f"idle for {self.idle_s:.0f} s: exiting")
                return None

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def _accept(self) -> Job | None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(30)
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            if uid != os.getuid():
                raise ValueError(f"the wrapper runs as uid {uid}, the zygote as {os.getuid()}")
            if len(data) < 4 or len(fds) != 3:
                raise ValueError(f"expected a request with 3 fds, got {len(data)} bytes and "
                                 f"{len(fds)} fds")
            (size,) = struct.unpack("!I", data[:4])
            if size > MAX_REQUEST:
                raise ValueError(f"a request of {size} bytes, expected at most {MAX_REQUEST}")
            body = data[4:]
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ValueError("the wrapper closed the connection mid-request")
                body += chunk
            request = json.loads(body)
            check_forkable()
        except (OSError, ValueError, NotForkable) as e:
            _log(f"refused a wrapper: {e}")
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        wrapper_started = started_at(pid)
        sys.stdout.flush()
        sys.stderr.flush()  # else the child would write the zygote's buffered lines
        forked = time.time()
        child = os.fork()
        if child == 0:
            self._leave(conn)
            return Job(request, fds, wrapper_started, forked)
        for fd in fds:
            os.close(fd)
        self.children[child] = Child(child, conn)
        conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ, child)
        return None

    def _leave(self, conn: socket.socket) -> None:
        """In a new child: close what is the zygote's (its socket, the wrappers')."""
        signal.set_wakeup_fd(-1)
        for key in list(self.sel.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        self.sel.close()
        self.listener.close()
        conn.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _from_wrapper(self, conn: socket.socket) -> None:
        pid = self.sel.get_key(conn).data
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            for sig in data:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            return
        # The wrapper is gone (torchrun killed its group): its child must not outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.sel.unregister(conn)
        conn.close()
        if pid in self.children:
            self.children[pid].conn = None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._done(pid, status)

    def _done(self, pid: int, status: int) -> None:
        child = self.children.pop(pid, None)
        if child is None or child.conn is None:
            return
        self.sel.unregister(child.conn)
        with contextlib.suppress(OSError):
            child.conn.setblocking(True)
            child.conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        child.conn.close()

    def _kill_all(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                self._done(pid, os.waitpid(pid, 0)[1])

    def close(self) -> None:
        """Remove the socket, if it is still this zygote's."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)


def _reset_signals() -> None:
    """A fresh interpreter's dispositions: SIGINT raises KeyboardInterrupt, SIGPIPE and
    SIGXFSZ are ignored, every other signal does its default; none blocked."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _unbuffered_stdio() -> None:
    """sys.stdin/stdout/stderr on the wrapper's fds 0/1/2, stdout and stderr unbuffered
    as under ``python -u`` (what torchrun runs)."""
    def text(fd: int, old: Any, write: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w" if write else "r", closefd=False)
        return io.TextIOWrapper(raw if write else io.BufferedReader(raw),
                                encoding=getattr(old, "encoding", None) or "utf-8",
                                errors=getattr(old, "errors", None) or "strict",
                                write_through=write)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        stream = text(fd, getattr(sys, f"__{name}__"), fd > 0)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)  # what python -u sets them both to


def run_child(job: Job) -> None:
    """In the forked child: become the worker the wrapper stands for, and run it."""
    os.setsid()  # not in the zygote's group, nor the wrapper's (torchrun kills that one)
    for target, fd in enumerate(job.fds):
        os.dup2(fd, target)
    for fd in job.fds:
        if fd > 2:
            os.close(fd)
    env = dict(job.request["env"])
    if job.started_at is not None:
        env[settings.WARM_STARTED_ENV] = f"{job.started_at:.6f}"
    env[settings.WARM_FORKED_ENV] = f"{job.forked_at:.6f}"
    env[settings.WARM_PID_ENV] = str(os.getpid())
    os.environ.clear()
    os.environ.update(env)
    os.chdir(job.request["cwd"])
    _reset_signals()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    _unbuffered_stdio()
    warm.run_here(job.request)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        raise SystemExit(f"usage: python -m trainguard.elastic._zygote SOCKET AGENT_PID, "
                         f"got {argv}")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when numpy loads OpenBLAS
    names = [*DEFAULT_PRELOAD, *lists.items(os.environ.get(settings.WARM_PRELOAD_ENV, ""))]
    begun = time.monotonic()
    preload(names)
    _log(f"preloaded {', '.join(names)} in {time.monotonic() - begun:.1f} s")
    try:
        check_forkable()
    except NotForkable as e:
        raise SystemExit(f"trainguard zygote: {e}") from None
    raw_idle = os.environ.get(settings.WARM_IDLE_S_ENV, "")
    try:
        idle_s = float(raw_idle) if raw_idle else DEFAULT_IDLE_S
    except ValueError:
        raise SystemExit(f"trainguard zygote: ${settings.WARM_IDLE_S_ENV}={raw_idle!r}: "
                         f"expected a number of seconds (default {DEFAULT_IDLE_S:.0f})") from None
    zygote = Zygote(argv[0], int(argv[1]), idle_s)
    try:
        job = zygote.serve()
    except BaseException:
        _log("failed:\n" + traceback.format_exc())
        zygote._kill_all()
        zygote.close()
        raise
    if job is None:
        zygote.close()
        return
    run_child(job)


if __name__ == "__main__":
    main()
