"""``trainguard ingest``'s progress line: the dataset's whole with a percentage, then
this process's share, labelled as such (several producers may share a dataset)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"dataset (?P<done>[\d,]+)/(?P<whole>[\d,]+) records \((?P<pct>[\d.]+) %\)"
                   r"  ETA (?P<eta>\S+)  \|  this process: (?P<mine>[\d,]+) records")


def _ingest(url: str, source: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "ingest", "--redis-url", url, "--dataset", "docs",
         "--source", str(source), "--partitions", "4", "--epochs", "3", "--shuffle-buffer", "16"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _last(proc: subprocess.CompletedProcess[str]) -> re.Match[str]:
    assert proc.returncode == 0, proc.stderr
    match = _LINE.search(proc.stderr.strip().splitlines()[-1])
    assert match, proc.stderr
    return match


def _n(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_last_line_shows_the_exact_whole_at_100_percent_and_labels_the_share(
        redis_server, tmp_path: Path) -> None:
    """A 3-epoch dataset of 1,001 records (not a multiple of the 4 partitions; one bad
    line, which is no record): the last line says 3,003 of 3,003 records, 100.0 %, and
    this process's 3,003 as its own. Run again, the dataset is still 3,003 of 3,003 at
    100.0 % while this process's share is 0: the two counts are not the same thing."""
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"i": i}) for i in range(1001)]
    lines.insert(500, "{not json")
    source.write_text("\n".join(lines) + "\n")

    first = _last(_ingest(redis_server.url, source))
    assert (_n(first["done"]), _n(first["whole"]), first["pct"], _n(first["mine"])) == (
        3003, 3003, "100.0", 3003)
    assert first["eta"] == "0:00:00"

    again = _last(_ingest(redis_server.url, source))
    assert (_n(again["done"]), _n(again["whole"]), again["pct"], _n(again["mine"])) == (
        3003, 3003, "100.0", 0)
