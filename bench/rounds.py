"""What every benchmark shares: interleaved rounds, paired ratios, the page cache, the
machine's own limits, and the JSON results file.

Why rounds: on a shared 2-core machine one measurement of A followed by one of B
mostly measures which ran first and what else the machine was doing. So each round
runs every contestant once, in an order that changes from round to round (a
balanced Latin square: each contestant in every position, and right after every
other one, equally often; see ``round_order``), warm-up rounds are discarded, and a ratio is taken *within* a round (the two
sides shared the machine's mood) before the median over rounds is taken. The range of
those per-round ratios is printed beside the median: a wide range says the machine
was noisy, whatever the median says.

Each contestant is a callable returning the payload bytes it moved (or None); wall
time and CPU time (this process and the children it waited for, e.g. ``dd`` or
``redis-cli``) are measured around it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ measuring
@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    nbytes: int
    server_cpu_s: float | None = None
    """CPU of a server process the contestant drives (redis-server), when probed."""


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(fn: Callable[[], int | None], server_pid: int | Sequence[int] | None = None) -> Sample:
    """``server_pid``: one server's process, or several (a cluster's nodes) summed."""
    pids = [server_pid] if isinstance(server_pid, int) else list(server_pid or ())
    s0 = sum(process_cpu_s(p) for p in pids)
    c0, t0 = _cpu_now(), time.perf_counter()
    moved = fn()
    wall = time.perf_counter() - t0
    cpu = _cpu_now() - c0
    server = sum(process_cpu_s(p) for p in pids) - s0 if pids else None
    return Sample(wall, cpu, int(moved or 0), server)


@dataclass
class Rounds:
    """Samples of each contestant, one per measured round (warm-up excluded)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def walls(self, name: str) -> list[float]:
        return [s.wall_s for s in self.samples[name]]

    def median_wall(self, name: str) -> float:
        return statistics.median(self.walls(name))

    def cpu_per_gib(self, name: str) -> float | None:
        """Median CPU seconds per GiB moved (None when nothing is counted in bytes)."""
        per = [s.cpu_s / (s.nbytes / 2**30) for s in self.samples[name] if s.nbytes]
        return statistics.median(per) if per else None

    def server_cpu_per_gib(self, name: str) -> float | None:
        per = [s.server_cpu_s / (s.nbytes / 2**30) for s in self.samples[name]
               if s.nbytes and s.server_cpu_s is not None]
        return statistics.median(per) if per else None

    def gib_per_s(self, name: str) -> float | None:
        rates = [s.nbytes / 2**30 / s.wall_s for s in self.samples[name] if s.nbytes]
        return statistics.median(rates) if rates else None

    def paired(self, num: str, den: str) -> list[float]:
        """Per-round ``wall(num) / wall(den)``."""
        return [a.wall_s / b.wall_s for a, b in zip(self.samples[num], self.samples[den])]

    def paired_cpu(self, num: str, den: str) -> list[float]:
        """Per-round ratio of CPU time spent (client, its children and the probed
        server): what the wall ratio would be on cores of one's own, and far steadier
        than wall time on a shared machine."""
        def cpu(s: Sample) -> float:
            return s.cpu_s + (s.server_cpu_s or 0.0)
        return [cpu(a) / cpu(b) if cpu(b) > 0 else float("nan")
                for a, b in zip(self.samples[num], self.samples[den])]


def round_order(n: int, r: int) -> list[int]:
    """Contestant indices in round ``r``: a balanced Latin square (Williams design).

    Rotating one order (A B C D, B C D A, ...) moves each contestant through every
    position, but keeps its neighbours: B would always run right after A, so
    whatever A leaves behind (dirty pages, a journal commit, a cold cache, freed
    memory) would always land on B, round after round, and bias the B/A ratio the
    same way every time. In a Williams square every contestant also follows every
    other one equally often (over ``n`` rounds, ``2n`` for odd ``n``)."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [(i + r) % n for i in first]
    # Odd n: rows n..2n-1 are the first n reversed, which balances the neighbours.
    return row[::-1] if n % 2 and (r // n) % 2 else row


def run_rounds(
    contestants: Mapping[str, Callable[[], int | None]],
    *,
    rounds: int,
    warmup: int = 1,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
    server_pid: int | None = None,
    server_pids: Mapping[str, Sequence[int]] | None = None,
) -> Rounds:
    """Run every contestant once per round, in the order of ``round_order`` (each
    contestant in every position and after every other one); ``before`` and ``after``
    (outside the measurement) prepare and clean up, e.g. drop caches. With
    ``server_pid``, that process's CPU during each run is recorded too; ``server_pids``
    names the server processes per contestant instead (a cluster's)."""
    names = list(contestants)
    out = Rounds({n: [] for n in names})
    for r in range(warmup + rounds):
        # Measured rounds start at the first row, so whole squares are measured.
        for name in (names[i] for i in round_order(len(names), r - warmup)):
            if before is not None:
                before(name)
            pids = server_pids.get(name) if server_pids is not None else server_pid
            sample = measure(contestants[name], pids)
            if after is not None:
                after(name)
            if r >= warmup:
                out.samples[name].append(sample)
    return out


@dataclass
class Ratio:
    """A headline: the median of per-round ratios, their range, and the target."""

    name: str
    values: list[float]
    target: str = ""
    note: str = ""
    cpu_values: list[float] = field(default_factory=list)
    """The same ratio of CPU time, per round (see ``Rounds.paired_cpu``)."""

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def cpu_median(self) -> float | None:
        return statistics.median(self.cpu_values) if self.cpu_values else None

    def text(self) -> str:
        lo, hi = min(self.values), max(self.values)
        tgt = f"  [target {self.target}]" if self.target else ""
        cpu = (f"  CPU {self.cpu_median:5.2f}x ({min(self.cpu_values):.2f}-"
               f"{max(self.cpu_values):.2f})" if self.cpu_median is not None else "")
        note = f"\n      ({self.note})" if self.note else ""
        return f"{self.name:58s} {self.median:6.2f}x  ({lo:.2f}-{hi:.2f}){cpu}{tgt}{note}"

    def doc(self) -> dict[str, Any]:
        doc = {"median": round(self.median, 4), "min": round(min(self.values), 4),
               "max": round(max(self.values), 4), "rounds": len(self.values),
               "target": self.target, "note": self.note}
        if self.cpu_values:
            doc |= {"cpu_median": round(statistics.median(self.cpu_values), 4),
                    "cpu_min": round(min(self.cpu_values), 4),
                    "cpu_max": round(max(self.cpu_values), 4)}
        return doc


def speed_ratio(r: Rounds, tg: str, base: str, **kw: str) -> Ratio:
    """trainguard's speed relative to the baseline: ``wall(base) / wall(tg)`` per round
    (higher is better; 0.8x means 80 % of the baseline's throughput)."""
    return Ratio(kw.pop("name", f"{tg} / {base} (speed)"), r.paired(base, tg), **kw,
                 cpu_values=r.paired_cpu(base, tg))


def time_ratio(r: Rounds, tg: str, base: str, **kw: str) -> Ratio:
    """``wall(tg) / wall(base)`` per round (lower is better)."""
    return Ratio(kw.pop("name", f"{tg} / {base} (time)"), r.paired(tg, base), **kw,
                 cpu_values=r.paired_cpu(tg, base))


def _num(v: float | None, width: int) -> str:
    return f"{v:{width}.2f}" if v is not None else " " * (width - 1) + "-"


def table(r: Rounds, rows: Iterable[str] | None = None) -> str:
    names = list(rows or r.samples)
    server = any(r.server_cpu_per_gib(n) is not None for n in names)
    lines = [f"{'operation':50s} {'median s':>9s} {'range s':>15s} {'GiB/s':>7s} {'CPU s/GiB':>9s}"
             + (f" {'server CPU s/GiB':>16s}" if server else "")]
    for name in names:
        walls = r.walls(name)
        lines.append(
            f"{name:50s} {statistics.median(walls):9.3f} "
            f"{min(walls):7.3f}-{max(walls):<7.3f} {_num(r.gib_per_s(name), 7)} "
            f"{_num(r.cpu_per_gib(name), 9)}"
            + (f" {_num(r.server_cpu_per_gib(name), 16)}" if server else "")
        )
    return "\n".join(lines)


def rows_doc(r: Rounds) -> dict[str, Any]:
    return {
        name: {"wall_s": [round(w, 5) for w in r.walls(name)],
               "median_s": round(r.median_wall(name), 5),
               "gib_per_s": r.gib_per_s(name), "cpu_s_per_gib": r.cpu_per_gib(name),
               "server_cpu_s_per_gib": r.server_cpu_per_gib(name)}
        for name in r.samples
    }


# ------------------------------------------------------------------ the page cache
def drop_cache(paths: Iterable[Path], *, whole_cache: bool = True) -> str:
    """Make the next read of ``paths`` come from the disk. As root (and with
    ``whole_cache``) the whole page cache is dropped (``echo 1 >
    /proc/sys/vm/drop_caches``, after a sync so dirty pages are written and can go);
    otherwise each file's pages are dropped with ``posix_fadvise(DONTNEED)``. Returns
    the method used, for the report."""
    files = [p for path in paths for p in _files(path)]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # DONTNEED skips dirty pages
        finally:
            os.close(fd)
    if whole_cache and os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "drop_caches"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(root) / n for root, _, names in os.walk(path) for n in names]


# ------------------------------------------------------------------ the machine
def memcpy_gib_s(size_mib: int = 256, repeat: int = 5) -> float:
    """Best of ``repeat`` single-thread copies between two paged-in buffers."""
    src = np.ones(size_mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    return size_mib / 1024 / best


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dd_read(path: Path) -> int:
    """``dd`` of ``path`` to /dev/null in 4 MiB blocks; returns the bytes read."""
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True,
                   capture_output=True)
    return path.stat().st_size


def dd_figures(directory: Path, size_mib: int = 512) -> dict[str, float | str]:
    """The disk under ``directory`` as ``dd`` sees it: write with fsync, read cold."""
    with tempfile.TemporaryDirectory(prefix="tg-dd-", dir=directory) as tmp:
        f = Path(tmp) / "dd.bin"
        t = _timed(lambda: subprocess.run(
            ["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={size_mib // 4}",
             "conv=fsync"], check=True, capture_output=True))
        method = drop_cache([f])
        r = _timed(lambda: dd_read(f))
    return {"write_fsync_mib_s": round(size_mib / t, 1), "read_cold_mib_s": round(size_mib / r, 1),
            "cache_drop": method}


def machine(directory: Path | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "host": socket.gethostname(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "kernel": platform.release(),
        "memcpy_gib_s": round(memcpy_gib_s(), 2),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
        doc["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    if directory is not None:
        doc["dd"] = dd_figures(directory)
    return doc


# ------------------------------------------------------------------ results file
def results_path() -> Path:
    """``bench/results/<host>-<UTC stamp>.json``; ``make bench`` sets BENCH_STAMP once so
    its three benches write one file."""
    stamp = os.environ.get("BENCH_STAMP") or _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H%MZ")
    return RESULTS_DIR / f"{socket.gethostname()}-{stamp}.json"


def write_section(path: Path, bench: str, section: dict[str, Any],
                  machine_doc: dict[str, Any] | None = None) -> None:
    """Merge one bench's section into the results file (written atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("format", "trainguard.bench/1")
    doc.setdefault("commit", _commit())
    # Each section says which code it measured: a results file may merge benches of
    # different runs (one bench rerun after a change).
    doc.setdefault("benches", {})[bench] = {**section, "commit": _commit()}
    if machine_doc is not None:
        known = doc.setdefault("machine", {})
        known.update({k: v for k, v in machine_doc.items() if k not in known or k == "dd"})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _commit() -> str | None:
    """The measured code's commit (``+dirty`` with uncommitted changes), if in git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS_DIR.parent,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!bench/results"], cwd=RESULTS_DIR.parent.parent,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def print_headlines(ratios: list[Ratio]) -> None:
    print("headline ratios: median of per-round ratios (range over rounds); then the same "
          "ratio of CPU time (client + redis-server)")
    for r in ratios:
        print("  " + r.text())


def ensure_dir(path: str | None) -> Path:
    """``--dir``: created when missing (with its parents)."""
    base = Path(path) if path else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    return base


def rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
