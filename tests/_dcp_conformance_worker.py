"""One rank of a gloo job for the DCP conformance tests (test_checkpoint_dcp_conformance).

usage: python tests/_dcp_conformance_worker.py MODE RANK WORLD PORT ROOT
Prints one JSON line with the outcome. Modes:

- ``chunks``: ShardedTensors whose ranks hold several chunks of one tensor (the
  sharding specs of torch's own DCP tests), saved through trainguard's StorageWriter
  in each spec and loaded through its StorageReader into every other spec, into a
  plain tensor and from a plain tensor; an ``io.BytesIO`` value rides along. Then
  ``overwrite=False`` of a step the store holds, and the pickling of a writer whose
  store runs over a group of its own.
- ``process``: ``async_save`` with the process-based checkpointer (the writer is
  pickled to DCP's checkpoint process), then ``dcp.load`` on every rank.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from checkpoint_store import CheckpointStore
from checkpoint_store.dcp import StorageReader, StorageWriter

ROWS, COLS = 10, 20


def _specs() -> list[Any]:
    """torch's test_file_system_checkpoint_cpu specs: 1, 2 and 3 chunks per rank."""
    def enum(*shards: tuple[int, int, int]) -> EnumerableShardingSpec:
        return EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[o, 0], shard_sizes=[n, COLS], placement=f"rank:{r}/cpu")
            for o, n, r in shards])

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
        ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu",
                                             "rank:0/cpu"]),
        enum((0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)),
        enum((0, 8, 1), (8, 2, 0)),
    ]


def whole(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 3 + step


def sharded(spec: Any, value: torch.Tensor) -> Any:
    """A ShardedTensor of ``spec`` holding ``value`` (each local chunk its slice)."""
    st = sharded_tensor.zeros(spec, ROWS, COLS, init_rrefs=False)
    for shard in st.local_shards():
        (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(value[r:r + n, c:c + m])
    return st


def wrong_chunks(st: Any, value: torch.Tensor) -> list[list[int]]:
    """Offsets of the local chunks of ``st`` whose bits differ from ``value``'s slice."""
    bad = []
    for shard in st.local_shards():
        (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor.view(torch.int32), value[r:r + n, c:c + m].view(torch.int32)):
            bad.append([r, c])
    return bad


def mode_chunks(store: CheckpointStore, rank: int) -> dict[str, Any]:
    specs = _specs()
    out: dict[str, Any] = {"rank": rank, "chunks": [len(sharded(s, whole(0)).local_shards())
                                                    for s in specs], "bad": []}
    step = 0
    for i, save_spec in enumerate(specs):
        step += 1
        blob = io.BytesIO(b"\x00losses of step %d\xff" % step)
        dcp.save({"st": sharded(save_spec, whole(step)), "train": {"blob": blob}},
                 storage_writer=StorageWriter(store, step=step))
        # Into two other specs each (the full matrix costs twice the time, no more cover:
        # every spec is loaded into twice, from specs of 1, 2 and 3 chunks per rank).
        for j in ((i + 1) % len(specs), (i + 2) % len(specs)):
            load_spec = specs[j]
            target = {"st": sharded(load_spec, torch.zeros(ROWS, COLS)),
                      "train": {"blob": io.BytesIO()}}
            dcp.load(target, storage_reader=StorageReader(store))
            if wrong_chunks(target["st"], whole(step)):
                out["bad"].append(f"saved in spec {i}, loaded in spec {j}")
            if target["train"]["blob"].getvalue() != blob.getvalue():
                out["bad"].append(f"BytesIO of step {step}")
        # Freaky Friday: the sharded tensor into a plain one, a plain one into shards.
        plain = {"st": torch.zeros(ROWS, COLS), "train": {"blob": io.BytesIO()}}
        dcp.load(plain, storage_reader=StorageReader(store))
        if not torch.equal(plain["st"], whole(step)):
            out["bad"].append(f"spec {i} into a plain tensor")
        step += 1
        dcp.save({"st": whole(step)}, storage_writer=StorageWriter(store, step=step))
        back = {"st": sharded(save_spec, torch.zeros(ROWS, COLS))}
        dcp.load(back, storage_reader=StorageReader(store))
        if wrong_chunks(back["st"], whole(step)):
            out["bad"].append(f"a plain tensor into spec {i}")
    names = [m.name for m in store.list()]
    try:
        dcp.save({"st": whole(99)}, storage_writer=StorageWriter(store, step=step,
                                                                 overwrite=False))
        out["overwrite"] = "saved"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out["overwrite"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = [m.name for m in store.list()] == names
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    try:
        pickle.dumps(StorageWriter(CheckpointStore(store.url, process_group=group), step=1))
        out["pickled"] = "pickled"
    except Exception as e:
        out["pickled"] = f"{type(e).__name__}: {e}"
    return out


def mode_process(store: CheckpointStore, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)  # the same replicated model on every rank
    model = torch.nn.Linear(8, 6)
    # DTensors, not ShardedTensors: DCP's async stager cannot copy the latter.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"model": model.state_dict(), "step": torch.tensor(7),
             "shard": distribute_tensor(whole(5), mesh, [Shard(0)]),
             "train": {"blob": io.BytesIO(b"abc")}}
    future = dcp.async_save(state, storage_writer=StorageWriter(store, step=7),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    future.result()
    target = {"model": torch.nn.Linear(8, 6).state_dict(), "step": torch.tensor(0),
              "shard": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
              "train": {"blob": io.BytesIO()}}
    reader = StorageReader(store)
    dcp.load(target, storage_reader=reader)
    assert reader.manifest is not None
    same = all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())
    return {"rank": rank, "step": reader.manifest.step, "world": reader.manifest.world_size,
            "same_model": same, "step_value": int(target["step"]),
            "same_shard": torch.equal(target["shard"].full_tensor(), whole(5)),
            "blob": target["train"]["blob"].getvalue().decode()}


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    warnings.simplefilter("ignore")  # ShardedTensor's deprecation, DCP's notes
    # DCP's checkpoint process finds its rendezvous through these.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = CheckpointStore(root, chunk_bytes=256, keep_last=100)
    out = mode_chunks(store, rank) if mode == "chunks" else mode_process(store, rank)
    store.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
