"""Checkpoint tiers, each against its baseline, in one run (issue #28):

    python bench/tiers.py [--size-mib 64] [--rounds 4] [--dir /path/on/disk] [--json F]
                          [--restore-only | --stall-only]
    python bench/tiers.py --memory-only --size-mib 64 [--size-mib 256] [--json F]

1. stall: the time an async RAM-tier save (``save(blocking=False)``, the session's
   save, with ``overwrite_oldest``: into the pages of the checkpoint it drops) stops
   the loop, against a plain host copy of the same state into buffers allocated once
   (the copy any async save must make; ``clone()`` of the state, which allocates each
   time, and the same save into new tmpfs pages, without ``overwrite_oldest``, are in
   the table too). Target: <= 1.2x.
2. tier costs: a RAM-tier save (committed), its copy to one partner (over the
   partner's tier server), an fsync'd local-disk save and a remote save (moto S3).
3. restore of the same checkpoint from RAM, from a partner (node 0's RAM lost, the
   copy fetched back from node 1), from local disk (warm page cache: the disk's best
   case) and from remote. Target: partner restore >= 5x the speed of remote. A
   partner restore streams the copy into the state; the copy's fetch back into node
   0's RAM that follows it runs in the background and is waited for outside the
   measurement. When it misses, one more restore of each is timed by phase (raw
   transfer vs the rest). ``--restore-only`` runs this group alone.
4. peak host memory of three RAM saves and their partner copies (the steady state,
   each save replacing the one before), in a fresh process per measurement
   (``_tiers_peak.py``), sampled every 2 ms: the process's private memory above the
   state plus the tmpfs bytes of its own RAM tier and of the partner's copy together,
   against the state's bytes, for the ``bounded`` tiers (``overwrite_oldest``, a
   partner budget of one copy) and the ``default`` ones (``TIER_CONFIGS``). Target:
   <= 2x (the RAM copy and the partner copy, nothing else). ``--memory-only`` runs
   this group alone, at each ``--size-mib`` given (a ``tiers_memory`` section).
5. lost work per failure at the multi-level advisor's intervals against today's
   single interval: arithmetic on the costs of 1-3 and stated failure rates
   (``_tiers_lost.py``), printed as such.

Groups 1-3 run in rounds (a balanced order, the first round discarded as warm-up; see
``rounds.py``); a ratio is taken within each round, then the median over rounds is
printed with its range. The stall group runs ``stall_rounds(--rounds)`` rounds (4x, at
least 64): its operations take milliseconds, where one scheduler tick or page-cache
flush makes a ratio of 2-4x, and at 64 MiB the median of 16 rounds still moved by
0.06x from run to run (64 rounds: 0.02x, 5 s). The partner and moto run on this
machine: transfers are loopback TCP, so they measure protocols and copies, not a
network, and moto is a Python S3 emulator, not S3 (its speed says nothing about a real
bucket's). Merges a ``tiers`` section into the JSON results file
(``rounds.results_path()``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tiers_lost as lost
import rounds as rd
from _tiers_peak import state_of

from checkpoint_store import CheckpointStore
from checkpoint_store.layout import data_dir, manifest_path
from checkpoint_store.manifest import Manifest
from checkpoint_store.node_tiers import NodeTierStore
from checkpoint_store.partner import TierServer, node_root
from checkpoint_store.ram_tier import RamTierStore, tree_bytes
from tests.servers import MotoServer

HERE = Path(__file__).resolve().parent


def _files_of(root: Path, uid: str) -> list[str]:
    """The data files of the checkpoint ``uid`` under a local root (relative paths)."""
    return sorted(str(p.relative_to(root)) for p in (root / data_dir(uid)).rglob("*")
                  if p.is_file())


class Tiers:
    """One node (0) with its RAM tier and a partner (node 1), local disk and remote,
    all holding the same state."""

    def __init__(self, size_mib: int, disk_base: Path, moto: MotoServer):
        self.state = state_of(size_mib)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.shm = Path("/dev/shm") / f"trainguard-bench-{uuid.uuid4().hex}"
        self.disk_dir = Path(tempfile.mkdtemp(prefix="tg-tiers-", dir=disk_base))
        budget = 4 * self.nbytes
        self.servers = [TierServer(self.shm / f"node{n}", node=n, budget_bytes=budget).start()
                        for n in range(2)]
        self.ram = RamTierStore(node_root(self.shm / "node0", 0), budget_bytes=budget,
                                keep_last=1)
        # The same tier writing each save into the pages of the one it drops.
        self.rewrite = RamTierStore(self.shm / "rewrite", budget_bytes=budget, keep_last=1,
                                    overwrite_oldest=True)
        self.tiers = NodeTierStore(self.ram, node=0, peers=[s.url for s in self.servers])
        self.disk = CheckpointStore(self.disk_dir, keep_last=1)
        self.bucket = moto.create_bucket(f"tg-tiers-{uuid.uuid4().hex[:12]}")
        self.s3_options = moto.storage_options()
        self.remote_url = f"s3://{self.bucket}/n0"
        self.remote = CheckpointStore(self.remote_url, keep_last=1,
                                      storage_options=self.s3_options)
        self.steps = iter(range(1, 10**6))

    def close(self) -> None:
        try:
            self.tiers.close()
            self.rewrite.close()
            self.disk.close()
            self.remote.close()
        finally:
            for s in self.servers:
                s.close()
            shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.disk_dir, ignore_errors=True)


# ------------------------------------------------------------------ 1. the loop's stall
def stall_rounds(rounds: int) -> int:
    """The stall group's rounds for ``--rounds`` (module doc)."""
    return max(64, 4 * rounds)


def stall_group(t: Tiers, rounds: int) -> rd.Rounds:
    dst = {k: torch.empty_like(v) for k, v in t.state.items()}
    pending: list[Any] = []

    def async_save() -> int:
        pending.append(t.rewrite.save(t.state, step=next(t.steps), blocking=False))
        return t.nbytes

    def async_save_new_pages() -> int:
        pending.append(t.ram.save(t.state, step=next(t.steps), blocking=False))
        return t.nbytes

    def host_copy() -> int:
        for k, v in t.state.items():
            dst[k].copy_(v)
        return t.nbytes

    def host_clone() -> int:
        copies = {k: v.clone() for k, v in t.state.items()}
        del copies
        return t.nbytes

    def settle(_name: str) -> None:
        # The background write is not the loop's: it finishes outside the measurement.
        while pending:
            pending.pop().wait()

    return rd.run_rounds({"RAM tier async save (loop stall)": async_save,
                          "RAM tier async save into new pages (loop stall)": async_save_new_pages,
                          "host copy into buffers allocated once": host_copy,
                          "host clone()": host_clone}, rounds=rounds, after=settle)


# ------------------------------------------------------------------ 2. what each tier costs
def cost_group(t: Tiers, rounds: int) -> rd.Rounds:
    to_send: list[str] = []

    def before(name: str) -> None:
        if name == "partner copy (one partner)":
            handle = t.ram.save(t.state, step=next(t.steps))
            assert handle.manifest is not None
            to_send.append(handle.manifest.name)

    def ram_save() -> int:
        t.ram.save(t.state, step=next(t.steps)).wait()
        return t.nbytes

    def partner_copy() -> int:
        t.tiers.link.send(1, 0, t.ram.root, to_send.pop())
        return t.nbytes

    def disk_save() -> int:
        t.disk.save(t.state, step=next(t.steps)).wait()
        return t.nbytes

    def remote_save() -> int:
        t.remote.save(t.state, step=next(t.steps)).wait()
        return t.nbytes

    return rd.run_rounds({"RAM tier save (committed)": ram_save,
                          "partner copy (one partner)": partner_copy,
                          "local disk save (fsync'd)": disk_save,
                          "remote save (moto S3)": remote_save}, rounds=rounds, before=before)


# ------------------------------------------------------------------ 3. restores
def restore_group(t: Tiers, rounds: int) -> tuple[rd.Rounds, Manifest, dict[str, torch.Tensor]]:
    # One checkpoint of the same state in every tier, copied to the partner.
    step = next(t.steps)
    manifest = t.tiers.save(t.state, step=step).wait()
    t.tiers.wait_copies()
    t.disk.save(t.state, step=step).wait()
    t.remote.save(t.state, step=step).wait()
    target = {k: torch.empty_like(v) for k, v in t.state.items()}

    def before(name: str) -> None:
        for v in target.values():
            v.zero_()  # each restore proves itself: the check after the rounds
        if name == "partner restore":
            t.ram.delete(step)  # node 0's RAM is gone: the fetch brings the copy back

    def from_ram() -> int:
        t.ram.load(target, step=step, strict=True)
        return t.nbytes

    def from_partner() -> int:
        t.tiers.load(target, step=step)
        assert t.tiers.restored_from == "partner:n1", t.tiers.restored_from
        return t.nbytes

    def from_disk() -> int:
        t.disk.load(target, step=step, strict=True)
        return t.nbytes

    def from_remote() -> int:
        t.remote.load(target, step=step, strict=True)
        return t.nbytes

    def check(name: str) -> None:
        # The partner restore's background fetch into RAM ends here, outside any
        # measurement, so that it neither runs into the next restore nor is lost.
        t.tiers.wait_copies()
        if not all(torch.equal(target[k], v) for k, v in t.state.items()):
            raise AssertionError(f"{name} did not restore the state bit for bit")

    r = rd.run_rounds({"RAM restore": from_ram, "partner restore": from_partner,
                       "local disk restore (warm cache)": from_disk,
                       "remote restore (moto S3)": from_remote}, rounds=rounds,
                      before=before, after=check)
    return r, manifest, target


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def restore_phases(t: Tiers, manifest: Manifest,
                   target: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Where a partner and a remote restore spend their time, once each: the raw
    transfer of the checkpoint's files (remote: as many threads as the store reads
    with; partner: as many connections as its streamed restore uses) against the whole
    restore (transfer, checksums, landing in the state)."""
    import fsspec

    step = manifest.step
    files = _files_of(t.ram.root, manifest.uid)
    fs = fsspec.filesystem("s3", **t.s3_options)
    # The remote tier's save of the same step is a checkpoint of its own (another uid).
    remote_uid = next(m.uid for m in t.remote.list() if m.step == step)
    remote_files = fs.find(f"{t.bucket}/n0/{data_dir(remote_uid)}")
    with ThreadPoolExecutor(t.remote.io_threads) as pool:
        remote_raw = _timed(lambda: list(pool.map(fs.cat_file, remote_files)))
    url = t.servers[1].url

    def get(rel: str) -> bytes:
        with urllib.request.urlopen(f"{url}/v1/raw/0/{quote(rel)}") as resp:
            return bytes(resp.read())

    with ThreadPoolExecutor(t.ram.store.io_threads) as pool:
        partner_raw = _timed(lambda: list(pool.map(get, files)))
    remote_all = _timed(lambda: t.remote.load(target, step=step, strict=True))
    t.ram.delete(step)
    partner_all = _timed(lambda: t.tiers.load(target, step=step))
    t.tiers.wait_copies()
    return {"remote_raw_get_s": remote_raw, "remote_restore_s": remote_all,
            "partner_raw_get_s": partner_raw, "partner_restore_s": partner_all,
            "files": len(files),
            "manifest_bytes": len((t.ram.root / manifest_path(manifest.name)).read_bytes())}


# ------------------------------------------------------------------ 4. peak memory
TIER_CONFIGS = {
    # A node that holds one copy of its own and one of its partner's, at every moment:
    # each save writes into the pages of the one it drops (``overwrite_oldest``), the
    # partner's budget makes it drop the old copy before the new one arrives.
    "bounded": {"overwrite_oldest": True, "partner_budget_copies": 1, "keep_copies": 1},
    # The defaults: the old checkpoint stays until the new one commits, on both sides.
    "default": {"overwrite_oldest": False, "partner_budget_copies": 4, "keep_copies": 2},
}


def peak_memory(size_mib: int, modes: Sequence[str] = ("blocking", "async"),
                configs: Sequence[str] = tuple(TIER_CONFIGS)) -> list[dict[str, Any]]:
    """One fresh process per mode and tier configuration (``_tiers_peak.py``: three saves
    and their copies, sampled), each with fresh tier servers."""
    out = []
    for config in configs:
        c = TIER_CONFIGS[config]
        for mode in modes:
            shm = Path("/dev/shm") / f"trainguard-peak-{uuid.uuid4().hex}"
            budget = c["partner_budget_copies"] * (size_mib << 20) + (1 << 20)
            servers = [TierServer(shm / f"node{n}", node=n, budget_bytes=budget,
                                  keep_copies=c["keep_copies"]).start() for n in range(2)]
            try:
                proc = subprocess.run(
                    [sys.executable, str(HERE / "_tiers_peak.py"), "--size-mib", str(size_mib),
                     "--mode", mode, "--root", str(shm / "node0"),
                     "--peers", ",".join(s.url for s in servers),
                     "--partner-root", str(servers[1].owner_root(0)),
                     *(["--overwrite-oldest"] if c["overwrite_oldest"] else [])],
                    capture_output=True, text=True, timeout=300,
                    env={**os.environ, "PYTHONPATH": str(HERE.parent)})
                if proc.returncode != 0:
                    raise RuntimeError(f"_tiers_peak.py --mode {mode} failed: {proc.stderr[-2000:]}")
                doc = json.loads(proc.stdout.strip().splitlines()[-1])
                doc["partner_copy_bytes"] = tree_bytes(servers[1].owner_root(0))
            finally:
                for s in servers:
                    s.close()
                shutil.rmtree(shm, ignore_errors=True)
            extra = max(0, doc["peak_private_kib"] - doc["private_state_kib"]) * 1024
            doc["config"] = config
            doc["process_extra_bytes"] = extra
            doc["added_bytes"] = extra + doc["peak_tiers_bytes"]
            doc["added_over_state"] = doc["added_bytes"] / doc["state_bytes"]
            out.append(doc)
    return out


def peak_lines(docs: list[dict[str, Any]]) -> list[str]:
    mib = 2**20
    lines = [f"{'tiers':8s} {'save mode':10s} {'state MiB':>9s} {'process peak over state':>24s} "
             f"{'both tiers at peak':>19s} {'added / state':>14s}"]
    for d in docs:
        lines.append(f"{d['config']:8s} {d['mode']:10s} {d['state_bytes'] / mib:9.0f} "
                     f"{d['process_extra_bytes'] / mib:20.1f} MiB "
                     f"{d['peak_tiers_bytes'] / mib:15.1f} MiB {d['added_over_state']:13.2f}x")
    return lines


NOTE = ("partner and moto S3 on loopback: protocols and copies, not a network; moto is an "
        "emulator, not S3")


def print_peaks(peaks: list[dict[str, Any]]) -> None:
    print("[peak host memory: three RAM saves and their partner copies, a fresh process each]")
    print("(sampled every 2 ms: process = private memory (RssAnon) over the state; "
          "tiers = own RAM tier + the partner's copy on tmpfs; target: added <= 2x)")
    print("\n".join(peak_lines(peaks)))


def memory_only(sizes: Sequence[int], json_path: str | None) -> dict[str, Any]:
    """Group 4 alone, once per state size (each mode a fresh process)."""
    load_start = os.getloadavg()
    peaks = [doc for size in sizes for doc in peak_memory(size)]
    print_peaks(peaks)
    section = {"sizes_mib": list(sizes), "peak_memory": peaks,
               "loadavg": {"start": list(load_start), "end": list(os.getloadavg())}}
    out = rd.results_path() if json_path is None else Path(json_path)
    rd.write_section(out, "tiers_memory", section, rd.machine())
    print(f"results: {out}")
    return section


# ------------------------------------------------------------------ the run
def restore_ratios(loads: rd.Rounds) -> list[rd.Ratio]:
    return [
        rd.speed_ratio(loads, "partner restore", "remote restore (moto S3)",
                       name="partner restore speed / remote (moto S3)", target=">= 5x"),
        rd.speed_ratio(loads, "RAM restore", "remote restore (moto S3)",
                       name="RAM restore speed / remote (moto S3)"),
        rd.speed_ratio(loads, "local disk restore (warm cache)", "remote restore (moto S3)",
                       name="disk restore speed / remote (moto S3)"),
        rd.speed_ratio(loads, "partner restore", "local disk restore (warm cache)",
                       name="partner restore speed / disk (warm cache)"),
        rd.speed_ratio(loads, "RAM restore", "local disk restore (warm cache)",
                       name="RAM restore speed / disk (warm cache)"),
    ]


def stall_ratios(stall: rd.Rounds) -> list[rd.Ratio]:
    host = "host copy into buffers allocated once"
    return [
        rd.time_ratio(stall, "RAM tier async save (loop stall)", host,
                      name="async RAM save stall / host copy (time)", target="<= 1.2x"),
        rd.time_ratio(stall, "RAM tier async save (loop stall)", "host clone()",
                      name="async RAM save stall / host clone() (time)"),
        rd.time_ratio(stall, "RAM tier async save into new pages (loop stall)", host,
                      name="async RAM save into new pages / host copy (time)"),
    ]


def phase_lines(phases: dict[str, Any]) -> str:
    return (f"remote: {phases['remote_restore_s']:.3f} s, of which the raw GETs of its "
            f"{phases['files']} files take {phases['remote_raw_get_s']:.3f} s "
            f"({phases['remote_raw_get_s'] / phases['remote_restore_s']:.0%}); partner: "
            f"streamed restore {phases['partner_restore_s']:.3f} s, of which raw GETs "
            f"{phases['partner_raw_get_s']:.3f} s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, action="append",
                    help="state size (default 64); --memory-only takes several")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the disk tier goes (default: tmp)")
    ap.add_argument("--step-s", type=float, default=1.0,
                    help="a training step's seconds, for the lost-work arithmetic")
    ap.add_argument("--json", default=None,
                    help="results file (default: bench/results/<host>-<stamp>.json)")
    ap.add_argument("--restore-only", action="store_true",
                    help="run the restore group (3) alone; merges a tiers_restore section")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the peak host memory group (4), at each --size-mib")
    ap.add_argument("--stall-only", action="store_true",
                    help="run the stall group (1) alone; merges a tiers_stall section")
    args = ap.parse_args(argv)
    sizes = args.size_mib or [64]
    if args.memory_only:
        return memory_only(sizes, args.json)
    if len(sizes) != 1:
        ap.error(f"one --size-mib without --memory-only, got {sizes}")
    args.size_mib = sizes[0]
    args.stall_rounds = stall_rounds(args.rounds)
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    moto = MotoServer().start()
    t = Tiers(args.size_mib, rd.ensure_dir(args.dir), moto)
    try:
        if args.stall_only:
            stall = stall_group(t, args.stall_rounds)
            print(f"state {t.nbytes / 2**20:.0f} MiB, {args.stall_rounds} rounds + 1 "
                  f"warm-up\n\n[loop stall]\n{rd.table(stall)}")
            return _finish(args, t, "tiers_stall", stall_ratios(stall),
                           (load_start, os.getloadavg()), t0, {"rows": rd.rows_doc(stall)})
        if args.restore_only:
            loads, manifest, target = restore_group(t, args.rounds)
            ratios = restore_ratios(loads)
            phases = restore_phases(t, manifest, target) if ratios[0].median < 5.0 else None
        else:
            stall = stall_group(t, args.stall_rounds)
            costs = cost_group(t, args.rounds)
            loads, manifest, target = restore_group(t, args.rounds)
            restores = restore_ratios(loads)
            ratios = [
                *stall_ratios(stall),
                *restores,
                rd.speed_ratio(costs, "RAM tier save (committed)", "local disk save (fsync'd)",
                               name="RAM tier save speed / disk save (fsync'd)"),
            ]
            phases = restore_phases(t, manifest, target) if restores[0].median < 5.0 else None
            cost = lost.TierCosts(
                stall_s=stall.median_wall("RAM tier async save (loop stall)"),
                ram_s=costs.median_wall("RAM tier save (committed)"),
                partner_s=costs.median_wall("partner copy (one partner)"),
                disk_s=costs.median_wall("local disk save (fsync'd)"),
                remote_s=costs.median_wall("remote save (moto S3)"))
    finally:
        t.close()
        moto.stop()
    if args.restore_only:
        return _report_restores(args, t, loads, ratios, phases, load_start, t0)
    peaks = peak_memory(args.size_mib)
    work = lost.compare(cost, step_s=args.step_s)
    load_end = os.getloadavg()

    print(f"state {t.nbytes / 2**20:.0f} MiB (8 float32 tensors), {args.rounds} rounds + 1 "
          f"warm-up per group ({args.stall_rounds} for the stall); load average "
          f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end, {os.cpu_count()} CPUs")
    for title, r in (("loop stall", stall), ("tier costs", costs), ("restore", loads)):
        print(f"\n[{title}]")
        print(rd.table(r))
    if phases is not None:
        print("\n[where the time goes, one restore each (partner missed its target)]")
        print(phase_lines(phases))
    print()
    print_peaks(peaks)
    print("\n[lost work per failure: multi-level advisor vs today's single interval]")
    print(lost.table(work))
    return _finish(args, t, "tiers", ratios, (load_start, load_end), t0, {
        "rows": {**rd.rows_doc(stall), **rd.rows_doc(costs), **rd.rows_doc(loads)},
        "restore_phases": phases, "peak_memory": peaks, "lost_work": work})


def _report_restores(args: argparse.Namespace, t: Tiers, loads: rd.Rounds,
                     ratios: list[rd.Ratio], phases: dict[str, Any] | None,
                     load_start: tuple[float, float, float], t0: float) -> dict[str, Any]:
    """``--restore-only``: the restore group's table, headlines and phases, written as
    a section of its own (``tiers_restore``), so a full run's ``tiers`` stays whole."""
    load_end = os.getloadavg()
    print(f"state {t.nbytes / 2**20:.0f} MiB (8 float32 tensors), {args.rounds} rounds + 1 "
          f"warm-up; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end, "
          f"{os.cpu_count()} CPUs\n\n[restore]")
    print(rd.table(loads))
    if phases is not None:
        print("\n[where the time goes, one restore each (partner missed its target)]")
        print(phase_lines(phases))
    return _finish(args, t, "tiers_restore", ratios, (load_start, load_end), t0,
                   {"rows": rd.rows_doc(loads), "restore_phases": phases})


def _finish(args: argparse.Namespace, t: Tiers, name: str, ratios: list[rd.Ratio],
            loads: tuple[tuple[float, float, float], tuple[float, float, float]],
            t0: float, figures: dict[str, Any]) -> dict[str, Any]:
    """The headlines, then section ``name`` (the run's figures and what every section
    carries) merged into the results file."""
    print()
    rd.print_headlines(ratios)
    elapsed = time.perf_counter() - t0
    print(f"\n(run took {elapsed:.0f} s; moto S3 on loopback is an emulator, not S3)")
    section = {
        "size_mib": args.size_mib, "rounds": args.rounds,
        "stall_rounds": args.stall_rounds, "state_bytes": t.nbytes,
        "loadavg": {"start": list(loads[0]), "end": list(loads[1])},
        "ratios": {r.name: r.doc() for r in ratios}, **figures,
        "elapsed_s": round(elapsed, 1), "note": NOTE,
    }
    out = rd.results_path() if args.json is None else Path(args.json)
    rd.write_section(out, name, section, rd.machine())
    print(f"results: {out}")
    return section


if __name__ == "__main__":
    main()
