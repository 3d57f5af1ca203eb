"""The save protocol, run in the background writer thread on every rank.

1. rank 0 picks the uid (sorting after every existing manifest); every rank gathers it
   once every rank has staged its state;
2. each rank writes its in-flight marker, then its arrays and its state object
   (``rank_state``; every file and directory fsync'd);
3. ranks report success or failure to rank 0 (all-gather; the state object goes as
   its digest only);
4. rank 0, only if every rank succeeded, writes the manifest (exclusive create: the
   commit point), then swaps LATEST; otherwise it removes the save's data;
5. rank 0 broadcasts the outcome (the manifest bytes, or the error) to every rank;
6. each rank removes its marker.

A crash anywhere before step 4's manifest leaves only debris that ``gc`` removes; the
previous checkpoint stays current.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store import _faults
from checkpoint_store.backends import Backend
from checkpoint_store.dist import Comm, all_gather_json, broadcast_json
from checkpoint_store.dtypes import dtype_name
from checkpoint_store.flatten import TensorLeaf
from checkpoint_store.layout import (
    LATEST,
    MANIFEST_DIR,
    ManifestName,
    data_dir,
    inflight_marker,
    manifest_path,
    new_uid,
    parse_manifest_name,
    uid_time_ns,
)
from checkpoint_store.manifest import Manifest, TensorFragments, encode_manifest, parse_manifest
from checkpoint_store.plan import RankPlan
from checkpoint_store.rank_state import digest, encode_rank_state, make_index, rank_state_path
from checkpoint_store.reshard import unique_blocks
from checkpoint_store.staging import Staged
from checkpoint_store.writer import write_rank, write_root_group
from trainguard.core.checkpoints import (
    CheckpointError,
    CheckpointWriteError,
    CommitConflictError,
    DistributedSaveError,
)
from trainguard.core.newest import newest_committed

__all__ = ["SaveJob", "latest_pointer", "run_save"]

log = logging.getLogger("checkpoint_store")


@dataclass
class SaveJob:
    step: int
    extra: dict[str, Any]
    leaves: Sequence[TensorLeaf]
    plan: RankPlan
    staged: Staged
    skeleton: bytes
    rank_state: dict[str, Any] | None = None
    """This rank's state object (``checkpoint_store.rank_state``); None: none."""
    precommit: Callable[[], None] | None = None
    """Called once this rank's data and object are written, before it reports: what it
    raises fails the save everywhere and is this rank's error as raised."""
    error: BaseException | None = None
    """Set when this rank failed before writing: it still takes part in the
    protocol, reporting the error, so every rank aborts together and promptly."""


def latest_pointer(name: str, step: int, uid: str) -> bytes:
    return (json.dumps({"manifest": name, "step": step, "uid": uid}, sort_keys=True) + "\n").encode()


def _newest_name(backend: Backend) -> ManifestName | None:
    names = [p for p in map(parse_manifest_name, backend.listdir(MANIFEST_DIR)) if p]
    return newest_committed(names)


def _tensor_entries(job: SaveJob) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in job.plan.placements:
        leaf = job.leaves[p.leaf]
        shard = {"array": p.array, "offset": p.offset, "nbytes": p.nbytes,
                 "shape": list(leaf.tensor.shape), "offsets": list(leaf.offsets)}
        seen = out.get(leaf.path)
        if seen is not None:  # another block of a tensor this rank holds several of
            seen["shards"].append(shard)
            continue
        out[leaf.path] = {
            "dtype": dtype_name(leaf.tensor.dtype),
            "shape": list(leaf.global_shape),
            "sharded": leaf.sharded,
            "layout": leaf.layout,
            "shards": [shard],
        }
    return out


def _merge_tensors(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One entry per tensor with every rank's block; a block several ranks report
    (a replicated ``Shard``) is recorded once, from the lowest rank."""
    merged: dict[str, Any] = {}
    for entries in per_rank:
        for path, e in entries.items():
            fresh = {"dtype": e["dtype"], "shape": e["shape"], "shards": []}
            if e.get("layout") is not None:
                fresh["layout"] = e["layout"]
            m = merged.setdefault(path, fresh)
            if (m["dtype"], m["shape"], m.get("layout")) != (e["dtype"], e["shape"],
                                                             e.get("layout")):
                raise CheckpointError(
                    f"ranks disagree on tensor {path!r}: {m['dtype']} {m['shape']} "
                    f"{m.get('layout')} vs {e['dtype']} {e['shape']} {e.get('layout')}; every "
                    "rank must save the same global tensors"
                )
            m["shards"].extend(e["shards"])
    for path, m in merged.items():
        if len(m["shards"]) > 1:  # one block is unique as it is (no new list and set)
            m["shards"] = unique_blocks(m["shards"])
        # In-bounds blocks (Shard checks that) tile the tensor exactly when their
        # volumes add up to it and none overlaps; a sum that differs means a block
        # is missing or overlaps another, and the loader could not use them.
        covered = sum(math.prod(s["shape"]) for s in m["shards"])
        if covered != math.prod(m["shape"]):
            raise CheckpointError(
                f"the ranks' blocks of tensor {path!r} cover {covered} of its "
                f"{math.prod(m['shape'])} elements: blocks overlap or are missing; every "
                "element must be saved by exactly one block (identical blocks count once)"
            )
    return merged


def _as_save_error(e: BaseException, step: int) -> BaseException:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, OSError):
        err = CheckpointWriteError(
            e.errno or 0,
            f"saving step {step} failed: {e.strerror or e} ({getattr(e, 'filename', None) or ''}); "
            "nothing was committed and the previous checkpoint is intact; fix the storage "
            "(free space, permissions) and save again",
        )
        err.__cause__ = e
        return err
    err2 = CheckpointError(f"saving step {step} failed: {type(e).__name__}: {e}")
    err2.__cause__ = e
    return err2


def run_save(backend: Backend, comm: Comm, job: SaveJob, *, io_threads: int,
             own_inflight: set[str], fragments: TensorFragments | None = None,
             ) -> tuple[Manifest, bytes]:
    """Run the protocol; returns the committed manifest and its exact bytes.
    ``fragments``: the writer's encoded manifest entries of its previous save."""
    rank = comm.rank
    uid_doc: dict[str, Any] = {}
    parent: str | None = None
    if rank == 0:
        try:
            newest = _newest_name(backend)
            parent = newest.name if newest else None
            uid_doc = {"uid": new_uid(uid_time_ns(newest.uid) + 1 if newest else 0)}
        except OSError as e:
            uid_doc = {"error": f"{type(e).__name__}: {e}"}
    # Gathered, not broadcast: each rank queues its writer only after staging, so no
    # rank starts writing (CRCs, copies into the page cache) while another is still in
    # its blocked staging copy, competing for the same cores and memory bandwidth.
    uid_doc = all_gather_json(comm, uid_doc)[0]
    if "error" in uid_doc:
        raise CheckpointWriteError(0, f"saving step {job.step} failed: rank 0 cannot list "
                                      f"the store: {uid_doc['error']}")
    uid = uid_doc["uid"]
    ddir = data_dir(uid)
    marker = inflight_marker(uid, rank)
    own_inflight.add(uid)
    local_error: BaseException | None = None
    report: dict[str, Any]
    try:
        try:
            if job.error is not None:
                raise job.error
            backend.write_file(marker, [json.dumps({
                "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
                "step": job.step, "rank": rank,
            }).encode()])
            _faults.reached("before-data")
            if rank == 0:
                write_root_group(backend, ddir, {"trainguard": {"step": job.step, "uid": uid}})
            if job.staged.ready is not None:
                job.staged.ready.synchronize()
            arrays = write_rank(backend, ddir, job.plan, job.staged.segments,
                                io_threads=io_threads)
            report = {"ok": True, "arrays": arrays, "tensors": _tensor_entries(job)}
            if job.rank_state is not None:
                report["rank_state"] = _write_rank_state(backend, job, uid, rank,
                                                         comm.world_size)
        except Exception as e:
            local_error = _as_save_error(e, job.step)
            report = {"ok": False, "error": f"{type(local_error).__name__}: {local_error}"}
        if job.precommit is not None and local_error is None:
            try:
                job.precommit()
            except Exception as e:
                # The caller's own refusal (a fenced trainer): kept as raised, so the
                # caller recognises it; the other ranks learn it from the report.
                local_error = e
                report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reports = all_gather_json(comm, report)
        outcome: dict[str, Any] = {}
        manifest_bytes = b""
        if rank == 0:
            outcome, manifest_bytes = _commit(backend, job, uid, parent, reports,
                                              comm.world_size, fragments)
        outcome = broadcast_json(comm, outcome)
        manifest_bytes = comm.broadcast_bytes(manifest_bytes if rank == 0 else None)
    finally:
        with contextlib.suppress(OSError):
            backend.remove(marker)
        own_inflight.discard(uid)
    if local_error is not None:
        raise local_error
    if not outcome["ok"]:
        if outcome.get("errno"):
            raise CheckpointWriteError(outcome["errno"], outcome["error"])
        raise DistributedSaveError(outcome["error"])
    return parse_manifest(outcome["name"], manifest_bytes), manifest_bytes


def _write_rank_state(backend: Backend, job: SaveJob, uid: str, rank: int,
                      world_size: int) -> str:
    """Write this rank's state object (fsync'd with its directory); returns its digest."""
    assert job.rank_state is not None
    try:
        raw = encode_rank_state(job.rank_state, uid=uid, step=job.step, rank=rank,
                                world_size=world_size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"the rank state of rank {rank} is not plain JSON ({e}); expected str, int, "
            "float, bool, None, lists and str-keyed objects"
        ) from e
    path = rank_state_path(uid, rank)
    backend.write_file(path, [raw])
    # The new ranks/ directory's entry in the data directory, and the object's in it.
    backend.sync_dirs([path.rsplit("/", 1)[0], data_dir(uid)])
    return digest(raw)


def _rank_index(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    digests = [rep.get("rank_state") for rep in reports]
    if all(d is None for d in digests):
        return None
    missing = [r for r, d in enumerate(digests) if d is None]
    if missing:
        raise CheckpointError(
            f"ranks {missing} saved no rank state while the others did: every rank passes "
            "rank_state to save, or none does"
        )
    return make_index([str(d) for d in digests])


def _landed(backend: Backend, name: str, raw: bytes) -> bool:
    """Whether manifest ``name`` exists with exactly ``raw`` (this save's bytes)."""
    if not raw:
        return False
    try:
        return backend.read(manifest_path(name)) == raw
    except OSError:
        return False


def _commit(backend: Backend, job: SaveJob, uid: str, parent: str | None,
            reports: list[dict[str, Any]], world_size: int,
            fragments: TensorFragments | None) -> tuple[dict[str, Any], bytes]:
    ddir = data_dir(uid)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]
    if failed:
        with contextlib.suppress(OSError):
            backend.remove_tree(ddir)
        detail = "; ".join(f"rank {r}: {err}" for r, err in failed)
        return {"ok": False, "error": f"save of step {job.step} aborted, nothing committed "
                                      f"(previous checkpoint intact): {detail}"}, b""
    name = ManifestName(uid=uid, step=job.step).name
    raw = b""
    try:
        _faults.reached("after-data")
        arrays: dict[str, Any] = {}
        for rep in reports:
            arrays.update(rep["arrays"])
        raw = encode_manifest(
            step=job.step, uid=uid, created_at=time.time(), parent=parent,
            world_size=world_size, extra=job.extra, arrays=arrays,
            tensors=_merge_tensors([rep["tensors"] for rep in reports]), state=job.skeleton,
            fragments=fragments, ranks=_rank_index(reports),
        )
        try:
            backend.exclusive_create(manifest_path(name), raw)
        except FileExistsError as e:
            raise CommitConflictError(f"manifest {name} already exists; uids are unique, so "
                                      "another writer shares this store") from e
        _faults.reached("before-pointer")
    except Exception as e:
        if not _landed(backend, name, raw):
            with contextlib.suppress(OSError):
                backend.remove_tree(ddir)
            err = _as_save_error(e, job.step)
            return {"ok": False, "error": str(err), "errno": getattr(err, "errno", None)}, b""
        # The manifest's existence is the commit: an error after it (or a PUT whose
        # response was lost) leaves a committed save, whose data must stay.
        log.warning("checkpoint %s is committed (its manifest is in place) although the "
                    "commit reported %s: %s", name, type(e).__name__, e)
    try:
        # LATEST is a hint: the manifest above is the commit, so a failed swap leaves
        # a stale pointer that readers detect, not a failed save.
        backend.replace(LATEST, latest_pointer(name, job.step, uid))
        _faults.reached("after-pointer")
    except OSError as e:
        log.warning("checkpoint %s committed but LATEST was not updated: %s", name, e)
    return {"ok": True, "name": name}, raw
