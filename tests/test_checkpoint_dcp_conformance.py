"""trainguard's DCP backend does what torch's own DCP tests ask of a storage backend
(test/distributed/checkpoint: test_file_system_checkpoint_cpu, e2e/test_e2e_save_and_load,
test_format_utils), with checkpoint_store.dcp's StorageWriter and StorageReader in
place of FileSystemWriter/Reader: several chunks of one tensor on a rank, io.BytesIO
values, the process-based async_save, _load_state_dict_from_keys and dcp_to_torch_save
(planner_data), overwrite. CPU, gloo; 2 ranks where ranks matter."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from checkpoint_store import CheckpointStore
from checkpoint_store.dcp import StorageReader, StorageWriter
from tests._ckpt_helpers import run_ranks, same_bits

WORKER = str(Path(__file__).resolve().parent / "_dcp_conformance_worker.py")

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable or uninitialized:UserWarning")


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def _save(store: CheckpointStore, state: dict[str, Any], step: int, **kw: Any) -> None:
    dcp.save(state, storage_writer=StorageWriter(store, step=step, **kw))


def test_several_chunks_of_one_tensor_per_rank_load_back_in_every_layout(tmp_path):
    """torch's ShardedTensor specs where a rank holds 1, 2 or 3 chunks of one tensor:
    each save commits every chunk of every rank, and loads into other specs (on main
    a rank's later chunk replaced its earlier one, and the save was refused), into a
    plain tensor and back from one, bit for bit on both ranks; an io.BytesIO value
    loads as a BytesIO with its bytes. overwrite=False of a step the store holds
    raises "Checkpoint already exists" on every rank and writes nothing; a writer
    whose store runs over a group of its own refuses to pickle, saying why."""
    out = run_ranks(WORKER, "chunks", 2, str(tmp_path / "ckpt"), timeout_s=300)
    assert [o["chunks"] for o in out] == [[1, 2, 3, 1], [1, 2, 2, 1]]  # chunks per rank
    for o in out:
        assert o["bad"] == []
        assert o["overwrite"].startswith("CheckpointException")
        assert "CheckpointExistsError: Checkpoint already exists" in o["overwrite"]
        assert "holds step 8" in o["overwrite"] and "overwrite=True" in o["overwrite"]
        assert o["unchanged"] is True
        assert o["pickled"].startswith("CheckpointError") and "process_group" in o["pickled"]
    store = CheckpointStore(tmp_path / "ckpt")
    manifests = store.list()
    assert [m.step for m in manifests] == list(range(1, 9))
    # Spec 2 (5 chunks: 3 on rank 0, 2 on rank 1) is step 5: every chunk is a block.
    shards = manifests[4].tensors["st"]["shards"]
    assert sorted((s["offsets"][0], s["shape"][0]) for s in shards) == [
        (0, 2), (2, 1), (3, 3), (6, 3), (9, 1)]


@pytest.mark.slow
def test_process_based_async_save_commits_and_loads_on_two_ranks(tmp_path):
    """async_save with AsyncCheckpointerType.PROCESS pickles the writer to DCP's
    checkpoint process (on main: "cannot pickle"): that process opens the store on the
    same root and commits step 7 of both ranks (world size 2); dcp.load on both ranks
    gives the model, a 0-d tensor, a DTensor into another placement and a BytesIO
    back bit for bit."""
    out = run_ranks(WORKER, "process", 2, str(tmp_path / "ckpt"), timeout_s=300)
    for o in out:
        assert (o["step"], o["world"], o["step_value"]) == (7, 2, 7)
        assert o["same_model"] and o["same_shard"] and o["blob"] == "abc"


def test_bytesio_values_round_trip_as_bytesio_without_pickle(tmp_path):
    """A BytesIO in the state (torch's e2e TestTrainState keeps its losses so) is
    saved as its bytes, never pickled, and loads as a BytesIO holding exactly those
    bytes, through DCP and through CheckpointStore.load (on main it was refused)."""
    store = CheckpointStore(tmp_path / "ckpt")
    data = bytes(range(256)) * 3
    _save(store, {"train": {"step": 4, "losses": io.BytesIO(data)}, "w": torch.ones(3)}, 4)
    manifest = store.latest()
    assert manifest is not None and data in manifest.state and b"\x80\x04" not in manifest.state
    target: dict[str, Any] = {"train": {"step": 0, "losses": io.BytesIO()}, "w": torch.zeros(3)}
    dcp.load(target, storage_reader=StorageReader(store))
    assert isinstance(target["train"]["losses"], io.BytesIO)
    assert target["train"]["losses"].getvalue() == data and target["train"]["step"] == 4
    plain: dict[str, Any] = {"train": None}
    store.load(plain, keys=["train"])
    assert plain["train"]["losses"].getvalue() == data


def test_load_state_dict_from_keys_and_dcp_to_torch_save_rebuild_the_nested_state(tmp_path,
                                                                                 monkeypatch):
    """The metadata carries planner_data (each DCP name's key path) and storage_data:
    _load_state_dict_from_keys("model") returns {"model": {...}} with the saved
    tensors bit for bit, "optim.state" the optimizer state without its param_groups
    (on main: a crash on planner_data None); torch's own dcp_to_torch_save, given
    trainguard's reader, writes the nested state (on main: flat keys, silently)."""
    model, optim = _trained(1)
    saved = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 12}
    store = CheckpointStore(tmp_path / "ckpt")
    _save(store, saved, 12)
    got = _load_state_dict_from_keys("model", storage_reader=StorageReader(store))
    assert list(got) == ["model"] and list(got["model"]) == list(saved["model"])
    for k, v in saved["model"].items():
        assert same_bits(got["model"][k], v), k
    state = _load_state_dict_from_keys("optim.state", storage_reader=StorageReader(store))
    assert list(state) == ["optim"] and list(state["optim"]) == ["state"]
    for p, per in optim.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(state["optim"]["state"][str(p)][name], per[name]), (p, name)
    reader = StorageReader(store)
    metadata = reader.read_metadata()
    assert metadata.planner_data["model.0.weight"] == ("model", "0.weight")
    assert metadata.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    assert {i.fqn for i in metadata.storage_data} == set(metadata.state_dict_metadata)

    # format_utils.dcp_to_torch_save opens a FileSystemReader on its path: trainguard's here.
    monkeypatch.setattr(format_utils, "FileSystemReader",
                        lambda path: StorageReader(CheckpointStore(path)))
    format_utils.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=False)
    assert sorted(back) == ["model", "optim", "step"] and back["step"] == 12
    assert all(same_bits(back["model"][k], v) for k, v in saved["model"].items())
    groups = back["optim"]["param_groups"]
    assert groups[0]["lr"] == 0.01 and groups[0]["betas"] == (0.9, 0.999)


def test_a_dcp_save_is_the_checkpoint_checkpoint_store_makes_and_old_flat_ones_load(tmp_path):
    """A DCP save is stored nested along DCP's key paths: CheckpointStore.load of
    {"model": module} reads it in place (on main: no key "model", the save was flat),
    and DCP loads a CheckpointStore.save checkpoint (on main: refused). A checkpoint
    the earlier writer stored flat (one key per DCP name) still loads through DCP and
    CheckpointStore, and _load_state_dict_from_keys selects its names."""
    model, optim = _trained(2)
    store = CheckpointStore(tmp_path / "ckpt")
    _save(store, {"model": model.state_dict(), "optim": optim.state_dict()}, 1)
    fresh = _trained(3)[0]
    loaded: dict[str, Any] = {"model": fresh, "optim": None}
    store.load(loaded)
    assert all(same_bits(a, b) for a, b in zip(fresh.state_dict().values(),
                                               model.state_dict().values()))
    # DCP names dict keys as strings (its key paths): the optimizer's state keys too.
    assert same_bits(loaded["optim"]["state"]["1"]["exp_avg"], optim.state[model[0].bias]["exp_avg"])
    assert loaded["optim"]["param_groups"] == optim.state_dict()["param_groups"]

    store.save({"model": model, "extra": [torch.full((2,), 5.0), "tag"]}, step=2)
    target = {"model": _trained(4)[0].state_dict(), "extra": [torch.zeros(2), ""]}
    dcp.load(target, storage_reader=StorageReader(store, step=2))
    assert same_bits(target["model"]["2.bias"], model.state_dict()["2.bias"])
    assert same_bits(target["extra"][0], torch.full((2,), 5.0)) and target["extra"][1] == "tag"

    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    store.save({**flat, "step": 3}, step=3)  # what the earlier writer committed
    old = {"model": _trained(5)[0].state_dict(), "step": 0}
    dcp.load(old, storage_reader=StorageReader(store, step=3))
    assert old["step"] == 3 and all(same_bits(old["model"][k], v)
                                    for k, v in model.state_dict().items())
    got = _load_state_dict_from_keys("model.0.weight", storage_reader=StorageReader(store))
    assert list(got) == ["model.0.weight"] and same_bits(got["model.0.weight"], model[0].weight)


def test_overwrite_maps_onto_newer_commits_and_false_refuses(tmp_path):
    """overwrite=True (DCP's default) commits a newer checkpoint of a step the store
    holds and loads take it; overwrite=False raises "Checkpoint already exists"
    (CheckpointExistsError inside DCP's CheckpointException), committing nothing and
    leaving no data behind; a step the store lacks saves with overwrite=False."""
    store = CheckpointStore(tmp_path / "ckpt", keep_last=10)
    _save(store, {"w": torch.full((4,), 1.0)}, 5)
    _save(store, {"w": torch.full((4,), 2.0)}, 5, overwrite=True)
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=StorageReader(store, step=5))
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    before = ([m.name for m in store.list()], sorted(p.name for p in (tmp_path / "ckpt" / "data").iterdir()))
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        _save(store, {"w": torch.full((4,), 3.0)}, 5, overwrite=False)
    assert "CheckpointExistsError" in str(info.value) and "overwrite=True" in str(info.value)
    after = ([m.name for m in store.list()], sorted(p.name for p in (tmp_path / "ckpt" / "data").iterdir()))
    assert after == before
    _save(store, {"w": torch.full((4,), 3.0)}, 6, overwrite=False)
    assert [m.step for m in store.list()] == [5, 5, 6]


def test_shards_hold_several_blocks_of_one_tensor_in_one_process(tmp_path):
    """checkpoint_store.Shards (what the DCP writer gives the store for a rank's
    chunks): both blocks are saved as blocks of one tensor, load into other blocks
    bit for bit, and blocks that disagree on the tensor are refused when built."""
    from checkpoint_store import Shard, Shards

    whole = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"t": Shards((Shard(whole[4:].clone(), (6, 4), (4, 0)),
                             Shard(whole[:4].clone(), (6, 4), (0, 0))))}, step=1)
    manifest = store.latest()
    assert manifest is not None
    assert [s["offsets"] for s in manifest.tensors["t"]["shards"]] == [[4, 0], [0, 0]]
    target = Shards((Shard(torch.zeros(6, 1, dtype=torch.float64), (6, 4), (0, 3)),
                     Shard(torch.zeros(3, 2, dtype=torch.float64), (6, 4), (2, 1))))
    store.load({"t": target})
    assert same_bits(target.blocks[0].tensor, whole[:, 3:]) and same_bits(
        target.blocks[1].tensor, whole[2:5, 1:3])
    with pytest.raises(ValueError, match="share global shape and dtype"):
        Shards((Shard(torch.zeros(1, 4), (6, 4), (0, 0)), Shard(torch.zeros(1, 4), (7, 4), (0, 0))))


def test_a_checkpoint_dcp_cannot_address_is_refused_saying_what_to_do(tmp_path):
    """Tensors inside a tuple (CheckpointStore.save keeps tuples; DCP names none of
    their items): a dcp.load that asks for that key is refused, naming the key path
    and CheckpointStore.load, with the targets untouched (on main it handed DCP the
    tensor references as the value); a load of the other keys works."""
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"pair": (torch.ones(2), torch.zeros(2)), "w": torch.ones(1)}, step=1)
    target: dict[str, Any] = {"pair": (torch.zeros(2), torch.zeros(2)), "w": torch.zeros(1)}
    with pytest.raises(CheckpointException, match=r"tuple at 'pair'.*CheckpointStore\.load"):
        dcp.load(target, storage_reader=StorageReader(store))
    assert torch.equal(target["w"], torch.zeros(1))
    only = {"w": torch.zeros(1)}
    dcp.load(only, storage_reader=StorageReader(store))
    assert torch.equal(only["w"], torch.ones(1))
