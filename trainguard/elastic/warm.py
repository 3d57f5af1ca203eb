"""Warm worker starts: ``torchrun [opts] -m trainguard.elastic.warm train.py [args]``.

torchrun starts every worker as a fresh Python process, at every restart; most of
that start is importing torch (5 s quiet, 13-19 s on a loaded node). This wrapper
is what torchrun starts instead: it asks its node's zygote
(:mod:`trainguard.elastic._zygote`, one per torchrun agent, which imported torch,
torch.distributed, torch._dynamo, trainer_client and checkpoint_store once) to fork a
child that runs ``train.py`` (or ``-m module``) with this process's argv, environment, working
directory and stdin/stdout/stderr. The wrapper stays as the child's stand-in for
torchrun: it forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 to it and exits as the
child did (the same code, or killed by the same signal); when the wrapper dies (the
agent SIGKILLs its process group) the zygote SIGKILLs the child.

The zygote is found by a socket named after the agent (this process's parent) in
``$TRAINGUARD_WARM_DIR``; the first wrapper of an agent starts it, under a file lock
so that the agent's N local workers start one. Without a usable zygote (it failed to
start, ``$TRAINGUARD_WARM=0``) the script runs here, in this process, cold, after
one line on stderr saying why.

This module imports the standard library and ``trainguard.core.settings`` only: no
torch (that is the zygote's work), so a cold start pays nothing for the wrapper.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

from trainguard.core import settings

__all__ = ["FORWARDED", "Request", "main", "parse_argv", "prewarm", "run_here", "runtime_dir",
           "socket_path"]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""The signals the wrapper passes on to its child (torchrun's stop is SIGTERM)."""

START_TIMEOUT_S = 600.0
"""How long the first wrapper waits for a new zygote's imports (13-19 s measured on a
loaded node; a node that takes longer is better served cold)."""

USAGE = ("usage: python -m trainguard.elastic.warm SCRIPT [ARGS...] | "
         "-m MODULE [ARGS...]")

Request = dict[str, Any]


def parse_argv(argv: list[str]) -> Request:
    """What to run, as ``python`` would read it: ``script args...`` or ``-m module
    args...``; a ``--`` before either is dropped (torchrun needs one before a ``-m``)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv[:1] == ["-m"]:
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            raise SystemExit(f"trainguard.elastic.warm: -m needs a module name, got "
                             f"{argv[1:2] or 'nothing'}\n{USAGE}")
        return {"module": argv[1], "args": argv[2:]}
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"trainguard.elastic.warm: expected the training script (or -m "
                         f"MODULE) first, got {argv[:1] or 'nothing'}\n{USAGE}")
    return {"script": argv[0], "args": argv[1:]}


def runtime_dir() -> str:
    """``$TRAINGUARD_WARM_DIR``, else ``$XDG_RUNTIME_DIR/trainguard-warm``, else
    ``/tmp/trainguard-warm-<uid>``: one user's sockets, in a folder only they use."""
    explicit = os.environ.get(settings.WARM_DIR_ENV)
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "trainguard-warm") if xdg else f"/tmp/trainguard-warm-{os.getuid()}"


def _private_dir(path: str) -> None:
    """Make ``path`` (mode 0700) or check that it is ours and private: a socket in a
    folder others can write to could be someone else's zygote."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} belongs to uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}:"
                      f" expected a folder of uid {os.getuid()} that only it can write; set "
                      f"${settings.WARM_DIR_ENV} to one")


def socket_path(folder: str, agent: int) -> str:
    """The socket of agent ``agent``'s zygote (the lock and log share its stem)."""
    return os.path.join(folder, f"agent-{agent}.sock")


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [x for x in f.read().splitlines() if x.strip()]
    except OSError:
        return "no log"
    return lines[-1][:600] if lines else "its log is empty"


def _start_zygote(path: str, agent: int) -> socket.socket:
    """Start the agent's zygote (detached: its own session, its output to a log file,
    so it holds none of torchrun's pipes) and wait until it answers."""
    log_path = path[:-len(".sock")] + ".log"
    with open(log_path, "ab") as log:
        zygote = subprocess.Popen(
            [sys.executable, "-m", "trainguard.elastic._zygote", path, str(agent)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        sock = _connect(path)
        if sock is not None:
            return sock
        code = zygote.poll()
        if code is not None:
            raise OSError(f"the zygote exited {code} before serving ({log_path}: "
                          f"{_tail(log_path)})")
        if time.monotonic() > deadline:
            zygote.kill()
            raise OSError(f"the zygote did not serve within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def zygote_socket(agent: int) -> socket.socket:
    """A connection to agent ``agent``'s zygote, started if none answers (one start per
    agent: the first wrapper holds the lock until it serves, the others then connect)."""
    folder = runtime_dir()
    _private_dir(folder)
    path = socket_path(folder, agent)
    sock = _connect(path)
    if sock is not None:
        return sock
    with open(path[:-len(".sock")] + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _connect(path) or _start_zygote(path, agent)


def _enabled() -> bool:
    return os.environ.get(settings.WARM_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def prewarm(agent_argv: list[str]) -> bool:
    """Start this agent's zygote now, and wait until it serves, when the agent's
    workers are started through this module (``-m trainguard.elastic.warm`` in
    ``agent_argv``, the agent's command line). The trainguard rendezvous handler calls
    it before the agent's first join: a node that joins a running job (a rejoin, a
    replacement) then imports torch before it asks in, while the other nodes still
    train, instead of after, while they wait for it in ``init_process_group`` (12-16 s
    of every rejoin, measured). False (and a warning) where the zygote cannot start:
    the workers then start cold, as they would have."""
    if not _enabled() or "trainguard.elastic.warm" not in agent_argv:
        return False
    try:
        zygote_socket(os.getpid()).close()
    except OSError as e:
        print(f"trainguard.elastic.warm: could not start this agent's zygote before its "
              f"join ({e}); its workers will try again, or start cold", file=sys.stderr,
              flush=True)
        return False
    return True


def _send(sock: socket.socket, request: Request) -> None:
    """The request (length-prefixed JSON) with this process's fds 0, 1, 2 attached."""
    body = json.dumps(request).encode()
    data = struct.pack("!I", len(body)) + body
    sent = socket.send_fds(sock, [data], [0, 1, 2])
    sock.sendall(data[sent:])


def _replies(sock: socket.socket) -> Any:
    """The zygote's replies, one JSON object a line, until it closes."""
    buf = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def _exit_as(status: int) -> None:
    """Exit as the child did: its code, or killed by its signal (torchrun sees -9)."""
    sys.stdout.flush()
    sys.stderr.flush()
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    sig = -code
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to die: the shell's convention


def run_warm(request: Request, agent: int) -> None:
    """Have the zygote run ``request``; never returns (exits as the child did). Raises
    OSError (nothing was started) when the zygote cannot be used."""
    # Handlers first: a stop that comes while the zygote starts or forks is held, then
    # passed to the child (or, if none is started, delivered to this process after all).
    pending: list[int] = []
    live: list[socket.socket] = []

    def forward(sig: int, _frame: Any) -> None:
        if not live:
            pending.append(sig)
            return
        with contextlib.suppress(OSError):
            live[0].sendall(bytes([sig]))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        sock = zygote_socket(agent)
        _send(sock, {**request, "env": dict(os.environ), "cwd": os.getcwd()})
        replies = _replies(sock)
        first = next(replies, None)
        if first is None or "pid" not in first:
            sock.close()
            raise OSError(f"the zygote refused: "
                          f"{(first or {}).get('error', 'it closed the connection')}")
    except (OSError, ValueError):
        for sig in FORWARDED:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
        for held in pending:
            os.kill(os.getpid(), held)
        raise
    live.append(sock)
    for held in pending:
        with contextlib.suppress(OSError):
            sock.sendall(bytes([held]))
    why, status = "closed", None
    try:
        status = next((int(r["status"]) for r in replies if "status" in r), None)
    except (OSError, ValueError) as e:  # never run cold now: the child was started
        why = f"failed ({e})"
    if status is not None:
        _exit_as(status)
    # The zygote went away without a status (killed): the child is killed with it.
    print(f"trainguard.elastic.warm: the connection to the zygote of agent {agent} {why} "
          f"without the exit status of child {first['pid']}", file=sys.stderr, flush=True)
    os._exit(1)


def run_cold(request: Request, why: str) -> None:
    """Run the script here, as ``python -u`` would have, after saying why."""
    print(f"trainguard.elastic.warm: running cold, in this process: {why}",
          file=sys.stderr, flush=True)
    run_here(request)


def run_here(request: Request) -> None:
    """Run the request's script or module as ``__main__`` in this process, with the
    ``sys.argv`` and ``sys.path[0]`` that ``python SCRIPT`` or ``python -m`` gives."""
    args = request["args"]
    if "module" in request:
        sys.argv = [request["module"], *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = request["script"]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    request = parse_argv(sys.argv[1:] if argv is None else argv)
    if not _enabled():
        run_cold(request, f"${settings.WARM_ENV}={os.environ[settings.WARM_ENV]}")
        return
    if "script" in request and not os.path.isfile(request["script"]):
        raise SystemExit(f"trainguard.elastic.warm: no training script at "
                         f"{request['script']!r} (cwd {os.getcwd()}): expected a file")
    try:
        run_warm(request, os.getppid())
    except (OSError, ValueError) as e:
        run_cold(request, f"no usable zygote ({e})")


if __name__ == "__main__":
    main()
