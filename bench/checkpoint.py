"""Checkpoint benchmark: trainguard's CheckpointStore against raw writes, torch.save,
torch.load and ``dd``, on one disk, every write fsync'd, in interleaved rounds.

    python bench/checkpoint.py [--size-mib 256] [--rounds 8] [--dir /path] [--dcp]
    python bench/checkpoint.py --dist 4 --size-mib 256     # FSDP2 ranks vs DCP, in rounds

Four groups, each run in rounds (a balanced order, the first round discarded as
warm-up; see ``rounds.py``):

- save: trainguard sync save (20 tensors), raw write + fsync of the same bytes (one
  file per tensor), ``torch.save`` + fsync, and ``dd``
  writing as many bytes with ``conv=fsync`` (the disk's own figure, in the same
  rounds). Before each, the previous round's files are deleted and the deletion
  synced, so no contestant pays for another's (the disk is mounted with ``discard``
  here: a deletion's TRIMs are issued by the next journal commit, i.e. the next
  fsync); and, as a pair of its own, the 20-tensor save against the same bytes as
  1,000 tensors;
- load, hot page cache: trainguard load into the caller's tensors (every checksum
  verified) against ``torch.load`` of the same state;
- load, cold page cache (dropped before each read: ``drop_caches`` as root, else
  ``posix_fadvise(DONTNEED)`` on the files): trainguard load against ``dd`` reading a
  file of the same bytes;
- async save: the time ``save(blocking=False)`` blocks (steady state: the staging
  buffer exists) against a copy into preallocated buffers.

Peak RSS growth of a hot load is measured once afterwards (the kernel's high-water
mark is reset through ``/proc/self/clear_refs``), and so is where a save's time goes:
a few more saves of each state with the phases of the save timed (prepare: flatten,
plan, tensor views; write: chunk files and zarr.json, fsync'd; commit: the manifest
and LATEST; retention), which the headline notes report. Prints a table, the headline
ratios with their range over rounds, and merges a ``checkpoint`` section into the
JSON file of ``rounds.results_path()``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rounds as rd

from checkpoint_store import CheckpointStore
from checkpoint_store import saving as _saving


def make_state(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    per = max(1, total_bytes // 4 // count)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(state: dict[str, torch.Tensor], path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    for name, t in state.items():
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(t.numpy()).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
    _fsync_path(path)
    return nbytes_of(state)


_PHASES = (("prepare", CheckpointStore, "_prepare"), ("write", _saving, "write_rank"),
           ("commit", _saving, "_commit"), ("retention", CheckpointStore, "_retire"))
"""What ``_phase_timer`` times: the save's steps, looked up at call time."""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _phase_timer() -> Iterator[dict[str, float]]:
    """Seconds spent in each of ``_PHASES`` while the block runs (the functions are
    wrapped for the block only; the bench's own instrument, not a store feature), and
    in the cyclic garbage collector: ``gc`` (any collection, inside the phases too)
    and ``full_gcs`` (how many full collections ran)."""
    acc: dict[str, float] = {label: 0.0 for label, _, _ in _PHASES}
    acc |= {"gc": 0.0, "full_gcs": 0.0}
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        acc["gc"] += time.perf_counter() - started[0]
        acc["full_gcs"] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    originals = [(owner, attr, getattr(owner, attr)) for _, owner, attr in _PHASES]
    for (label, owner, attr), (_, _, fn) in zip(_PHASES, originals):
        def timed(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] += time.perf_counter() - t0
        setattr(owner, attr, timed)
    try:
        yield acc
    finally:
        gc.callbacks.remove(on_gc)
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_growth_mib(fn: Any) -> float | None:
    """RSS high-water mark reached while ``fn`` runs, above the RSS before it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = _vm_kib("VmRSS")
    fn()
    return (_vm_kib("VmHWM") - before) / 1024


class Bench:
    def __init__(self, args: argparse.Namespace, base: Path):
        self.args = args
        self.base = base
        total = args.size_mib << 20
        self.state = make_state(total, args.tensors)
        self.many = make_state(total, args.many)
        self.nbytes = nbytes_of(self.state)
        self.store = CheckpointStore(base / "tg", keep_last=1000)
        self.many_store = CheckpointStore(base / "tg-many", keep_last=1000)
        self.step = 0
        self.cache_method = ""

    # -------------------------------------------------------------- save group
    def _tg_save(self, store: CheckpointStore, state: dict[str, torch.Tensor]) -> int:
        self.step += 1
        store.save(state, step=self.step)
        return nbytes_of(state)

    def _torch_save(self) -> int:
        d = self.base / "torchsave"
        d.mkdir(exist_ok=True)
        torch.save(self.state, d / "state.pt")
        _fsync_path(d / "state.pt")
        _fsync_path(d)
        return self.nbytes

    def _dd_write(self) -> int:
        out = self.base / "ddwrite.bin"
        subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=4M",
                        f"count={self.nbytes >> 22}", "conv=fsync"], check=True,
                       capture_output=True)
        _fsync_path(self.base)
        return (self.nbytes >> 22) << 22

    def _cleanup(self, name: str) -> None:
        # Outside the measurement: every contestant writes into an empty place, and
        # the deletions are synced here, not by the next contestant's first fsync.
        for store in (self.store, self.many_store):
            ms = store.list()
            for m in ms[:-1]:
                store.delete(m.step)
        rd.rm(self.base / "raw")
        (self.base / "ddwrite.bin").unlink(missing_ok=True)
        if name != "torch.save + fsync":
            rd.rm(self.base / "torchsave")
        os.sync()

    def save_group(self) -> rd.Rounds:
        return rd.run_rounds({
            "trainguard sync save": lambda: self._tg_save(self.store, self.state),
            "raw write + fsync": lambda: raw_write(self.state, self.base / "raw"),
            "torch.save + fsync": self._torch_save,
            "dd write + fsync (disk)": self._dd_write,
        }, rounds=self.args.rounds, before=self._cleanup)

    def many_group(self) -> rd.Rounds:
        """The same bytes as 20 and as 1,000 tensors, in a group of their own: the two
        saves of a pair run back to back, so a ratio compares them under one load."""
        return rd.run_rounds({
            f"trainguard sync save, {self.args.tensors} tensors":
                lambda: self._tg_save(self.store, self.state),
            f"trainguard sync save, {self.args.many} tensors":
                lambda: self._tg_save(self.many_store, self.many),
        }, rounds=self.args.rounds, before=self._cleanup)

    def save_phases(self, saves: int = 5) -> dict[str, dict[str, float]]:
        """Median ms per phase of a save, for each state (alternating, after the
        rounds): where the 1,000-tensor save spends what the 20-tensor one does not.
        The garbage collector's time is lumpy (a full collection every few saves), so
        ``gc`` and ``full_gcs`` are the totals over the saves."""
        states = {f"{self.args.tensors} tensors": (self.store, self.state),
                  f"{self.args.many} tensors": (self.many_store, self.many)}
        got: dict[str, list[dict[str, float]]] = {k: [] for k in states}
        for i in range(saves + 1):  # the first of each is a warm-up
            for label, (store, state) in states.items():
                self._cleanup("")
                with _phase_timer() as acc:
                    c0, t0 = _cpu(), time.perf_counter()
                    self._tg_save(store, state)
                    acc["total"] = time.perf_counter() - t0
                    acc["cpu"] = _cpu() - c0
                if i:
                    got[label].append(dict(acc))
        out: dict[str, dict[str, float]] = {}
        for label, runs in got.items():
            out[label] = {k: round(statistics.median(r[k] for r in runs) * 1e3, 1)
                          for k in runs[0] if k not in ("gc", "full_gcs")}
            out[label] |= {"gc_total": round(sum(r["gc"] for r in runs) * 1e3, 1),
                           "full_gcs": sum(r["full_gcs"] for r in runs), "saves": len(runs)}
        return out

    # -------------------------------------------------------------- load groups
    def _prepare_load_files(self) -> None:
        self._cleanup("")
        self._tg_save(self.store, self.state)
        self._torch_save()
        d = self.base / "ddsrc"
        d.mkdir(exist_ok=True)
        with open(d / "state.bin", "wb") as f:
            for t in self.state.values():
                f.write(memoryview(t.numpy()).cast("B"))
            os.fsync(f.fileno())

    def _tg_load(self, target: dict[str, torch.Tensor]) -> int:
        self.store.load(target)
        return self.nbytes

    def _torch_load(self) -> int:
        out = torch.load(self.base / "torchsave" / "state.pt", weights_only=True)
        n = nbytes_of(out)
        del out
        return n

    def load_hot_group(self, target: dict[str, torch.Tensor]) -> rd.Rounds:
        contestants = {
            "trainguard load (hot)": lambda: self._tg_load(target),
            "torch.load (hot)": self._torch_load,
        }
        if self.args.dcp:
            contestants["DCP load (hot)"] = lambda: self._dcp_load(target)
        return rd.run_rounds(contestants, rounds=self.args.rounds)

    def load_cold_group(self, target: dict[str, torch.Tensor]) -> rd.Rounds:
        def drop(_: str) -> None:
            self.cache_method = rd.drop_cache([self.base / "tg", self.base / "ddsrc"])

        return rd.run_rounds({
            "trainguard load (cold)": lambda: self._tg_load(target),
            "dd read of the same bytes (cold)": lambda: rd.dd_read(self.base / "ddsrc" / "state.bin"),
        }, rounds=self.args.rounds, before=drop)

    # -------------------------------------------------------------- async group
    def async_group(self) -> rd.Rounds:
        buffers = {k: torch.empty_like(v) for k, v in self.state.items()}
        pending: list[Any] = []

        def copy_all() -> int:
            for k, v in self.state.items():
                buffers[k].copy_(v)
            return self.nbytes

        def blocked() -> int:
            self.step += 1
            pending.append(self.store.save(self.state, step=self.step, blocking=False))
            return self.nbytes

        def settle(_: str) -> None:
            while pending:
                pending.pop().wait()
            self._cleanup("")

        copy_all()  # fault the pages in, as the staging pool's steady state has them
        return rd.run_rounds({
            "trainguard async save: blocked (steady)": blocked,
            "copy into preallocated buffers": copy_all,
        }, rounds=self.args.rounds, after=settle)

    # -------------------------------------------------------------- DCP (optional)
    def _dcp_load(self, target: dict[str, torch.Tensor]) -> int:
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(str(self.base / "dcp")))
        return self.nbytes

    def dcp_setup(self) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{self.base / 'dcp-pg'}",
                                    rank=0, world_size=1)
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(str(self.base / "dcp"),
                                                                 sync_files=True))


def run(args: argparse.Namespace, base: Path) -> None:
    out = rd.results_path() if args.json is None else Path(args.json)
    print(f"measuring the machine (memcpy, dd in {base}) ...", flush=True)
    machine = rd.machine(base)
    b = Bench(args, base)
    gib = b.nbytes / 2**30
    print(f"state: {b.nbytes / 2**20:.0f} MiB in {args.tensors} float32 tensors (variant: "
          f"{args.many}); dir {base}; {machine['cpus']} CPUs; memcpy "
          f"{machine['memcpy_gib_s']} GiB/s; dd: write+fsync {machine['dd']['write_fsync_mib_s']} "
          f"MiB/s, cold read {machine['dd']['read_cold_mib_s']} MiB/s; "
          f"{args.rounds} rounds + 1 warm-up per group", flush=True)

    save = b.save_group()
    many_rounds = b.many_group()
    phases = b.save_phases()
    b._prepare_load_files()
    if args.dcp:
        b.dcp_setup()
    target = {k: torch.zeros_like(v) for k, v in b.state.items()}  # paged in
    hot = b.load_hot_group(target)
    assert all(torch.equal(target[k], b.state[k]) for k in b.state)
    cold = b.load_cold_group(target)
    tg_rss = peak_rss_growth_mib(lambda: b._tg_load(target))
    torch_rss = peak_rss_growth_mib(b._torch_load)
    asyn = b.async_group()
    b.store.close()
    b.many_store.close()

    many = f"trainguard sync save, {args.many} tensors"
    few, lots = (f"{args.tensors} tensors", f"{args.many} tensors")
    extra_ms = phases[lots]["cpu"] - phases[few]["cpu"]
    n_saves = phases[few]["saves"]
    phase_note = (
        f"a save's phases, median ms of {n_saves} ({args.tensors} -> {args.many} tensors): "
        + ", ".join(f"{k} {phases[few][k]:.0f} -> {phases[lots][k]:.0f}"
                    for k in ("prepare", "write", "commit", "retention", "total"))
        + f"; CPU {phases[few]['cpu']:.0f} -> {phases[lots]['cpu']:.0f} ms, i.e. "
        f"{extra_ms * 1e3 / max(1, args.many - args.tensors):.0f} us per extra tensor; "
        f"Python's cyclic GC over the {n_saves} saves: {phases[few]['gc_total']:.0f} -> "
        f"{phases[lots]['gc_total']:.0f} ms ({phases[few]['full_gcs']:.0f} -> "
        f"{phases[lots]['full_gcs']:.0f} full collections of a {len(gc.get_objects()):,}-"
        "object heap)")
    disk = save.gib_per_s("dd write + fsync (disk)") or 0.0
    raw = save.gib_per_s("raw write + fsync") or 0.0
    ratios = [
        rd.speed_ratio(save, "trainguard sync save", "raw write + fsync",
                       name="sync save speed / raw write + fsync", target=">= 0.9x",
                       note=f"the disk in the same rounds: dd write + fsync "
                            f"{disk * 1024:.0f} MiB/s, raw write + fsync {raw * 1024:.0f} "
                            "MiB/s"),
        rd.speed_ratio(save, "trainguard sync save", "dd write + fsync (disk)",
                       name="sync save speed / dd write + fsync (the disk)"),
        rd.speed_ratio(save, "trainguard sync save", "torch.save + fsync",
                       name="sync save speed / torch.save + fsync"),
        rd.time_ratio(many_rounds, many, f"trainguard sync save, {args.tensors} tensors",
                      name=f"{args.many}-tensor save time / {args.tensors}-tensor",
                      target="<= 1.2x", note=phase_note),
        rd.time_ratio(hot, "trainguard load (hot)", "torch.load (hot)",
                      name="load time / torch.load (hot cache)", target="<= 1.7x"),
        rd.speed_ratio(cold, "trainguard load (cold)", "dd read of the same bytes (cold)",
                       name="load speed / dd read (cold cache)", target=">= 0.9x"),
        rd.time_ratio(asyn, "trainguard async save: blocked (steady)",
                      "copy into preallocated buffers",
                      name="async save blocked / preallocated copy", target="<= 1.5x"),
    ]
    if args.dcp:
        ratios.append(rd.time_ratio(hot, "trainguard load (hot)", "DCP load (hot)",
                                    name="load time / DCP load (hot cache)"))
    for title, r in (("save", save), ("save, few and many tensors", many_rounds),
                     ("load, hot page cache", hot),
                     (f"load, cold page cache ({b.cache_method})", cold),
                     ("async save", asyn)):
        print(f"\n[{title}]")
        print(rd.table(r))
    print(f"\npeak RSS growth of one hot load: trainguard {tg_rss:.0f} MiB, torch.load "
          f"{torch_rss:.0f} MiB (state {b.nbytes / 2**20:.0f} MiB; target <= 1.1x the state)"
          if tg_rss is not None and torch_rss is not None else "\npeak RSS: not measurable here")
    print()
    rd.print_headlines(ratios)
    section = {
        "args": {"size_mib": args.size_mib, "tensors": args.tensors, "many": args.many,
                 "rounds": args.rounds, "dcp": args.dcp},
        "state_mib": round(b.nbytes / 2**20, 1), "gib": gib,
        "cold_cache_method": b.cache_method,
        "save_phases_ms": phases,
        "peak_rss_growth_mib": {"trainguard_load": tg_rss, "torch_load": torch_rss},
        "rss_growth_per_state": None if tg_rss is None else round(tg_rss / (b.nbytes / 2**20), 3),
        "rows": {**rd.rows_doc(save), **rd.rows_doc(many_rounds), **rd.rows_doc(hot),
                 **rd.rows_doc(cold),
                 **rd.rows_doc(asyn)},
        "headlines": {r.name: r.doc() for r in ratios},
    }
    rd.write_section(out, "checkpoint", section, machine)
    print(f"results: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="state size (default 256)")
    parser.add_argument("--tensors", type=int, default=20, help="tensor count (default 20)")
    parser.add_argument("--many", type=int, default=1000, help="tensor count of the variant")
    parser.add_argument("--rounds", type=int, help="measured rounds per group (default 10; "
                        "3 with --dist)")
    parser.add_argument("--dir", help="directory on the disk to measure (created when "
                        "missing; default: the temp dir); files go to a fresh subdirectory, "
                        "removed afterwards")
    parser.add_argument("--dcp", action="store_true", help="add torch.distributed.checkpoint")
    parser.add_argument("--json", help="results file (default: bench/results/<host>-<stamp>.json)")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    parser.add_argument("--dist", type=int, metavar="N", help="instead: N gloo ranks, an FSDP2 "
                        "model + AdamW of --size-mib parameters against DCP, in rounds "
                        "(bench/checkpoint_dist.py)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where --dist keeps the state (cuda: one rank per GPU)")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.dist else 10
    if args.dist:
        from checkpoint_dist import main as dist_main

        dist_main(args.dist, args.size_mib, args.rounds, args.device, args.dir)
        return
    # A fresh subdirectory, so cleaning up never touches anything already there.
    base = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=rd.ensure_dir(args.dir)))
    try:
        run(args, base)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
