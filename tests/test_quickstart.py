"""README's quickstart runs as written, line by line: ingest a uint8 npy (any integer
dtype trains), the copied loop SIGKILLed at step 50 resumes from its step-40
checkpoint and says so in one line, every record of both epochs is consumed exactly
once, and a rerun of the finished run says it is finished and writes no checkpoint.

The first line (``pip install -e .``) is what this test environment already is; the
wheel install is tests/test_wheel.py's. The Redis port is replaced by a free one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.servers import free_port
from trainguard.core import streams
from trainguard.core.rank_record import checkpoint_positions

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS, RECORDS = 16, 2000  # the defaults; 125 records a partition, 4 batches of 32


def quickstart_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("[start:quickstart]"):text.index("[end:quickstart]")]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README's quickstart has no sh block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) <= 10, "the quickstart promises ten lines"
    return lines


def test_quickstart_lines_kill_resume_finish_exactly_once(tmp_path: Path) -> None:
    """Each line exits as the README says (the killed run by SIGKILL: 137), and the
    final checkpoint holds every record of both epochs once."""
    lines = quickstart_lines()
    assert lines[0].startswith("pip install -e .")
    port = str(free_port())
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the clone's examples/
    script = "\n".join(f"{ln.replace('6390', port)}\necho \"@@rc $?\"" for ln in lines[1:])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TRAINGUARD_REDIS_URL", None)
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, timeout=900,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:  # never leave the quickstart's redis-server running
        subprocess.run(["redis-cli", "-p", port, "shutdown", "nosave"], capture_output=True)
    out = proc.stdout
    parts = re.split(r"@@rc (\d+)\n", out)
    outputs, codes = parts[0::2], [int(c) for c in parts[1::2]]
    assert len(codes) == len(lines) - 1, out[-3000:]
    runs = [(c, o) for ln, c, o in zip(lines[1:], codes, outputs) if "train.py" in ln and "cp " not in ln]
    assert len(runs) == 3, lines
    assert [c for c, _ in runs] == [128 + 9, 0, 0], out[-4000:]
    assert all(c == 0 for ln, c, _ in zip(lines[1:], codes, outputs)
               if "train.py" not in ln or "cp " in ln), out[-4000:]
    assert "step 40 " in runs[0][1] and "step 60 " not in runs[0][1]
    assert re.search(r"run exp42 resumed from checkpoint \S+ \(step 40\): epoch \d+, \d+ records",
                     runs[1][1]), runs[1][1][-2000:]
    assert "run exp42 is finished" in runs[2][1], runs[2][1][-2000:]

    from checkpoint_store import CheckpointStore

    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    manifest = store.latest()
    steps = [m.step for m in store.list()]
    assert manifest is not None
    pos = checkpoint_positions(store, manifest)  # from the ranks' state objects
    store.close()
    assert steps.count(manifest.step) == 1  # the finished rerun wrote no second one
    per = RECORDS // PARTITIONS
    ends = {p: streams.make_id(1, per - 1) for p in range(PARTITIONS)}
    assert pos.offsets == ends  # both epochs, all records
    assert pos.batches == {p: 2 * 4 for p in range(PARTITIONS)}  # none twice
