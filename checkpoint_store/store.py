"""``CheckpointStore``: the facade users call. See FORMAT.md for what it writes."""

from __future__ import annotations

import builtins
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from checkpoint_store import _faults
from checkpoint_store._catalog import Catalog
from checkpoint_store._page_reuse import ChunkMaps
from checkpoint_store.backends import Backend, LocalBackend, open_backend
from checkpoint_store.direct import DirectLoad
from checkpoint_store.dist import Comm, all_gather_json, make_comm
from checkpoint_store.flatten import TensorLeaf, decode_skeleton, flatten
from checkpoint_store.handle import SaveHandle
from checkpoint_store.layout import data_dir
from checkpoint_store.loading import Applier
from checkpoint_store.manifest import Manifest, TensorFragments, json_extra
from checkpoint_store.plan import plan_rank
from checkpoint_store.rank_content import load_content
from checkpoint_store.reader import ChunkReader
from checkpoint_store.retention import remove_data
from checkpoint_store.saving import SaveJob, run_save, stage_in_files
from checkpoint_store.staging import BufferPool, Staged, direct_segments
from trainguard.core.checkpoints import (
    CheckpointError,
    CorruptCheckpointError,
    IfBusy,
    NoCheckpointError,
    SaveInProgressError,
    check_if_busy,
)

__all__ = ["CheckpointStore"]

log = logging.getLogger("checkpoint_store")

DEFAULT_CHUNK_BYTES = 32 << 20


class CheckpointStore(Catalog):
    """Save, list, verify and load checkpoints under one root URL.

    ``url``: ``file:///abs/path``, a plain path, ``memory://name``, ``s3://bucket/prefix``
    (``storage_options`` go to fsspec). With torch.distributed initialized, the store
    is collective: every rank constructs it, calls ``save`` and ``load`` in the same
    order; rank 0 commits and applies retention.

    ``chunk_bytes`` (target size of a chunk file) and ``io_threads`` (parallel chunk
    I/O) tune throughput; ``stale_after_s`` is how old another host's in-flight marker
    must be before ``gc`` treats its save as dead.

    ``stage_in_files=True`` (a local one-process store: the RAM tier): an async save of
    CPU tensors copies them into its chunk files, not a host buffer (``_file_staging``),
    into the pages of a dropped checkpoint's where there are (``chunk_maps``)."""

    supports_rank_state = True
    """Capability: ``save(rank_state=...)`` and :meth:`read_rank_state` (a session
    then writes per-rank state objects; without it, its whole record in ``extra``)."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int = 4,
        stale_after_s: float = 24 * 3600.0,
        stage_in_files: bool = False,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        url = os.fspath(url)
        self.url = url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.chunk_bytes = chunk_bytes
        self.io_threads = io_threads
        self.stale_after_s = stale_after_s
        self._storage_options = storage_options
        self._process_group = process_group
        self._backend: Backend = open_backend(url, storage_options)
        self._comm: Comm = make_comm(process_group)
        self.stage_in_files = stage_in_files
        # Set by a tier that budgets its bytes (RamTierStore): called with the leaves a
        # save writes and its skeleton, before anything is staged; a raise fails the save.
        self.before_stage: Callable[[Sequence[TensorLeaf], bytes], None] | None = None
        self.chunk_maps: ChunkMaps | None = None
        if stage_in_files:
            if not (isinstance(self._backend, LocalBackend) and self._comm.world_size == 1):
                raise ValueError(
                    f"stage_in_files=True needs a local directory and a one-process store; "
                    f"got {url!r} with {self._comm.world_size} ranks: leave it False there")
            self.chunk_maps = ChunkMaps(self._backend)
        self._pool = BufferPool()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._current: SaveHandle | None = None
        self._unreported: SaveHandle | None = None
        self._own_inflight: set[str] = set()
        # name -> (its file's modification time when verified, parsed): listings and
        # retention re-list every kept manifest after each save (Catalog._read_manifest).
        self._parsed: dict[str, tuple[float | None, Manifest]] = {}
        # Only the writer thread encodes manifests.
        self._fragments = TensorFragments()
        self._closed = False

    def _reopen_args(self) -> dict[str, Any]:
        """What opens this store again in another process (DCP's process-based
        ``async_save``, whose process has only the default group)."""
        if self._process_group is not None:
            raise CheckpointError(
                f"the store {self.url} runs over a process_group of its own, which DCP's "
                "checkpoint process cannot rebuild; use the thread-based async_save, or a "
                "store over the default group"
            )
        return {"url": self.url, "keep_last": self.keep_last, "keep_every": self.keep_every,
                "storage_options": self._storage_options, "chunk_bytes": self.chunk_bytes,
                "io_threads": self.io_threads, "stale_after_s": self.stale_after_s,
                "stage_in_files": self.stage_in_files}

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    # ---------------------------------------------------------------- save
    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = True,
        if_busy: IfBusy = "wait",
        rank_state: Mapping[str, Any] | None = None,
        precommit: Callable[[], None] | None = None,
    ) -> SaveHandle:
        """Stage ``state`` and write it as checkpoint ``step``.

        ``rank_state``: this rank's own small JSON document, written beside its shards
        as its state object and indexed (by digest) in the manifest; read back with
        :meth:`read_rank_state`. Every rank passes one, or none does.

        ``precommit``: called in the writer thread once this rank's data and object
        are written, before it reports to rank 0 (``RankStateStoreAPI``); what it
        raises fails the save on every rank (nothing committed), raised as it is.

        ``blocking=False`` returns once the tensors are copied to host buffers; the
        handle completes when the manifest is committed. A second save waits for the
        one in flight (``if_busy="wait"``) or raises SaveInProgressError
        (``"raise"``). A background failure nobody has seen through ``wait()`` is
        raised here, by the next save."""
        if self._closed:
            raise CheckpointError("the store is closed")
        if_busy = check_if_busy(if_busy)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra_doc = json_extra(extra)
        rank_doc = None if rank_state is None else dict(rank_state)
        # One caller at a time from here to the hand-off: the staging buffer is shared.
        with self._save_lock:
            return self._save_locked(state, step, extra_doc, blocking, if_busy, rank_doc,
                                     precommit)

    def _save_locked(self, state: Mapping[str, Any], step: int, extra_doc: dict[str, Any],
                     blocking: bool, if_busy: IfBusy,
                     rank_doc: dict[str, Any] | None = None,
                     precommit: Callable[[], None] | None = None) -> SaveHandle:
        with self._lock:
            current = self._current
        if current is not None and not current.done():
            if if_busy == "raise":
                raise SaveInProgressError(
                    f"the save of step {current.step} is still being written; wait for its "
                    "handle or pass if_busy='wait'"
                )
            # The finished write frees the staging buffer; its callbacks may still
            # run, and the new job queues behind them in the writer thread.
            current._result.wait()
        self._raise_unreported()
        try:
            job = self._prepare(state, step, extra_doc, blocking)
            job.rank_state = rank_doc
            job.precommit = precommit
        except Exception as e:
            if self.world_size == 1:
                raise
            # The other ranks are entering the save's collectives: take part with the
            # error, so that every rank learns it now (not at the gloo timeout).
            job = SaveJob(step, extra_doc, [], plan_rank([], rank=self.rank, chunk_bytes=1,
                                                         own_array_bytes=1),
                          Staged([], None), b"", error=e)
        handle = SaveHandle(step)
        with self._lock:
            self._current = handle
        self._executor.submit(self._run, handle, job)
        if blocking or job.error is not None:
            handle.wait()
        return handle

    def _prepare(self, state: Mapping[str, Any], step: int, extra_doc: dict[str, Any],
                 blocking: bool) -> SaveJob:
        leaves, skeleton = flatten(state)
        if self.world_size > 1 and self.rank != 0:
            # Replicated plain values are rank 0's to write.
            leaves = [leaf for leaf in leaves if leaf.sharded]
        # A DTensor replica leaves its block to the replica at coordinate 0.
        leaves = [leaf for leaf in leaves if leaf.writes]
        if self.before_stage is not None:
            self.before_stage(leaves, skeleton)
        plan = plan_rank(leaves, rank=self.rank, chunk_bytes=self.chunk_bytes,
                         own_array_bytes=self.chunk_bytes)
        on_cpu = all(not leaf.tensor.is_cuda for leaf in leaves)
        if not blocking and self.stage_in_files and on_cpu:
            assert isinstance(self._backend, LocalBackend)
            return stage_in_files(self._backend, self._own_inflight, self.rank,
                                  SaveJob(step, extra_doc, leaves, plan, Staged([], None),
                                          skeleton, maps=self.chunk_maps))
        if self.chunk_maps is not None:  # spares are for staging: freed before new files
            self.chunk_maps.fit([])
        if blocking and on_cpu:
            staged = Staged(direct_segments(leaves, plan), None)
        else:
            staged = self._pool.stage(leaves, plan)
        return SaveJob(step, extra_doc, leaves, plan, staged, skeleton)

    def _run(self, handle: SaveHandle, job: SaveJob) -> None:
        try:
            manifest, _raw = run_save(self._backend, self._comm, job,
                                     io_threads=self.io_threads,
                                     own_inflight=self._own_inflight,
                                     fragments=self._fragments)
        except BaseException as e:
            if job.spares and job.maps is not None:  # failed before placing them
                job.maps.give_back([(spare, m) for spare, _, m in job.spares])
            with self._lock:
                self._unreported = handle
            handle._finish(None, e)
            return
        retired: builtins.list[Manifest] = []
        if self.rank == 0:
            # Retention and the next listings read every manifest: this one is
            # parsed already, and its bytes are the ones just committed.
            self._remember_commit(manifest)
            try:
                retired = self._retire(protect=manifest.name)
            except Exception:
                log.exception("retention after committing %s failed", manifest.name)
        handle._finish(manifest, None)
        _faults.reached("retired")
        # The save's caller goes on (training) while the retired checkpoints' data, the
        # slow half of retention, is removed here, before this store's next save writes:
        # the disk never holds more than it did with the removal inside the save.
        try:
            remove_data(self._backend, retired)
        except Exception:
            log.exception("removing the data of %s failed (gc removes it later)",
                          [m.name for m in retired])

    def _raise_unreported(self) -> None:
        with self._lock:
            failed, self._unreported = self._unreported, None
        if failed is not None and not failed.error_reported and failed.error is not None:
            failed.error_reported = True
            raise CheckpointError(
                f"the previous save (step {failed.step}) failed in the background: "
                f"{failed.error}; nothing was committed for it"
            ) from failed.error

    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> Manifest | None:
        """Load the checkpoint a restart resumes from (or ``step``'s newest save) into
        ``state`` in place: the newest valid one in restore order
        (:func:`trainguard.core.newest.restore_order`; commit order for checkpoints
        without a session record).

        Every chunk read is verified (CRC-32C), and a load that returns has loaded
        every selected tensor from that one checkpoint. A damaged checkpoint is skipped
        with a warning and the previous one loaded; ``strict=True`` raises
        CorruptCheckpointError instead. Returns None when the store holds no
        checkpoint at all.

        Large tensors are read straight into ``state``'s tensors and verified there
        (no second copy of the state in memory) when an earlier checkpoint exists to
        fall back to: if one of their chunks is damaged, the fallback reloads every
        tensor from the earlier checkpoint. ``strict=True``, ``step=...`` and the
        oldest checkpoint instead verify everything before changing anything in
        ``state``, so their errors leave it untouched. Only when every fallback fails
        too does an error leave ``state`` partly overwritten, and it says so."""
        self._wait_current()
        keys = list(keys) if keys is not None else None
        candidates = self._candidates(step)
        if not candidates:
            if step is not None:
                raise NoCheckpointError(f"no checkpoint of step {step} in {self.url}")
            return None
        if step is None:
            problem = self._check_latest_pointer(candidates)
            if problem is not None:
                if strict:
                    raise CorruptCheckpointError(f"{problem} in {self.url}")
                log.warning("%s in %s; using the manifest listing", problem, self.url)
        damaged: builtins.list[str] = []
        pins = self._pins()
        dirty = False  # the state holds bytes of a damaged checkpoint read in place
        for i, n in enumerate(candidates):
            # In-place reads only where a failure can be repaired by this very call:
            # a later candidate reloads everything. Strict loads, loads of one step and
            # the last candidate stage and verify everything before changing anything.
            in_place = not strict and step is None and not dirty and i < len(candidates) - 1
            applier: Applier | None = None
            verdict: dict[str, str] = {}
            refusal: BaseException | None = None
            manifest: Manifest | None = None
            try:
                manifest = self._read_manifest(n.name, pins)
                arrays, tensors = load_content(self._backend, manifest, self.rank, self.world_size)
                ddir, io = data_dir(manifest.uid), self.io_threads
                reader = ChunkReader(self._backend, ddir, arrays, io_threads=io)
                direct = DirectLoad(self._backend, ddir, arrays, io_threads=io) if in_place else None
                applier = Applier(manifest.name, tensors, reader, direct)
                with torch.no_grad():
                    applier.prepare(state, decode_skeleton(manifest.state), keys)
                if direct is not None:
                    direct.run()
            except CorruptCheckpointError as e:
                verdict = {"damaged": str(e)}
            except NoCheckpointError:
                verdict = {"gone": n.name}
            except Exception as e:
                # A state that does not fit is refused on every rank, not only here:
                # the others must not wait in the collective below for this one.
                verdict, refusal = {"refused": f"{type(e).__name__}: {e}"}, e
            # Every rank's verdict only when some rank has one to give: a one-flag
            # all-reduce first, so a sound restore gathers nothing of W ranks.
            verdicts = ([verdict] * self._comm.world_size
                        if not self._comm.all_reduce_int64([int(bool(verdict))], "max")[0]
                        else all_gather_json(self._comm, verdict))
            if refusal is not None:
                if dirty:
                    refusal.add_note(_dirty_note(damaged))
                raise refusal
            refused = [(r, v["refused"]) for r, v in enumerate(verdicts) if "refused" in v]
            if refused:
                raise CheckpointError(f"loading {n.name} was refused by rank "
                                      f"{refused[0][0]}: {refused[0][1]}")
            if any("gone" in v for v in verdicts):
                continue
            verdicts = [v.get("damaged", "") for v in verdicts]
            bad = [(r, v) for r, v in enumerate(verdicts) if v]
            if not bad:
                assert applier is not None and manifest is not None
                with torch.no_grad():
                    applier.apply(state)
                if damaged:
                    log.warning("loaded %s after skipping damaged %s", manifest.name, damaged)
                return manifest
            detail = "; ".join(f"rank {r}: {v}" for r, v in bad)
            if strict:
                raise CorruptCheckpointError(f"checkpoint {n.name} is damaged: {detail}")
            log.warning("checkpoint %s is damaged (%s); falling back to the previous one%s",
                        n.name, detail, " (reloading every tensor)" if in_place else "")
            damaged.append(n.name)
            dirty = dirty or in_place
        raise CorruptCheckpointError(
            f"no loadable checkpoint in {self.url}: damaged {damaged}; restore from a copy"
            + (f". {_dirty_note(damaged)}" if dirty else "")
        )

    # ---------------------------------------------------------------- lifecycle
    def _wait_current(self) -> None:
        with self._lock:
            current = self._current
        if current is not None:
            current._settle()

    def close(self) -> None:
        """Wait for the save in flight, stop the writer thread, and raise a background
        failure that neither ``wait()`` nor a later ``save()`` reported."""
        if self._closed:
            return
        self._wait_current()
        self._closed = True
        self._executor.shutdown(wait=True)
        if self.chunk_maps is not None:
            self.chunk_maps.close()
        self._raise_unreported()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError:
            # Do not mask the exception already propagating; the failure is logged.
            log.exception("a background save failed while the store was being closed")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, rank={self.rank}/{self.world_size})"


def _dirty_note(damaged: builtins.list[str]) -> str:
    return (f"The state's large tensors were read in place from {damaged[0]} before its "
            "damage showed, and no later load replaced them: rebuild the state (or load "
            "another store) before using it")

