"""``make compose`` checks for Docker's compose v2 plugin before it starts anything:
where ``docker compose version`` fails (no Docker, or Docker without the plugin, as
on this machine), it exits 2 with what is missing and how to get it, instead of
docker's "unknown shorthand flag: 'd'". It still writes ``.env`` with fresh secrets
first (the stack's one-time setup), never the placeholder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(_has_compose_v2(), reason="the compose plugin is installed: make compose would start the stack")
def test_make_compose_without_the_plugin_says_what_is_missing(tmp_path: Path) -> None:
    for name in ("Makefile", ".env.example", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    proc = subprocess.run(["make", "-s", "-C", str(tmp_path), "compose"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "'docker compose version' failed" in proc.stderr
    assert "docker-compose-plugin" in proc.stderr and "make demo" in proc.stderr
    assert "unknown shorthand flag" not in proc.stderr
    env = (tmp_path / ".env").read_text()
    assert env and "CHANGE_ME" not in env
