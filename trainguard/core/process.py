"""Whether a process of this host still runs: the one check behind every "is its owner
gone?" decision (stale temp files and writer markers, a DataLoader worker's ring)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
