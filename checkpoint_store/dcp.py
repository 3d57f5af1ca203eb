"""A ``torch.distributed.checkpoint`` (DCP) backend: DCP's planners, trainguard's format.

```python
store = CheckpointStore("s3://bucket/run42")                     # on every rank
dcp.save(state, storage_writer=StorageWriter(store, step=100, extra={...}))
dcp.async_save(state, storage_writer=StorageWriter(store, step=200))
dcp.load(state, storage_reader=StorageReader(store))             # newest checkpoint
```

Saving: DCP's planners decide who writes what (each DTensor/FSDP2 shard by its owner,
each replicated item by one rank); ``write_data`` hands that rank's items to
``CheckpointStore.save`` as ``Shard`` blocks keyed by DCP's flat names (FQNs), so the
save is an ordinary trainguard checkpoint: Zarr arrays with CRC-32C chunks, the
manifest commit (only when every rank wrote), LATEST, retention. ``finish`` has
nothing left to do: the manifest was committed inside ``write_data``.

Non-tensor items (an optimizer's ``param_groups``, a step counter) are given by DCP to
any rank, not only rank 0. They are never pickled: ``write_data`` encodes each with the
checkpoint's msgpack types (FORMAT.md, "State skeleton") and every rank gathers them,
so rank 0's skeleton holds them all. A value msgpack cannot hold (an arbitrary Python
object, or a tensor nested inside a non-tensor value) is refused with
UnsupportedValueError naming it, and nothing is committed.

Loading: ``read_metadata`` builds DCP's ``Metadata`` from the manifest (rank 0 chooses
the checkpoint, every rank uses that one), and ``read_data`` fills each requested
block through the same resharding plan and CRC-verified reads as
``CheckpointStore.load``, every byte of the rank's plan verified before any target
changes. DCP's planner API takes non-tensor items as a ``torch.save`` stream, so the
decoded values are serialized in memory for it; nothing pickled touches storage.
A damaged checkpoint raises (DCP has no fallback); ``CheckpointStore.load`` falls back.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
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

from checkpoint_store.dist import broadcast_json
from checkpoint_store.dtypes import dtype_from_name, raw_view
from checkpoint_store.flatten import TensorRef, decode_skeleton, encode_values, join_path
from checkpoint_store.layout import data_dir
from checkpoint_store.loading import _Walker
from checkpoint_store.manifest import Manifest
from checkpoint_store.reader import ChunkReader
from checkpoint_store.reshard import unique_blocks
from checkpoint_store.shard import Shard
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import CheckpointError, NoCheckpointError

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


class StorageWriter(tdcp.StorageWriter):
    """Writes a DCP save as trainguard checkpoint ``step`` of ``store`` (constructed
    on every rank, like the store). ``extra`` goes into the manifest verbatim."""

    def __init__(self, store: CheckpointStore, *, step: int,
                 extra: Mapping[str, Any] | None = None):
        super().__init__()
        self.store = store
        self.step = step
        self.extra = dict(extra) if extra is not None else None
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        state: dict[str, Any] = {}
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
            state[fqn] = Shard(t.detach(), tuple(item.tensor_data.size), tuple(chunk.offsets))
            results.append(WriteResult(item.index, t.numel() * t.element_size(), None))
        # Wait for a save in flight: its collectives share the store's group.
        self.store._wait_current()
        try:
            mine = b"\0" + msgpack.packb(
                [sorted(state), encode_values(values, what=f"DCP item of rank {self.store.rank}")],
                use_bin_type=True)
        except CheckpointError as e:
            mine = f"{type(e).__name__}: {e}".encode()
        gathered = self.store._comm.all_gather_bytes(mine)
        failed = [(r, g.decode()) for r, g in enumerate(gathered) if g[:1] != b"\0"]
        if failed:
            raise CheckpointError(
                f"DCP save of step {self.step} refused, nothing committed: rank "
                f"{failed[0][0]}: {failed[0][1]}"
            )
        for g in gathered:
            tensor_fqns, packed = msgpack.unpackb(g[1:], raw=False)
            state.update(decode_skeleton(packed))
            # Tensors DCP gave to other ranks: rank 0's skeleton references them too.
            for fqn in tensor_fqns:
                state.setdefault(fqn, TensorRef(join_path("", fqn)))
        self.manifest = self.store.save(state, step=self.step, extra=self.extra).wait()
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


def _dcp_metadata(manifest: Manifest, skeleton: Any) -> Metadata:
    if not isinstance(skeleton, dict) or any(
            isinstance(v, TensorRef) and v.path not in manifest.tensors for v in skeleton.values()):
        raise CheckpointError(f"{manifest.name} is not a checkpoint of flat DCP names")
    nested = [k for k, v in skeleton.items() if isinstance(v, dict | list) and _has_ref(v)]
    if nested:
        raise CheckpointError(
            f"checkpoint {manifest.name} was written by CheckpointStore.save (key "
            f"{nested[0]!r} nests tensors), not through DCP; load it with CheckpointStore.load"
        )
    md: dict[str, Any] = {}
    for key, value in skeleton.items():
        if not isinstance(value, TensorRef):
            md[key] = BytesStorageMetadata()
            continue
        entry = manifest.tensors[value.path]
        md[key] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(entry["dtype"])), torch.Size(entry["shape"]),
            [ChunkStorageMetadata(torch.Size(s["offsets"]), torch.Size(s["shape"]))
             for s in unique_blocks(entry["shards"])],
        )
    return Metadata(state_dict_metadata=md)


def _has_ref(value: Any) -> bool:
    if isinstance(value, TensorRef):
        return True
    if isinstance(value, dict):
        return any(_has_ref(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_ref(v) for v in value)
    return False


class StorageReader(tdcp.StorageReader):
    """Reads the newest checkpoint of ``store`` (or ``step``'s, or DCP's
    ``checkpoint_id`` as a step) into a DCP load, in any layout."""

    def __init__(self, store: CheckpointStore, *, step: int | None = None):
        super().__init__()
        self.store = store
        self.step = step
        self.manifest: Manifest | None = None
        self._skeleton: Any = None

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
        self._skeleton = decode_skeleton(self.manifest.state)
        return _dcp_metadata(self.manifest, self._skeleton)

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
            entry = m.tensors[self._skeleton[item.storage_index.fqn].path]
            start = tuple(a + b for a, b in zip(item.storage_index.offset or (),
                                               item.storage_offsets))
            return entry, start or (0,) * len(item.lengths), tuple(item.lengths)

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
                torch.save(self._skeleton[item.storage_index.fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StorageWriter.validate_checkpoint_id(checkpoint_id)
