"""DCP's flat names <-> the nested state a trainguard checkpoint stores.

DCP's default planners flatten the state (``flatten_state_dict``): each leaf gets a
dotted name (``"model.0.weight"``), and the plan's ``planner_data`` maps every name to
its path of keys (``("model", "0.weight")``). The DCP writer stores the state nested
along those paths, so a DCP save is the very checkpoint ``CheckpointStore.save`` makes
of the same state: ``CheckpointStore.load`` and ``trainguard ckpt export --key model``
read it. The reader walks a stored state with DCP's own traversal rules to give DCP
its names back, and ``planner_data`` for the planners that rebuild a state from the
metadata alone (``_load_state_dict_from_keys``, ``format_utils.dcp_to_torch_save``).
Checkpoints that earlier versions wrote flat (one top-level key per DCP name) read as
before: each name is its own path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint_store.dtypes import dtype_from_name
from checkpoint_store.flatten import TensorRef, join_path
from checkpoint_store.manifest import Manifest
from checkpoint_store.reshard import unique_blocks
from checkpoint_store.shard import Shard, Shards
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError

__all__ = [
    "KeyPath", "dcp_metadata", "dcp_names", "key_paths", "nest", "plain_value", "tensor_path",
]

KeyPath = tuple[str | int, ...]


def _name(path: KeyPath) -> str:
    # How flatten_state_dict names a leaf (torch.distributed.checkpoint._nested_dict).
    return ".".join(map(str, path))


def key_paths(planner_data: Any, fqns: Iterable[str]) -> dict[str, KeyPath]:
    """Each name's path of keys: ``planner_data``'s where it names that very leaf
    (DCP's default planners), else the name itself (a planner that does not flatten,
    or one whose data means something else): such names are stored flat."""
    data = planner_data if isinstance(planner_data, Mapping) else {}
    out: dict[str, KeyPath] = {}
    for fqn in fqns:
        p = data.get(fqn)
        ok = isinstance(p, tuple | list) and len(p) > 0 and all(
            isinstance(k, str | int) and not isinstance(k, bool) for k in p)
        out[fqn] = tuple(p) if ok and _name(tuple(p)) == fqn else (fqn,)  # type: ignore[arg-type]
    return out


def tensor_path(path: KeyPath) -> str:
    """The manifest key path of the tensor at ``path`` (as ``flatten`` names it)."""
    out = ""
    for k in path:
        out = join_path(out, k)
    return out


def nest(values: Mapping[str, Any], paths: Mapping[str, KeyPath]) -> dict[str, Any]:
    """The state whose leaves are ``values`` (by DCP name) at their ``paths``, in the
    order of ``paths``. Refused when a load could not find every name again."""
    state: dict[str, Any] = {}
    for fqn, path in paths.items():
        if fqn in values:
            set_element(state, path, values[fqn])
    found = set(_names_of(state))
    if found != set(values):
        odd = sorted(found ^ set(values))[:3]
        raise CheckpointError(
            f"the DCP names {odd} cannot be stored so that a load finds them again (their "
            "key paths collide); give the state distinct keys"
        )
    return state


# What stands for a tensor in a state being stored (Shard, Shards, another rank's
# TensorRef) or read (TensorRef): DCP traverses lists holding any of them.
_TENSORS = (torch.Tensor, TensorRef, Shard, Shards)


def _names_of(state: Mapping[str, Any]) -> dict[str, tuple[KeyPath, Any]]:
    out: dict[str, tuple[KeyPath, Any]] = {}

    def visit(path: KeyPath, value: Any) -> None:
        name = _name(path)
        if name in out:
            raise CheckpointError(
                f"two values of the checkpoint have the DCP name {name!r} (key paths "
                f"{out[name][0]} and {path}); load it with CheckpointStore.load"
            )
        out[name] = (path, value)

    # DCP's own rules: dicts always, lists only where they hold tensors or dicts.
    traverse_state_dict(state, visit,  # type: ignore[arg-type]
                        keep_traversing=lambda v: isinstance(v, _TENSORS))
    return out


def _holds_ref(value: Any) -> bool:
    if isinstance(value, TensorRef):
        return True
    if isinstance(value, dict):
        return any(_holds_ref(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_ref(v) for v in value)
    return False


def dcp_names(manifest: Manifest, skeleton: Any) -> dict[str, tuple[KeyPath, Any]]:
    """DCP name -> (key path, stored value: a TensorRef or a plain value)."""
    if not isinstance(skeleton, dict):
        raise CorruptCheckpointError(f"the state of {manifest.name} is not a mapping")
    names = _names_of(skeleton)
    for value in (v for _, v in names.values() if isinstance(v, TensorRef)):
        if value.path not in manifest.tensors:
            raise CorruptCheckpointError(
                f"manifest {manifest.name} references tensor {value.path!r} but has no "
                "index entry")
    return names


def plain_value(manifest: Manifest, names: Mapping[str, tuple[KeyPath, Any]], name: str) -> Any:
    """The stored value of a bytes item: refused where tensors sit inside it (a tuple
    of tensors that CheckpointStore.save kept; DCP names none of its items)."""
    path, value = names[name]
    if _holds_ref(value):
        raise CheckpointError(
            f"checkpoint {manifest.name} holds tensors inside the tuple at "
            f"{tensor_path(path)!r}, which DCP cannot address; load that key with "
            "CheckpointStore.load"
        )
    return value


def dcp_metadata(manifest: Manifest, names: Mapping[str, tuple[KeyPath, Any]]) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint: every name's chunks (or a bytes item),
    ``planner_data`` (name -> key path, as DCP's planners record it) and
    ``storage_data`` (chunk or item -> its key path in the manifest)."""
    md: dict[str, Any] = {}
    storage: dict[MetadataIndex, str] = {}
    for name, (path, value) in names.items():
        if not isinstance(value, TensorRef):
            md[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = tensor_path(path)
            continue
        entry = manifest.tensors[value.path]
        chunks = [ChunkStorageMetadata(torch.Size(s["offsets"]), torch.Size(s["shape"]))
                  for s in unique_blocks(entry["shards"])]
        md[name] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(entry["dtype"])), torch.Size(entry["shape"]),
            chunks)
        for c in chunks:
            storage[MetadataIndex(name, c.offsets)] = value.path
    return Metadata(state_dict_metadata=md,
                    planner_data={name: path for name, (path, _) in names.items()},
                    storage_data=storage)
