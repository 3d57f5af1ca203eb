"""One rank of a gloo job for the DTensor / FSDP2 checkpoint tests.

usage: python tests/_ckpt_fsdp_worker.py MODE RANK WORLD PORT ROOT [ARGS...]
Prints one JSON line with the outcome. Modes:

- ``train``: FSDP2 (``fully_shard``) MLP + AdamW. Trains steps 1-2, saves step 2 and
  dumps its full state to ``ROOT.ref2.pt``, trains steps 3-4 and dumps the final
  parameters to ``ROOT.final.pt`` (the uninterrupted run), then saves step 4 while rank
  ``ARGS[0]`` is killed (SIGKILL) mid-data.
- ``resume``: loads the newest checkpoint into a fresh FSDP2 model of this world size,
  compares its full state with ``ROOT.ref2.pt`` bit for bit; with ``ARGS[0] == "train"``
  trains steps 3-4 and compares with ``ROOT.final.pt``.
- ``dtensor``: ``distribute_tensor`` with Shard/Replicate on a 1-D mesh (2-D when the
  world is 4), uneven and empty local shards; saves, checks that replicated tensors
  were written once, loads into other placements.
- ``inplace``: the ``dtensor`` tensors saved at steps 3 and 4 (layout "a"), then
  default loads that read local shards in place: the same layout, other placements,
  and with a chunk of step 4 (then its zarr.json) of another rank's block damaged by
  rank 0: the fallback
  must give step 3 whole, a strict load must raise and change nothing. Rank 0
  restores the damaged files before leaving.
- ``fail_save``: rank 1 saves a state with an unsupported value; every rank must get
  the error. Then rank 1 loads into a mismatched state; every rank must get a refusal.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from checkpoint_store import CheckpointStore
from checkpoint_store import Shard as CkptShard
from checkpoint_store._faults import CRASH_ENV
from checkpoint_store.dcp import StorageReader, StorageWriter
from tests._ckpt_helpers import claimed_in_place

BATCH = 8
DEVICE = os.environ.get("CKPT_DEVICE", "cpu")  # "cuda": one rank per GPU, NCCL for CUDA


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 37 and 5 output rows: uneven FSDP2 shards, and an empty one on 4 ranks.
    return torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def fsdp_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model().to(DEVICE)
    mesh = init_device_mesh(DEVICE, (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
               world: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 16, generator=g).to(DEVICE)
    y = torch.randn(BATCH, 5, generator=g).to(DEVICE)
    per = BATCH // world
    mine = slice(rank * per, (rank + 1) * per)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, DTensors gathered (collective: all ranks call)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            out.update(full_state(state[k], f"{prefix}/{k}"))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(full_state(v, f"{prefix}/{i}"))
    elif isinstance(state, DTensor):
        out[prefix] = state.full_tensor().detach().to("cpu", copy=True)
    elif isinstance(state, torch.Tensor):
        out[prefix] = state.detach().to("cpu", copy=True)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in bits (or exist on one side only)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.view(-1).view(torch.uint8) if x.numel() else x,
                y.view(-1).view(torch.uint8) if y.numel() else y):
            bad.append(k)
    return bad


API = os.environ.get("CKPT_API", "store")  # "store", "dcp" or "dcp_async"


def save(store: CheckpointStore, state: dict[str, Any], step: int) -> None:
    """Through the store, or through DCP's save/async_save with trainguard's writer."""
    if API == "store":
        store.save(state, step=step)
    elif API == "dcp":
        dcp.save(state, storage_writer=StorageWriter(store, step=step))
    else:
        dcp.async_save(state, storage_writer=StorageWriter(store, step=step)).result()


def load(store: CheckpointStore, state: dict[str, Any]) -> int:
    if API == "store":
        manifest = store.load(state, strict=True)
        assert manifest is not None
        return manifest.step
    reader = StorageReader(store)
    dcp.load(state, storage_reader=reader)
    assert reader.manifest is not None
    return reader.manifest.step


def mode_train(store: CheckpointStore, rank: int, world: int, root: str, crash_rank: int
               ) -> dict[str, Any]:
    model, opt = fsdp_model(world)
    for step in (1, 2):
        train_step(model, opt, step, rank, world)
    msd, osd = get_state_dict(model, opt)
    save(store, {"model": msd, "optim": osd, "step": 2}, 2)
    ref = full_state({"model": msd, "optim": osd})
    for step in (3, 4):
        train_step(model, opt, step, rank, world)
    final = full_state({"model": get_state_dict(model, opt)[0]})
    if rank == 0:
        torch.save(ref, f"{root}.ref2.pt")
        torch.save(final, f"{root}.final.pt")
    dist.barrier()
    if rank == crash_rank:
        os.environ[CRASH_ENV] = "mid-data"
    msd, osd = get_state_dict(model, opt)
    try:
        save(store, {"model": msd, "optim": osd, "step": 4}, 4)
        return {"rank": rank, "saved4": True}
    except Exception as e:
        # The peer died mid-save: report and leave without the collectives of a clean
        # shutdown, which would wait for the dead rank.
        print(json.dumps({"rank": rank, "saved4": False, "error": f"{type(e).__name__}"}),
              flush=True)
        os._exit(0)


def mode_export(store: CheckpointStore, root: str) -> dict[str, Any]:
    """One process, no torch.distributed: plain tensors of the whole state (export),
    through the store into empty containers, or through DCP into a plain model's
    state dicts."""
    model = build_model()
    if API == "store":
        state: dict[str, Any] = {"model": model.state_dict(), "optim": {}, "step": 0}
    else:
        msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = {"model": msd, "optim": osd, "step": 0}
    step = load(store, state)
    latest = store.latest()
    assert latest is not None
    return {"rank": 0, "step": step, "loaded_step": state["step"],
            "saved_world": latest.world_size,
            "diff": same(full_state({"model": state["model"], "optim": state["optim"]}),
                         torch.load(f"{root}.ref2.pt"))}


def mode_resume(store: CheckpointStore, rank: int, world: int, root: str, then: str
                ) -> dict[str, Any]:
    if not dist.is_initialized():
        return mode_export(store, root)
    model, opt = fsdp_model(world)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    step = load(store, state)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    ref = torch.load(f"{root}.ref2.pt")
    latest = store.latest()
    assert latest is not None
    out: dict[str, Any] = {"rank": rank, "step": step, "loaded_step": state["step"],
                           "saved_world": latest.world_size,
                           "diff": same(full_state({"model": msd, "optim": osd}), ref)}
    if then == "train":
        for step in (3, 4):
            train_step(model, opt, step, rank, world)
        final = full_state({"model": get_state_dict(model, opt)[0]})
        out["final_diff"] = same(final, torch.load(f"{root}.final.pt"))
    return out


def dtensor_state(world: int, step: int, layout: str) -> dict[str, Any]:
    """``layout`` "a" (as saved) or "b" (other placements) of the same global tensors."""
    mesh = init_device_mesh(DEVICE, (2, 2) if world == 4 else (world,))
    rows = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7) + step
    big = torch.arange(37 * 3, dtype=torch.int64).reshape(37, 3) * step
    one = torch.arange(world - 1, dtype=torch.bfloat16) + step  # an empty shard on a rank
    if mesh.ndim == 2:
        a = {"rows": [Shard(0), Shard(1)], "big": [Shard(0), Replicate()],
             "rep": [Replicate(), Replicate()], "one": [Shard(0), Replicate()]}
        b = {"rows": [Replicate(), Shard(0)], "big": [Shard(1), Shard(0)],
             "rep": [Shard(0), Replicate()], "one": [Replicate(), Shard(0)]}
    else:
        a = {"rows": [Shard(0)], "big": [Shard(0)], "rep": [Replicate()], "one": [Shard(0)]}
        b = {"rows": [Shard(1)], "big": [Replicate()], "rep": [Shard(0)], "one": [Replicate()]}
    placements = a if layout == "a" else b
    glob = {"rows": rows, "big": big, "rep": torch.full((4, 3), float(step)), "one": one}
    return {k: distribute_tensor(glob[k], mesh, placements[k]) for k in glob}


def mode_dtensor(store: CheckpointStore, rank: int, world: int) -> dict[str, Any]:
    saved = dtensor_state(world, 3, "a")
    # Non-blocking: the local shards go through the staging buffer.
    manifest = store.save({"d": saved, "plain": torch.ones(2, device=DEVICE),
                           "none": torch.zeros(0, 3)}, step=3, blocking=False).wait()
    writers = {k: sorted({s["array"].split("/")[0] for s in e["shards"] if s["nbytes"]})
               for k, e in manifest.tensors.items()}
    nbytes = {k: sum(s["nbytes"] for s in e["shards"]) for k, e in manifest.tensors.items()}
    target = {"d": dtensor_state(world, 0, "b"), "plain": torch.zeros(2, device=DEVICE),
              "none": torch.ones(0, 3)}
    store.load(target, strict=True)
    diff = same(full_state(target), full_state(
        {"d": saved, "plain": torch.ones(2, device=DEVICE), "none": torch.zeros(0, 3)}))
    return {"rank": rank, "writers": writers, "nbytes": nbytes, "diff": diff,
            "layouts": {k: e.get("layout") for k, e in manifest.tensors.items()}}


def _damage(root: str, store: CheckpointStore, key: str, what: str) -> bytes:
    """Rank 0 damages the newest checkpoint's last chunk (or zarr.json) of the array
    holding ``key``'s last block (another rank's); returns the path and the original
    bytes."""
    from pathlib import Path

    m = store.list()[-1]
    array = m.tensors[key]["shards"][-1]["array"]
    folder = Path(root) / "data" / m.uid / array
    if what == "chunk":
        path = max((p for p in folder.iterdir() if p.name[0].isdigit()),
                   key=lambda p: int(p.name.split(".")[0]))
    else:
        path = folder / "zarr.json"
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path.as_posix().encode() + b"\0" + original


def mode_inplace(store: CheckpointStore, rank: int, world: int, root: str) -> dict[str, Any]:
    saved = {3: dtensor_state(world, 3, "a"), 4: dtensor_state(world, 4, "a")}
    for step in (3, 4):
        store.save({"d": saved[step]}, step=step)
    out: dict[str, Any] = {"rank": rank, "claimed": {}, "diff": {}}
    for layout in ("a", "b"):
        target = {"d": dtensor_state(world, 0, layout)}
        out["claimed"][layout] = sorted(claimed_in_place(store, target))
        manifest = store.load(target)
        assert manifest is not None
        out["diff"][layout] = [manifest.step, same(full_state(target),
                                                   full_state({"d": saved[4]}))]
    for what in ("chunk", "zarr.json"):
        original = _damage(root, store, "d/big", what) if rank == 0 else b""
        dist.barrier()
        target = {"d": dtensor_state(world, 0, "a")}
        manifest = store.load(target)
        assert manifest is not None
        fallback = [manifest.step, same(full_state(target), full_state({"d": saved[3]}))]
        target = {"d": dtensor_state(world, 0, "a")}
        try:
            store.load(target, strict=True)
            strict = "loaded"
        except Exception as e:
            strict = type(e).__name__
        untouched = same(full_state(target), full_state({"d": dtensor_state(world, 0, "a")}))
        out[what] = {"fallback": fallback, "strict": strict, "untouched": untouched}
        dist.barrier()
        if rank == 0:
            path, _, data = original.partition(b"\0")
            with open(path.decode(), "wb") as f:
                f.write(data)
        dist.barrier()
    return out


def mode_blocks(store: CheckpointStore, rank: int) -> dict[str, Any]:
    """A (5, 7) tensor saved as rows 0-3 (rank 0) and 3-5 (rank 1), and a (4, 3) block
    both ranks hold whole (replicated, saved as the same Shard)."""
    rows = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    lo, hi = (0, 3) if rank == 0 else (3, 5)
    state = {"g": CkptShard(rows[lo:hi].clone(), (5, 7), (lo, 0)),
             "rep": CkptShard(torch.ones(4, 3), (4, 3), (0, 0))}
    out: dict[str, Any] = {"rank": rank, "name": store.save(state, step=1).wait().name}
    lo, hi = (0, 3) if rank == 0 else (2, 5)  # row 2 twice, with different bounds
    try:
        store.save({"g": CkptShard(rows[lo:hi].clone(), (5, 7), (lo, 0))}, step=2)
        out["overlap"] = "saved"
    except Exception as e:
        out["overlap"] = f"{type(e).__name__}: {e}"
    return out


def mode_fail_save(store: CheckpointStore, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank}
    state: dict[str, Any] = {"w": torch.ones(3), "step": 1}
    store.save(state, step=1)
    if rank == 1:
        state["bad"] = object()  # not storable: this rank fails before writing anything
    try:
        store.save(state, step=2)
        out["save"] = "ok"
    except Exception as e:
        out["save"] = f"{type(e).__name__}: {e}"
    target: dict[str, Any] = {"w": torch.zeros(3 if rank != 1 else 4), "step": 0}
    try:
        store.load(target)
        out["load"] = "ok"
    except Exception as e:
        out["load"] = f"{type(e).__name__}: {e}"
    out["steps"] = [m.step for m in store.list()]
    return out


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    args = sys.argv[6:]
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        torch.use_deterministic_algorithms(True, warn_only=True)  # bit-exact resumes
    if world > 1 or DEVICE == "cuda":
        backend = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    store = CheckpointStore(root, chunk_bytes=256)
    if mode == "train":
        out = mode_train(store, rank, world, root, int(args[0]))
    elif mode == "resume":
        out = mode_resume(store, rank, world, root, args[0] if args else "")
    elif mode == "dtensor":
        out = mode_dtensor(store, rank, world)
    elif mode == "inplace":
        out = mode_inplace(store, rank, world, root)
    elif mode == "blocks":
        out = mode_blocks(store, rank)
    else:
        out = mode_fail_save(store, rank, world)
    store.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
