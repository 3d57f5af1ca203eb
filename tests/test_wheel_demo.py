"""Installed from a wheel, ``trainguard demo`` runs: the wheel carries the trainer the
demo kills and resumes, and nothing reaches back into a source checkout.

The wheel is built from a copy of the working tree (an in-tree build would leave
``build/`` and ``*.egg-info`` in the checkout) and installed with ``--no-deps`` into a
fresh venv. Its dependencies (torch, redis, ...) come from the venv that runs the
tests, through a ``.pth`` line: a plain path, so the editable install there (a
meta-path finder that would serve the checkout's ``trainguard``) is not loaded. About
40 s on two cores: part of ``make test``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _copy_of_the_tree(dest: Path) -> Path:
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():  # a file deleted but not yet committed is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
def test_demo_runs_from_an_installed_wheel_outside_the_checkout(tmp_path: Path) -> None:
    """The wheel holds the demo's trainer; its ``trainguard demo --help`` works, and a
    tiny demo run from a directory outside the checkout, with no PYTHONPATH, imports
    trainguard from the wheel and reports 200 of 200 records trained, 0 lost, 0
    duplicated, one kill."""
    src = _copy_of_the_tree(tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          str(src), "-w", str(dist)], cwd=tmp_path)
    (wheel,) = dist.glob("trainguard-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    (site / "tests-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([str(python), "-c", "import trainguard; print(trainguard.__file__)"],
                 cwd=outside, env=env).stdout.strip()
    assert Path(where).is_relative_to(site), where

    trainguard = str(venv / "bin" / "trainguard")
    helped = _run([trainguard, "demo", "--help"], cwd=outside, env=env).stdout
    assert "--records" in helped
    ran = _run([trainguard, "demo", "--records", "200", "--checkpoint-every", "2",
                "--step-delay-ms", "0", "--json"], cwd=outside, env=env)
    summary = json.loads(ran.stdout)
    assert (summary["records_ingested"], summary["records_trained"]) == (200, 200)
    assert (summary["lost"], summary["duplicated"], summary["kills"]) == (0, 0, 1)
