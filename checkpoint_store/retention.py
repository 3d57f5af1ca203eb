"""Retention and garbage collection.

Retention keeps the newest ``keep_last`` checkpoints, every step divisible by
``keep_every``, every pinned one, and always the newest; it deletes a checkpoint's
manifest first (so it stops being a checkpoint) and its data second.

``gc`` removes debris of crashed saves: data directories no manifest names, temp
files, and stale in-flight markers. A save is in flight while its marker exists and
its writer lives (same host: the pid exists; other host: the marker is younger than
``stale_after_s``). Listing order matters: data first, then markers, then manifests.
A save writes its marker before its data and removes it only after its manifest, so
any data directory seen without a live marker and without a manifest is debris.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from checkpoint_store.backends import Backend
from checkpoint_store.layout import (
    DATA_DIR,
    INFLIGHT_DIR,
    MANIFEST_DIR,
    TMP_PREFIX,
    data_dir,
    is_uid,
    manifest_path,
    parse_manifest_name,
)
from checkpoint_store.manifest import Manifest
from trainguard.core.process import pid_alive

__all__ = [
    "GcReport", "apply_retention", "choose_deletions", "collect_garbage", "remove_data", "retire",
    "writer_alive",
]


@dataclass
class GcReport:
    removed_data: list[str] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)
    deleted_checkpoints: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)


def choose_deletions(
    manifests: Sequence[Manifest], *, keep_last: int, keep_every: int | None
) -> list[Manifest]:
    """``manifests`` oldest first; returns those retention drops."""
    if not manifests:
        return []
    keep = {m.name for m in manifests[-max(keep_last, 1):]}
    for m in manifests:
        if m.pinned or (keep_every and m.step % keep_every == 0):
            keep.add(m.name)
    return [m for m in manifests if m.name not in keep]


def retire(backend: Backend, doomed: Sequence[Manifest]) -> list[str]:
    """Delete the manifests of ``doomed``: from here they are no checkpoints. Their data
    stays for :func:`remove_data`; a crash in between leaves it as debris for ``gc``."""
    for m in doomed:
        backend.remove(manifest_path(m.name))
    return [m.name for m in doomed]


def remove_data(backend: Backend, doomed: Sequence[Manifest]) -> None:
    """Delete the data of retired checkpoints (every chunk file: the slow half)."""
    for m in doomed:
        backend.remove_tree(data_dir(m.uid))


def apply_retention(backend: Backend, doomed: Sequence[Manifest]) -> list[str]:
    deleted = retire(backend, doomed)
    remove_data(backend, doomed)
    return deleted


def writer_alive(marker: dict[str, object], *, stale_after_s: float) -> bool:
    if marker.get("host") == socket.gethostname():
        pid = marker.get("pid")
        return isinstance(pid, int) and pid_alive(pid)
    started = marker.get("started_at")
    return isinstance(started, int | float) and time.time() - started < stale_after_s


def _tmp_owner_alive(name: str) -> bool:
    # Local temp files are ".tmp-<final name>.<pid>", written by this host.
    pid_text = name.rsplit(".", 1)[-1]
    return pid_text.isdigit() and pid_alive(int(pid_text))


def collect_garbage(
    backend: Backend, *, own_inflight: set[str], stale_after_s: float,
    retention: Callable[[], list[str]],
) -> GcReport:
    report = GcReport()
    data_uids = [d for d in backend.listdir(DATA_DIR) if is_uid(d)]
    markers: dict[str, list[dict[str, object]]] = {}
    marker_files: dict[str, list[str]] = {}
    for name in backend.listdir(INFLIGHT_DIR):
        uid = name.split(".", 1)[0]
        path = f"{INFLIGHT_DIR}/{name}"
        try:
            doc = json.loads(backend.read(path))
        except (FileNotFoundError, ValueError):
            doc = {}
        markers.setdefault(uid, []).append(doc if isinstance(doc, dict) else {})
        marker_files.setdefault(uid, []).append(path)
    manifest_files = backend.listdir(MANIFEST_DIR)
    named = {p.uid for p in map(parse_manifest_name, manifest_files) if p is not None}

    def alive(uid: str) -> bool:
        return uid in own_inflight or any(
            writer_alive(m, stale_after_s=stale_after_s) for m in markers.get(uid, [])
        )

    for uid in data_uids:
        if uid in named:
            continue
        if alive(uid):
            report.in_flight.append(uid)
            continue
        backend.remove_tree(data_dir(uid))
        report.removed_data.append(data_dir(uid))
    for uid, paths in marker_files.items():
        if not alive(uid):
            for p in paths:
                backend.remove(p)
                report.removed_files.append(p)
    for directory, names in (("", backend.listdir("")), (MANIFEST_DIR, manifest_files)):
        for name in names:
            if name.startswith(TMP_PREFIX) and not _tmp_owner_alive(name):
                path = f"{directory}/{name}" if directory else name
                backend.remove(path)
                report.removed_files.append(path)
    report.deleted_checkpoints = retention()
    return report
