"""Process helpers of this host: whether a process still runs (the one check behind
every "is its owner gone?" decision: stale temp files and writer markers, a DataLoader
worker's ring), a free local port for a server about to start, and the wait until it
answers (the demo, the tests, the benchmarks)."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from trainguard.core.settings import WARM_FORKED_ENV, WARM_PID_ENV, WARM_STARTED_ENV

__all__ = ["forked_at", "free_port", "http_ready", "pid_alive", "started_at", "wait_until"]

_given: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this process: the kernel may
    return a port it just returned, so the ports of servers picked before any of them
    starts (a cluster's nodes and bus ports) could otherwise repeat."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host. A process we may not signal
    (another user's) exists: only ``ProcessLookupError`` means gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _warm(name: str) -> float | None:
    """``$name`` when this process is the warm worker the zygote forked and named
    (``$TRAINGUARD_WARM_PID`` is this pid: a process the worker starts inherits the
    variables but is not that worker); else None."""
    if os.environ.get(WARM_PID_ENV) != str(os.getpid()):
        return None
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def forked_at() -> float | None:
    """When the zygote forked this process (``trainguard.elastic.warm``): where its
    imports ended, since they were done in the zygote before; None when it was not."""
    return _warm(WARM_FORKED_ENV)


def started_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, in unix seconds; None where
    the host does not say (no ``/proc``). This process, forked by a warm zygote: when
    its wrapper started (``/proc`` would give the zygote's start, long before)."""
    if pid is None or pid == os.getpid():
        warm = _warm(WARM_STARTED_ENV)
        if warm is not None:
            return warm
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        # Field 22 (starttime, clock ticks since boot) counts after the command name,
        # which may itself hold spaces: split after its closing parenthesis. Uptime,
        # not /proc/stat's btime: that one is rounded to whole seconds.
        ticks = float(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return now - uptime + ticks / os.sysconf("SC_CLK_TCK")


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Call ``check`` every ``interval_s`` until it returns True (True) or ``timeout_s``
    passed (False: the caller says what was not up, in its own error). An exception
    from ``check`` (the process it waits for exited) ends the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def http_ready(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url`` answers 200 now (a service's ``/readyz``); False on any refusal."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
