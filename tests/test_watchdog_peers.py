"""Which peers the watchdog's checkers call stopped (``silent_peers``), and what the
thread does with them: a peer is silent when its beat, in a watched phase of this
attempt, is older than the attempt's freshest beat by more than ``peer_silence_s``;
the watchdog fires only once its own phase made no progress for that long and the
silence lasted a confirmation window on its own clock too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from trainer_client.watchdog import Watchdog, WatchdogConfig, silent_peers

HOST = socket.gethostname()


def _beat(at: float, *, attempt: int = 3, phase: str = "train", host: str = "other",
          pid: int = 1) -> dict[str, Any]:
    return {"attempt": attempt, "alive_at": at, "phase": phase, "host": host, "pid": pid}


def test_a_peer_is_silent_against_the_freshest_beat_not_this_hosts_clock() -> None:
    # Every beat 100 s old (this host's clock ahead, or Redis just came back): none is
    # silent; one 5 s behind the others is.
    beats = {0: _beat(1000.0), 1: _beat(1000.2), 2: _beat(995.0)}
    assert silent_peers(beats, rank=0, attempt=3, silence_s=3.0) == [2]
    assert silent_peers(beats, rank=0, attempt=3, silence_s=6.0) == []
    assert silent_peers(beats, rank=2, attempt=3, silence_s=3.0) == []  # never itself


def test_beats_of_another_attempt_an_idle_phase_or_a_process_gone_are_no_silence() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    beats = {0: _beat(1000.0), 1: _beat(900.0, attempt=2), 2: _beat(900.0, phase="idle"),
             3: _beat(900.0, host=HOST, pid=dead.pid),  # its agent restarts the group
             4: _beat(900.0, host=HOST, pid=os.getpid())}
    assert silent_peers(beats, rank=0, attempt=3, silence_s=3.0) == [4]


def test_peer_silence_must_be_non_negative_and_zero_turns_the_check_off() -> None:
    with pytest.raises(ValueError, match="peer_silence_s must be >= 0"):
        WatchdogConfig(peer_silence_s=-1)
    assert WatchdogConfig.from_env("peer_silence_s=2.5").peer_silence_s == 2.5
    asked: list[float] = []
    wd = Watchdog(WatchdogConfig(peer_silence_s=0), beat=lambda d: None, fire=lambda r: None,
                  peers=lambda s: asked.append(s) or [1], exit=lambda c: None)
    wd.stop()
    assert wd._peers is None and asked == []


def _watch(silent: list[int], *, seconds: float) -> tuple[list[dict[str, Any]], list[float]]:
    """A watchdog in the train phase with no progress, ``silent`` peers reported by
    its check; what it fired and when its check was asked, within ``seconds``."""
    cfg = WatchdogConfig(k=10, floor_s=60, heartbeat_s=0.1, peer_silence_s=0.5)
    fired: list[dict[str, Any]] = []
    asked: list[float] = []
    codes: list[int] = []

    def peers(silence_s: float) -> list[int]:
        asked.append(time.monotonic())
        assert silence_s == 0.5
        return silent

    wd = Watchdog(cfg, beat=lambda d: None, fire=fired.append, peers=peers,
                  exit=codes.append)
    started = time.monotonic()
    wd.enter("train")
    deadline = time.monotonic() + seconds
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.stop()
    assert all(t - started > 0.5 for t in asked), "asked before the phase stalled 0.5 s"
    return fired, asked


def test_a_silent_peer_fires_once_it_was_silent_a_confirmation_window_long() -> None:
    fired, asked = _watch([1], seconds=10)
    (report,) = fired
    assert report["trigger"] == "peer_silence" and report["silent"] == [1]
    assert report["limit_s"] == 0.5 and report["stalled_s"] < 60
    # Silent since the first check, fired no sooner than confirm_s (1 s) after it.
    assert asked[-1] - asked[0] >= 1.0


def test_no_silent_peer_leaves_the_step_budget_in_charge() -> None:
    fired, asked = _watch([], seconds=2.5)
    assert fired == [] and len(asked) >= 5  # checked every beat, nothing to say
