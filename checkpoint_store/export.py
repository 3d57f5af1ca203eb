"""Export a committed checkpoint's tensors to other formats (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint_store.flatten import join_path
from checkpoint_store.manifest import Manifest
from checkpoint_store.store import CheckpointStore

__all__ = ["export_safetensors"]


def _top_key(path: str) -> str:
    """The state's top-level key of a tensor path (``~1`` and ``~0`` unescaped)."""
    return path.split("/", 1)[0].replace("~1", "/").replace("~0", "~")


def export_safetensors(store: CheckpointStore, manifest: Manifest, out: Path) -> dict[str, Any]:
    """Load every tensor of the checkpoint ``manifest`` names (verified) from ``store``
    and write them to ``out`` (safetensors), each named by its key path in the state
    (``model/mlp.1.weight``). Needs the ``safetensors`` package."""
    from safetensors.torch import save_file

    keys = sorted({_top_key(p) for p in manifest.tensors})
    state: dict[str, Any] = {}
    store.load(state, step=manifest.step, keys=keys)
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().contiguous().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, join_path(path, k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, join_path(path, i))

    for k in keys:
        walk(state[k], join_path("", k))
    missing = set(manifest.tensors) - set(tensors)
    if missing:
        raise ValueError(f"tensors {sorted(missing)} of the manifest were not loaded")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"trainguard.step": str(manifest.step),
                                          "trainguard.uid": manifest.uid})
    tmp.replace(out)
    return {"step": manifest.step, "path": str(out), "tensors": len(tensors),
            "bytes": out.stat().st_size}
