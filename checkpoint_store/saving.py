"""The save protocol, run in the background writer thread on every rank.

1. rank 0 picks the uid (sorting after every existing manifest); every rank gathers it
   once every rank has staged its state;
2. each rank writes its in-flight marker, then its arrays and its state object
   (``rank_state``; every file and directory fsync'd);
3. ranks report success or failure to rank 0 (a gather to rank 0 alone: success, the
   state object's digest and the rank's tensor bytes, never its tensor entries); with
   several ranks, those entries are in each rank's object (format 4), and a fixed-size
   reduction checks that the ranks' blocks agree on each tensor and tile it
   (:func:`checkpoint_store.rank_content.check_blocks`);
4. rank 0, only if every rank succeeded, writes the manifest (exclusive create: the
   commit point; with several ranks an index of their objects), then swaps LATEST;
   otherwise it removes the save's data;
5. rank 0 broadcasts the outcome (the manifest bytes, or the error) to every rank;
6. each rank removes its marker.

A crash anywhere before step 4's manifest leaves only debris that ``gc`` removes; the
previous checkpoint stays current.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_store import _faults
from checkpoint_store._file_staging import Spares, seal_rank, stage_files, stage_in_spares
from checkpoint_store._page_reuse import ChunkMaps
from checkpoint_store.backends import Backend, LocalBackend
from checkpoint_store.dist import Comm, broadcast_json, gather_json
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
from checkpoint_store.manifest import (
    FORMAT_VERSION,
    Manifest,
    TensorFragments,
    encode_manifest,
    parse_manifest,
)
from checkpoint_store.plan import RankPlan
from checkpoint_store.rank_content import (
    check_blocks,
    merge_tensors,
    rank_entries,
    skeleton_paths,
    with_content,
)
from checkpoint_store.rank_state import digest, encode_rank_state, make_index, rank_state_path
from checkpoint_store.staging import Staged
from checkpoint_store.writer import write_rank, write_root_group
from trainguard.core.checkpoints import (
    CheckpointError,
    CheckpointWriteError,
    CommitConflictError,
    DistributedSaveError,
)
from trainguard.core.newest import newest_committed

__all__ = ["SaveJob", "as_save_error", "latest_pointer", "pick_uid", "run_save", "stage_in_files",
           "write_marker"]

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
    uid: str | None = None
    """Set when the chunk files are staged already under ``data/<uid>`` (with the
    in-flight marker; ``_file_staging``, one-process stores): steps 1 and 2's marker
    were done in the caller's thread, and the writer seals the files."""
    parent: str | None = None
    """The newest manifest when ``uid`` was chosen (the new manifest's parent)."""
    maps: ChunkMaps | None = None
    """The store's mappings of its chunk files, with ``uid`` or ``spares``."""
    spares: Spares | None = None
    """Set when every chunk is copied already into a dropped checkpoint's spare file
    (``_file_staging.stage_in_spares``): the writer chooses the uid, writes the marker
    and places the spares (emptied then) before it seals them."""


def latest_pointer(name: str, step: int, uid: str) -> bytes:
    return (json.dumps({"manifest": name, "step": step, "uid": uid}, sort_keys=True) + "\n").encode()


def _newest_name(backend: Backend) -> ManifestName | None:
    names = [p for p in map(parse_manifest_name, backend.listdir(MANIFEST_DIR)) if p]
    return newest_committed(names)


def pick_uid(backend: Backend) -> tuple[str, str | None]:
    """A uid sorting after every committed manifest, and the newest one's name (the
    parent). Raises OSError when the store cannot be listed."""
    newest = _newest_name(backend)
    return new_uid(uid_time_ns(newest.uid) + 1 if newest else 0), (newest.name if newest else None)


def write_marker(backend: Backend, uid: str, rank: int, step: int) -> None:
    """This rank's in-flight marker of save ``uid`` (``gc`` spares a live writer's)."""
    backend.write_file(inflight_marker(uid, rank), [json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
        "step": step, "rank": rank,
    }).encode()])


def stage_in_files(backend: LocalBackend, own_inflight: set[str], rank: int,
                   job: SaveJob) -> SaveJob:
    """The caller's thread's half of an async save staged in the store's files
    (``_file_staging``): every chunk copied into a dropped checkpoint's spares, which
    the writer places with the uid and the marker (``job.spares``); else uid, marker and
    chunk files now (``job.uid``). The writer seals them."""
    maps = job.maps
    if maps is not None:
        job.spares = stage_in_spares(job.plan, job.leaves, maps)
        if job.spares is not None:
            return job
    uid, parent = pick_uid(backend)
    step = job.step
    own_inflight.add(uid)
    try:
        write_marker(backend, uid, rank, step)
        _faults.reached("before-data")
        stage_files(backend, data_dir(uid), job.plan, job.leaves, maps)
    except BaseException as e:
        with contextlib.suppress(OSError):
            backend.remove_tree(data_dir(uid))
        with contextlib.suppress(OSError):
            backend.remove(inflight_marker(uid, rank))
        own_inflight.discard(uid)
        if isinstance(e, OSError):  # tmpfs full, say: what and what to do
            raise as_save_error(e, step) from e
        raise
    job.uid, job.parent = uid, parent
    return job


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


def as_save_error(e: BaseException, step: int) -> BaseException:
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
    staged_in_files = job.uid is not None or job.spares is not None
    if staged_in_files and comm.world_size != 1:
        raise CheckpointError("a save staged in the store's files needs a one-process "
                              f"store; this one has {comm.world_size} ranks")
    if job.uid is not None:
        uid, parent = job.uid, job.parent
    else:
        uid, parent = _gathered_uid(backend, comm, job.step)
    ddir = data_dir(uid)
    marker = inflight_marker(uid, rank)
    own_inflight.add(uid)
    world = comm.world_size
    local_error: BaseException | None = None
    report: dict[str, Any]
    entries: dict[str, Any] | None = None
    try:
        try:
            if job.error is not None:
                raise job.error
            if job.uid is None:  # else the caller's thread wrote it, with the files
                write_marker(backend, uid, rank, job.step)
                _faults.reached("before-data")
            if rank == 0:
                write_root_group(backend, ddir, {"trainguard": {"step": job.step, "uid": uid}})
            if job.staged.ready is not None:
                job.staged.ready.synchronize()
            if staged_in_files:
                assert isinstance(backend, LocalBackend)  # CheckpointStore checks it
                arrays = seal_rank(backend, ddir, job.plan, io_threads=io_threads, maps=job.maps,
                                   spares=job.spares)
            else:
                arrays = write_rank(backend, ddir, job.plan, job.staged.segments,
                                    io_threads=io_threads)
            entries = _tensor_entries(job)
            if world == 1:  # the manifest holds the index (format 3): nothing to send
                report = {"ok": True, "arrays": arrays, "tensors": entries}
            else:
                report = {"ok": True, "nbytes": job.plan.nbytes}
            if job.rank_state is not None or world > 1:
                report["rank_state"] = _write_rank_state(
                    backend, job, uid, rank, world,
                    None if world == 1 else (arrays, rank_entries(entries)))
        except Exception as e:
            local_error = as_save_error(e, job.step)
            report = {"ok": False, "error": f"{type(local_error).__name__}: {local_error}"}
            entries = None
        if job.precommit is not None and local_error is None:
            try:
                job.precommit()
            except Exception as e:
                # The caller's own refusal (a fenced trainer): kept as raised, so the
                # caller recognises it; the other ranks learn it from the report.
                local_error = e
                report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        blocks = _check_blocks(comm, job, entries) if world > 1 else None
        reports = gather_json(comm, report)
        outcome: dict[str, Any] = {}
        manifest_bytes = b""
        if rank == 0:
            assert reports is not None
            outcome, manifest_bytes = _commit(backend, job, uid, parent, reports,
                                              world, fragments, blocks)
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
    manifest = with_content(backend, parse_manifest(outcome["name"], manifest_bytes))
    return manifest, manifest_bytes


def _check_blocks(comm: Comm, job: SaveJob, entries: dict[str, Any] | None) -> str | None:
    """Collective: the fixed-size check of every rank's blocks (the same verdict on
    every rank), over the tensor paths of rank 0's skeleton, which rank 0 sends."""
    paths: list[str] = []
    if comm.rank == 0:
        try:
            paths = skeleton_paths(job.skeleton)
        except Exception:  # rank 0 failed before it had a skeleton: its report says so
            paths = []
    paths = broadcast_json(comm, paths)
    return check_blocks(comm, paths, entries)


def _gathered_uid(backend: Backend, comm: Comm, step: int) -> tuple[str, str | None]:
    """Step 1: rank 0's uid (and parent), known to every rank."""
    uid_doc: dict[str, Any] = {}
    parent: str | None = None
    if comm.rank == 0:
        try:
            uid, parent = pick_uid(backend)
            uid_doc = {"uid": uid}
        except OSError as e:
            uid_doc = {"error": f"{type(e).__name__}: {e}"}
    # A barrier (a one-int64 all-reduce) before the broadcast: each rank queues its
    # writer only after staging, so no rank starts writing (CRCs, copies into the page
    # cache) while another is still in its blocked staging copy, competing for the same
    # cores and memory bandwidth. Not an all-gather: every rank would receive W docs.
    if comm.world_size > 1:
        comm.all_reduce_int64([0], "max")
    uid_doc = broadcast_json(comm, uid_doc)
    if "error" in uid_doc:
        raise CheckpointWriteError(0, f"saving step {step} failed: rank 0 cannot list "
                                      f"the store: {uid_doc['error']}")
    return str(uid_doc["uid"]), parent


def _write_rank_state(backend: Backend, job: SaveJob, uid: str, rank: int,
                      world_size: int,
                      content: tuple[dict[str, Any], dict[str, Any]] | None) -> str:
    """Write this rank's state object (fsync'd with its directory); returns its digest.
    ``content``: the rank's arrays and tensor entries (several ranks: format 4)."""
    try:
        raw = encode_rank_state(job.rank_state, uid=uid, step=job.step, rank=rank,
                                world_size=world_size, content=content)
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
            fragments: TensorFragments | None,
            blocks: str | None) -> tuple[dict[str, Any], bytes]:
    ddir = data_dir(uid)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]
    if failed or blocks is not None:
        with contextlib.suppress(OSError):
            backend.remove_tree(ddir)
        detail = "; ".join(f"rank {r}: {err}" for r, err in failed) or str(blocks)
        return {"ok": False, "error": f"save of step {job.step} aborted, nothing committed "
                                      f"(previous checkpoint intact): {detail}"}, b""
    name = ManifestName(uid=uid, step=job.step).name
    raw = b""
    try:
        _faults.reached("after-data")
        if world_size == 1:
            raw = encode_manifest(
                step=job.step, uid=uid, created_at=time.time(), parent=parent,
                world_size=1, extra=job.extra, arrays=reports[0]["arrays"],
                tensors=merge_tensors([reports[0]["tensors"]]), state=job.skeleton,
                fragments=fragments, ranks=_rank_index(reports),
            )
        else:  # format 4: the arrays and tensor entries are in the ranks' objects
            raw = encode_manifest(
                step=job.step, uid=uid, created_at=time.time(), parent=parent,
                world_size=world_size, extra=job.extra, arrays={}, tensors={},
                state=job.skeleton, ranks=_rank_index(reports), version=FORMAT_VERSION,
                nbytes=sum(int(rep["nbytes"]) for rep in reports),
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
            err = as_save_error(e, job.step)
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
