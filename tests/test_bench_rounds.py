"""The benchmarks' shared machinery (``bench/rounds.py``, ``bench/report.py``): rounds
run in a balanced order and drop the warm-up, ratios pair samples of one round, results
files merge sections, and README's section is regenerated from a results file.

No timing is asserted: wall-clock samples are built by hand where numbers matter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import rounds as rd  # noqa: E402


def test_rounds_run_a_balanced_order_and_discard_the_warm_up():
    """Measured rounds follow a Williams square (for three contestants: six rounds,
    each in every position twice and right after each other one twice, so what one
    leaves behind does not always land on the same other one); the warm-up round
    runs before them and its samples are not kept; before and after run around every
    contestant, outside its measurement."""
    calls: list[str] = []

    def make(name: str):
        def run() -> int:
            calls.append(name)
            return 10
        return run

    r = rd.run_rounds({n: make(n) for n in "abc"}, rounds=6, warmup=1,
                      before=lambda n: calls.append("<" + n),
                      after=lambda n: calls.append(n + ">"))
    order = "".join(c for c in calls if len(c) == 1)
    measured = ["abc", "bca", "cab", "cba", "acb", "bac"]
    assert order == "bac" + "".join(measured)  # warm-up: the last row of the squares
    assert calls[:3] == ["<b", "b", "b>"]
    assert {(row[i], row[i + 1]) for row in measured for i in range(2)} == {
        (x, y) for x in "abc" for y in "abc" if x != y}
    assert {n: len(v) for n, v in r.samples.items()} == {"a": 6, "b": 6, "c": 6}
    assert all(s.nbytes == 10 for v in r.samples.values() for s in v)


def test_ratios_pair_samples_of_the_same_round():
    """The median and range are of per-round ratios, not of separate medians."""
    r = rd.Rounds({
        "tg": [rd.Sample(1.0, 0.5, 2**30), rd.Sample(4.0, 0.5, 2**30), rd.Sample(2.0, 1, 2**30)],
        "base": [rd.Sample(2.0, 1.0, 2**30), rd.Sample(4.0, 1.0, 2**30), rd.Sample(1.0, 1, 2**30)],
    })
    speed = rd.speed_ratio(r, "tg", "base", target=">= 0.9x")
    assert speed.values == [2.0, 1.0, 0.5]
    assert speed.median == 1.0
    assert speed.cpu_values == [2.0, 2.0, 1.0]  # CPU of base over CPU of tg, per round
    assert speed.doc() == {"median": 1.0, "min": 0.5, "max": 2.0, "rounds": 3,
                           "target": ">= 0.9x", "note": "", "cpu_median": 2.0,
                           "cpu_min": 1.0, "cpu_max": 2.0}
    assert rd.time_ratio(r, "tg", "base").values == [0.5, 1.0, 2.0]
    assert r.cpu_per_gib("tg") == 0.5 and r.gib_per_s("base") == 0.5


def test_results_file_merges_sections_and_feeds_readme_and_compare(tmp_path, capsys):
    """Each bench adds its own section to one file; report renders the README
    section from it and flags headlines that differ by more than 15 % between runs."""
    path = tmp_path / "results" / "host-stamp.json"
    r = rd.Rounds({"tg": [rd.Sample(1.0, 0.2, 2**30)], "base": [rd.Sample(1.5, 0.1, 2**30)]})
    head = rd.speed_ratio(r, "tg", "base", name="load speed / dd read (cold cache)",
                          target=">= 0.9x", note="the disk read 900 MiB/s")
    section = {"args": {"tensors": 20, "rounds": 1}, "state_mib": 256.0,
               "cold_cache_method": "posix_fadvise(DONTNEED)",
               "peak_rss_growth_mib": {"trainguard_load": 0.0, "torch_load": 256.0},
               "rows": rd.rows_doc(r), "headlines": {head.name: head.doc()}}
    rd.write_section(path, "checkpoint", section, {"cpus": 2, "dd": {"read_cold_mib_s": 900.0}})
    rd.write_section(path, "other", {"headlines": {}}, {"cpus": 99})
    doc = json.loads(path.read_text())
    assert set(doc["benches"]) == {"checkpoint", "other"}
    assert doc["machine"] == {"cpus": 2, "dd": {"read_cold_mib_s": 900.0}}  # first one kept
    text = report.render(doc, "x.json")
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert ("| load speed / dd read (cold cache) | **1.50x** (1.50-1.50) (target >= 0.9x) | "
            "0.50x (0.50-0.50) |") in text
    assert "cold read 900.0 MiB/s" in text
    assert "- load speed / dd read (cold cache): the disk read 900 MiB/s." in text

    other = tmp_path / "b.json"
    doc["benches"]["checkpoint"]["headlines"][head.name]["median"] = 1.0  # 20 % off 1.25
    other.write_text(json.dumps(doc))
    assert report.compare([path, path]) == 0
    assert report.compare([path, other]) == 1
    out = capsys.readouterr().out
    assert "> 15 %" in out and "0 of 1 headline ratios agree" in out
    # Only wall-time headlines count; CPU-time ratios are shown beside them.
    doc["benches"]["checkpoint"]["headlines"][head.name] |= {"median": 1.5, "cpu_median": 9.0}
    other.write_text(json.dumps(doc))
    assert report.compare([path, other]) == 0
    assert "1 of 1 headline ratios agree" in capsys.readouterr().out
    del doc["benches"]["checkpoint"]["headlines"][head.name]
    other.write_text(json.dumps(doc))
    assert report.compare([path, other]) == 1  # missing from a run: not agreeing


def test_dir_is_created_when_missing_and_cache_drop_names_its_method(tmp_path):
    made = rd.ensure_dir(str(tmp_path / "a" / "b"))
    assert made.is_dir()
    f = made / "f.bin"
    f.write_bytes(b"x" * 4096)
    # Per file (the whole page cache is the bench's to drop, not a test's).
    assert rd.drop_cache([made], whole_cache=False) == "posix_fadvise(DONTNEED)"
    assert f.read_bytes() == b"x" * 4096


def test_report_refuses_a_foreign_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a trainguard bench results file"):
        report.compare([bad])
