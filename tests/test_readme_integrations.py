"""The integrations guide (docs/guides/integrations.md, once README's "Where you already train"): every shell block runs as written (ingest the
bundled text tokenized and packed, then each example killed at step 25 and resumed,
ending with every sequence trained exactly once; under ``make chaos``: the default
suite has each integration's kill -9 ledger test instead), and every Python block is
the example's own code, word for word."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
# 1110 sequences in 4 partitions (278, 278, 277, 277), 16 a batch. Batches span
# partitions in both orders (greedy: Lightning, HF; the session's default,
# deterministic: Accelerate), so only an epoch's last batch is short:
# ceil(1110 / 16) = 70 steps for each (docs/guides/batches.md).
ENDS = {"examples/lightning_gpt.py": 70, "examples/hf_gpt.py": 70,
        "examples/accelerate_gpt.py": 70}


def _blocks(kind: str) -> list[str]:
    section = (ROOT / "docs" / "guides" / "integrations.md").read_text()
    return re.findall(rf"```{kind}\n(.*?)```", section, flags=re.S)


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_python_blocks_are_the_examples_code() -> None:
    examples = " ".join(" ".join(p.read_text().split()) for p in (ROOT / "examples").glob("*.py"))
    blocks = _blocks("python")
    assert len(blocks) == 3
    for block in blocks:
        assert " ".join(block.split()) in examples, block


@pytest.mark.chaos  # seven framework processes (about 40 s idle): `make chaos` runs it
def test_shell_blocks_run_kill_and_resume_exactly_once(redis_server: RedisServer,
                                                        tmp_path: Path) -> None:
    """The ingest, then per example: the --die-at-step run dies by SIGKILL after
    its step-20 checkpoint, and the plain run resumes from step 20, ends at the step
    its batch order makes (ENDS) and reports every sequence trained exactly once."""
    env = {**os.environ, "TRAINGUARD_REDIS_URL": redis_server.url, "TMPDIR": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    commands = [c for block in _blocks("sh") for c in _commands(block)]
    assert [c.split()[1] for c in commands if c.startswith("python")] == [
        "examples/lightning_gpt.py", "examples/lightning_gpt.py", "examples/hf_gpt.py",
        "examples/hf_gpt.py", "examples/accelerate_gpt.py", "examples/accelerate_gpt.py"]
    for command in commands:
        run = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        out = run.stdout + run.stderr
        if "--die-at-step 25" in command:
            assert run.returncode in (-9, 137) and "SIGKILL at step 25" in out, out[-3000:]
        else:
            assert run.returncode == 0, out[-3000:]
        if command.startswith("python") and "--die-at-step" not in command:
            end = ENDS[command.split()[1]]
            assert f"resumed from step 20, ended at step {end}" in out, out[-3000:]
            assert "sequences trained: 1110 of 1110; each exactly once" in out, out[-3000:]
