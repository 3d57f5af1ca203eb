"""A ``torch.distributed.checkpoint`` (DCP) backend: DCP's planners, trainguard's format.

```python
store = CheckpointStore("s3://bucket/run42")                     # on every rank
dcp.save(state, storage_writer=StorageWriter(store, step=100, extra={...}))
dcp.async_save(state, storage_writer=StorageWriter(store, step=200))
dcp.load(state, storage_reader=StorageReader(store))             # newest checkpoint
```

Saving: DCP's planners decide who writes what (each DTensor/FSDP2 shard by its owner,
each replicated item by one rank); ``write_data`` hands that rank's items to
``CheckpointStore.save`` as ``Shard`` blocks (``Shards`` where the rank holds several
chunks of one tensor), nested along DCP's key paths (``_dcp_tree``), so the save is
an ordinary trainguard checkpoint of the state DCP was given: Zarr arrays with CRC-32C
chunks, the manifest commit (only when every rank wrote), LATEST, retention.
``finish`` has nothing left to do: the manifest was committed inside ``write_data``.

Non-tensor items (an optimizer's ``param_groups``, a step counter, an ``io.BytesIO``)
are given by DCP to any rank, not only rank 0. They are never pickled: ``write_data``
encodes each with the checkpoint's msgpack types (FORMAT.md, "State skeleton") and
every rank gathers them, so rank 0's skeleton holds them all. A value msgpack cannot
hold (an arbitrary Python object, or a tensor nested inside a non-tensor value) is
refused with UnsupportedValueError naming it, and nothing is committed.

Loading: ``read_metadata`` builds DCP's ``Metadata`` from the manifest (rank 0 chooses
the checkpoint, every rank uses that one), with ``planner_data`` (each name's key
path: what ``_load_state_dict_from_keys`` and ``dcp_to_torch_save`` rebuild a nested
state from) and ``storage_data`` (each chunk's tensor in the manifest); and ``read_data`` fills each requested
block through the same resharding plan and CRC-verified reads as
``CheckpointStore.load``, every byte of the rank's plan verified before any target
changes. DCP's planner API takes non-tensor items as a ``torch.save`` stream, so the
decoded values are serialized in memory for it; nothing pickled touches storage.
A damaged checkpoint raises (DCP has no fallback); ``CheckpointStore.load`` falls back.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_store._dcp_tree import (
    KeyPath,
    dcp_metadata,
    dcp_names,
    key_paths,
    nest,
    plain_value,
    tensor_path,
)
from checkpoint_store.dist import broadcast_json
from checkpoint_store.dtypes import raw_view
from checkpoint_store.flatten import TensorRef, decode_skeleton, encode_values
from checkpoint_store.layout import data_dir
from checkpoint_store.loading import _Walker
from checkpoint_store.manifest import Manifest
from checkpoint_store.reader import ChunkReader
from checkpoint_store.shard import Shard, Shards
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import CheckpointError, CheckpointExistsError, NoCheckpointError

__all__ = ["StorageReader", "StorageWriter"]


def _step_of(checkpoint_id: Any) -> int | None:
    """DCP's ``checkpoint_id`` here is a step (int or digits), or None."""
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)
    if not str(text).isdigit():
        raise ValueError(f"checkpoint_id for a trainguard store is a step number, got "
                         f"{checkpoint_id!r}")
    return int(text)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()  # torch's future: DCP calls wait() and value()
    fut.set_result(value)
    return fut


_REOPENED: dict[str, CheckpointStore] = {}
"""Stores opened by unpickled writers, by their arguments: DCP's checkpoint process
serves every save of a run, and each would otherwise open (and leak) a gloo group."""


def _reopened(args: dict[str, Any]) -> CheckpointStore:
    key = json.dumps(args, sort_keys=True)
    store = _REOPENED.get(key)
    if store is None:
        options = {k: v for k, v in args.items() if k != "url"}
        store = _REOPENED[key] = CheckpointStore(args["url"], **options)
    return store


class StorageWriter(tdcp.StorageWriter):
    """Writes a DCP save as trainguard checkpoint ``step`` of ``store`` (constructed
    on every rank, like the store). ``extra`` goes into the manifest verbatim.

    ``overwrite`` is DCP's flag, mapped onto commits that never replace data: True
    (DCP's default) commits a newer checkpoint of a step the store already holds,
    which loads supersede (the older stays until retention removes it); False refuses
    that save with CheckpointExistsError ("Checkpoint already exists"), nothing
    written. The writer pickles (DCP's process-based ``async_save`` sends it to a
    process of its own): it carries the store's arguments, not the store, and that
    process opens one store on the same root for all its saves."""

    def __init__(self, store: CheckpointStore, *, step: int,
                 extra: Mapping[str, Any] | None = None, overwrite: bool = True,
                 rank_state: Mapping[str, Any] | None = None):
        super().__init__()
        self.store: CheckpointStore | None = store
        self.step = step
        self.extra = dict(extra) if extra is not None else None
        # This rank's state object (offsets, random states: ``CheckpointStore.save``'s
        # ``rank_state``); it travels with the writer into DCP's checkpoint process.
        self.rank_state = dict(rank_state) if rank_state is not None else None
        self.overwrite = overwrite
        self.manifest: Manifest | None = None
        self._reopen: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Threads, locks and a gloo group do not cross processes: the arguments do.
        reopen = self.store._reopen_args() if self.store is not None else self._reopen
        return {"reopen": reopen, "step": self.step, "extra": self.extra,
                "overwrite": self.overwrite, "rank_state": self.rank_state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.store, self.manifest = None, None
        self._reopen = state["reopen"]
        self.step, self.extra, self.overwrite = state["step"], state["extra"], state["overwrite"]
        self.rank_state = state.get("rank_state")

    def _store(self) -> CheckpointStore:
        if self.store is None:
            assert self._reopen is not None
            self.store = _reopened(self._reopen)  # collective: every rank sets up here
        return self.store

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._store()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator only; DCP hands its error to every rank before any writes.
        if not self.overwrite:
            self._refuse_existing()
        return plans

    def _refuse_existing(self) -> None:
        store = self._store()
        for n in reversed(store._names()):
            if n.step != self.step:
                continue
            try:
                store._read_manifest(n.name)
            except CheckpointError:
                continue  # a damaged manifest is no checkpoint
            raise CheckpointExistsError(
                f"Checkpoint already exists: {store.url} holds step {self.step} "
                f"({n.name}) and overwrite=False; save another step, or pass "
                "overwrite=True to commit a newer checkpoint of it (loads take the newer; "
                "the older stays until retention removes it)"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store = self._store()
        blocks: dict[str, list[Shard]] = {}
        values: dict[str, Any] = {}
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                # The object itself, not resolve_data's torch.save stream: no pickle.
                values[fqn] = planner.lookup_object(item.index)  # type: ignore[attr-defined]
                results.append(WriteResult(item.index, 0, None))
                continue
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor) and item.tensor_data is not None
            chunk = item.tensor_data.chunk
            # A rank may hold several chunks of one tensor (a ShardedTensor's local
            # shards): all of them are this rank's blocks of it.
            blocks.setdefault(fqn, []).append(
                Shard(t.detach(), tuple(item.tensor_data.size), tuple(chunk.offsets)))
            results.append(WriteResult(item.index, t.numel() * t.element_size(), None))
        paths = key_paths(plan.planner_data, [*blocks, *values])
        # The state's order (rank 0's names), so the stored state reads like the saved one.
        order = list(plan.planner_data) if store.rank == 0 and isinstance(
            plan.planner_data, Mapping) else []
        # Wait for a save in flight: its collectives share the store's group.
        store._wait_current()
        try:
            mine = b"\0" + msgpack.packb(
                [{k: list(v) for k, v in paths.items()}, order, sorted(blocks),
                 encode_values(values, what=f"DCP item of rank {store.rank}")],
                use_bin_type=True)
        except CheckpointError as e:
            mine = f"{type(e).__name__}: {e}".encode()
        gathered = store._comm.all_gather_bytes(mine)
        failed = [(r, g.decode()) for r, g in enumerate(gathered) if g[:1] != b"\0"]
        if failed:
            raise CheckpointError(
                f"DCP save of step {self.step} refused, nothing committed: rank "
                f"{failed[0][0]}: {failed[0][1]}"
            )
        flat: dict[str, Any] = {k: v[0] if len(v) == 1 else Shards(tuple(v))
                                for k, v in blocks.items()}
        all_paths: dict[str, KeyPath] = {}
        for i, g in enumerate(gathered):
            rank_paths, rank_order, tensor_fqns, packed = msgpack.unpackb(g[1:], raw=False)
            if i == 0:
                all_paths.update((n, ()) for n in rank_order)  # placeholders: the order
            all_paths.update((k, tuple(v)) for k, v in rank_paths.items())
            flat.update(decode_skeleton(packed))
            # Tensors DCP gave to other ranks: rank 0's skeleton references them too.
            for fqn in tensor_fqns:
                flat.setdefault(fqn, TensorRef(tensor_path(all_paths[fqn])))
        state = nest(flat, {k: v for k, v in all_paths.items() if v})
        self.manifest = store.save(state, step=self.step, extra=self.extra,
                                   rank_state=self.rank_state).wait()
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The manifest was committed in write_data, after every rank wrote its part.
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _step_of(checkpoint_id) is not None
        except ValueError:
            return False


class StorageReader(tdcp.StorageReader):
    """Reads the newest checkpoint of ``store`` (or ``step``'s, or DCP's
    ``checkpoint_id`` as a step) into a DCP load, in any layout."""

    def __init__(self, store: CheckpointStore, *, step: int | None = None):
        super().__init__()
        self.store = store
        self.step = step
        self.manifest: Manifest | None = None
        self._names: dict[str, tuple[KeyPath, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    def _choose(self) -> dict[str, str]:
        try:
            names = [n for n in self.store._names() if self.step is None or n.step == self.step]
            for n in reversed(names):
                try:
                    return {"name": self.store._read_manifest(n.name).name}
                except CheckpointError:
                    continue
            return {"error": f"no loadable checkpoint{'' if self.step is None else ' of step '}"
                             f"{'' if self.step is None else self.step} in {self.store.url}"}
        except OSError as e:
            return {"error": f"cannot list {self.store.url}: {e}"}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.store._wait_current()
        comm = self.store._comm
        chosen = broadcast_json(comm, self._choose() if comm.rank == 0 else None)
        if "error" in chosen:
            raise NoCheckpointError(chosen["error"])
        self.manifest = self.store._read_manifest(chosen["name"])
        self._names = dcp_names(self.manifest, decode_skeleton(self.manifest.state))
        return dcp_metadata(self.manifest, self._names)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self.manifest
        assert m is not None, "read_metadata runs first"
        reader = ChunkReader(self.store._backend, data_dir(m.uid), m.arrays,
                             io_threads=self.store.io_threads)
        walker = _Walker(m.name, m.tensors, reader)
        tensors = [i for i in plan.items if i.type == LoadItemType.TENSOR]

        def block(item: Any) -> tuple[dict[str, Any], tuple[int, ...], tuple[int, ...]]:
            entry = m.tensors[self._names[item.storage_index.fqn][1].path]
            start = tuple(a + b for a, b in zip(item.storage_index.offset or (),
                                               item.storage_offsets))
            return entry, start or (0,) * len(item.lengths), tuple(item.lengths)

        # Every bytes item first: a refusal leaves the targets untouched.
        values = {i.storage_index.fqn: plain_value(m, self._names, i.storage_index.fqn)
                  for i in plan.items if i.type == LoadItemType.BYTE_IO}
        walker.dry = True
        for item in tensors:
            walker.region(*block(item), item.storage_index.fqn)
        reader.fetch(walker.ranges)  # every byte verified before any target changes
        walker.dry = False
        for item in tensors:
            data = walker.region(*block(item), item.storage_index.fqn)
            assert data is not None
            dest = planner.resolve_tensor(item).detach()
            raw_view(dest).copy_(raw_view(data).to(dest.device))
            planner.commit_tensor(item, dest)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(values[item.storage_index.fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StorageWriter.validate_checkpoint_id(checkpoint_id)
