"""`trainguard demo` at reduced size: its summary says 0 lost and 0 duplicated, and
it leaves no process behind, also when interrupted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _demo(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard", "demo", *args], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _started_pids(stderr: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, pid in re.findall(r"^started (.+) pid=(\d+)$", stderr, re.M):
        out.setdefault(name, []).append(int(pid))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for every practical purpose.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_demo_reduced_counts_exactly_once_and_cleans_up():
    """600 records, trainer SIGKILLed between checkpoints and restarted: the JSON
    summary says 600 ingested, 600 trained, 0 duplicated, 0 lost, one kill, a resume
    from an earlier checkpoint; redis, service and both trainers are gone after."""
    proc = _demo("--records", "600", "--checkpoint-every", "4", "--step-delay-ms", "20",
                 "--json")
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["records_ingested"] == 600 and summary["records_trained"] == 600
    assert (summary["lost"], summary["duplicated"]) == (0, 0)
    assert summary["kills"] == 1 and summary["dead_letters"] == 0
    assert summary["resumed_from_step"] < summary["killed_at_step"]
    assert summary["checkpoints_written"] >= 3
    assert summary["admin_api"].startswith("http://127.0.0.1:")
    pids = _started_pids(err)
    assert set(pids) == {"redis-server", "ingest service", "trainer"}
    assert len(pids["trainer"]) == 2
    assert not [p for ps in pids.values() for p in ps if _alive(p)]
    assert not Path(summary["workdir"]).exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_leaves_no_process(sig):
    """Ctrl-C (SIGINT) or SIGTERM while the trainer runs: exit code 130, every
    child gone."""
    proc = _demo("--records", "3000", "--step-delay-ms", "200")
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 120
    try:
        while "started trainer" not in seen and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
        assert "started trainer" in seen, seen
        time.sleep(1.0)
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, seen + rest
    pids = _started_pids(seen + rest)
    assert set(pids) >= {"redis-server", "ingest service", "trainer"}
    assert not [p for ps in pids.values() for p in ps if _alive(p)]


def test_demo_keep_serves_the_dashboard_until_ctrl_c():
    """--keep: after the summary, the demo prints the dashboard URL and stays up; the
    page is served, the run's history shows the SIGKILL as one restart (from the
    manifests the demo's trainers wrote); Ctrl-C then stops every child (exit 0)."""
    import shutil

    import requests

    proc = _demo("--records", "300", "--checkpoint-every", "4", "--step-delay-ms", "20",
                 "--keep")
    assert proc.stdout is not None
    seen = ""
    try:
        deadline = time.monotonic() + 240
        while "the service stays up" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        found = re.search(r"the service stays up: open (http://127\.0\.0\.1:\d+/ui) ", seen)
        assert found, seen
        url = found.group(1)
        page = requests.get(url, timeout=10)
        assert page.status_code == 200 and "<title>trainguard</title>" in page.text
        runs = requests.get(url.replace("/ui", "/admin/runs"), timeout=30).json()["runs"]
        assert [(r["run"], r["restarts"]) for r in runs] == [("mlp", 1)]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    pids = _started_pids(err)
    assert set(pids) == {"redis-server", "ingest service", "trainer"}
    assert not [p for ps in pids.values() for p in ps if _alive(p)]
    workdir = re.search(r"files stay in (\S+)\)", seen)
    assert workdir and Path(workdir.group(1)).is_dir()
    shutil.rmtree(workdir.group(1))
