"""Phase-based fault injection for crash-consistency tests.

``TRAINGUARD_CKPT_CRASH_AT=<phase>`` makes the process SIGKILL itself when a save
(``PHASES``) or an upload (``upload.UPLOAD_PHASES``) reaches that phase;
``TRAINGUARD_CKPT_FAIL_AT=<phase>`` makes it raise an ``OSError`` (EIO) there instead,
and ``TRAINGUARD_CKPT_STOP_AT=<phase>`` makes it SIGSTOP itself (alive but stuck, the
way a slow writer looks to ``gc``). The variables are read at each phase, so a test
can set them in a subprocess's environment only. Unset (the normal case), each check
is one dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["PHASES", "CRASH_ENV", "FAIL_ENV", "STOP_ENV", "reached"]

PHASES = (
    "before-data",
    "mid-data",
    "after-data",
    "mid-manifest",
    "before-pointer",
    "after-pointer",
    "retired",
)
"""A save's phases in order. ``retired`` comes after the save returned: the manifests
retention drops are deleted, their data not yet. A partner copy's send has one phase,
``partner-mid-send`` (one file staged on the partner, the others and the commit not);
an async save staged in the store's files (the RAM tier, ``_file_staging``) has
``mid-staging`` (its first chunk file written, before ``save`` returned)."""
CRASH_ENV = "TRAINGUARD_CKPT_CRASH_AT"
FAIL_ENV = "TRAINGUARD_CKPT_FAIL_AT"
STOP_ENV = "TRAINGUARD_CKPT_STOP_AT"


def reached(phase: str) -> None:
    """Called by the save and upload paths at ``phase``; crashes, stops or fails when a
    test asked for it."""
    if os.environ.get(CRASH_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(STOP_ENV) == phase:
        os.kill(os.getpid(), signal.SIGSTOP)
    if os.environ.get(FAIL_ENV) == phase:
        raise OSError(errno.EIO, f"injected I/O error at phase {phase!r}")
