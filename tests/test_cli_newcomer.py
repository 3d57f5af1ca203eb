"""A newcomer's CLI: every refusal is one line (what was expected, what was found,
what to do) with a non-zero exit and nothing left behind; every flag has help text;
``--help`` never imports torch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.servers import free_port
from trainguard.ops import cli

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_ckpt_ls_of_a_missing_path_exits_3_and_creates_nothing(tmp_path: Path) -> None:
    """Not "no checkpoints" and exit 0: a typo must not read as an empty store."""
    missing = tmp_path / "nope" / "ckpt"
    proc = _cli("ckpt", "ls", f"file://{missing}")
    assert proc.returncode == 3
    assert "expected a checkpoint store at" in _one_line(proc)
    assert not (tmp_path / "nope").exists()


def test_ckpt_store_path_that_is_a_file_exits_2_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_bytes(b"not a store")
    proc = _cli("ckpt", "ls", str(path))
    assert proc.returncode == 2
    assert "found a file at" in _one_line(proc)
    assert path.read_bytes() == b"not a store"


def test_s3_store_without_credentials_exits_2_in_one_line(tmp_path: Path) -> None:
    """botocore's NoCredentialsError becomes what to set (no network is reached: the
    request is refused before it is signed)."""
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "",
           "AWS_PROFILE": "", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    env = {k: v for k, v in env.items() if v} | {"HOME": str(tmp_path)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "ckpt", "ls", "s3://bucket/ckpt",
         "--storage-options", f'{{"endpoint_url": "http://127.0.0.1:{free_port()}"}}'],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 2, proc.stderr
    assert "expected S3 credentials" in _one_line(proc)


def test_ingest_without_source_of_a_new_dataset_registers_nothing(redis_server) -> None:
    proc = _cli("ingest", "--redis-url", redis_server.url, "--dataset", "fresh")
    assert proc.returncode == 3
    assert "is not registered" in _one_line(proc) and "--source" in proc.stderr
    client = redis.Redis.from_url(redis_server.url)
    assert client.keys("*") == []
    client.close()


def _actions(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_and_argument_has_help_text() -> None:
    missing = [f"{path} {a.option_strings or a.dest}"
               for path, a in _actions(cli.build_parser(), "trainguard") if not a.help]
    assert not missing, missing


@pytest.mark.parametrize("argv", [["--help"], ["ckpt", "--help"], ["probe", "--help"],
                                  ["ckpt", "ls", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    code = ("import sys\nfrom trainguard.ops.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr
