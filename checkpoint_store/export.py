"""Export a committed checkpoint's tensors to other formats (safetensors).

Without ``key`` every tensor is written, named by its key path in the state
(``model/mlp.1.weight``). A training state is usually ``{"model": ..., "optim": ...,
...}``, while Hugging Face's ``from_pretrained`` wants the model's own names
(``transformer.h.0.attn.c_attn.weight``): ``key="model"`` writes the tensors of that
subtree only, named by their path below it, and ``strip_prefix`` removes a prefix
from those names (``"module."`` of DDP, ``"_orig_mod."`` of ``torch.compile``). The
file's metadata says ``"format": "pt"``, which transformers requires of a PyTorch
safetensors file (4.x refuses a file without it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from checkpoint_store.flatten import join_path
from checkpoint_store.manifest import Manifest
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import ExportError, ExportExistsError

__all__ = ["export_safetensors"]


def _top_key(path: str) -> str:
    """The state's top-level key of a tensor path (``~1`` and ``~0`` unescaped)."""
    return path.split("/", 1)[0].replace("~1", "/").replace("~0", "~")


def _names(manifest: Manifest, key: str | None, strip_prefix: str | None) -> dict[str, str]:
    """Tensor path in the manifest -> its name in the file."""
    paths = sorted(manifest.tensors)
    if key is not None:
        root = join_path("", key)
        under = {p: p[len(root) + 1:] for p in paths if p.startswith(root + "/")}
        if not under:
            tops = sorted({_top_key(p) for p in paths if "/" in p})
            raise ExportError(
                f"checkpoint {manifest.name} has no tensors under key {key!r}; keys holding "
                f"tensors below them: {tops}; pass one of them as the key, or none to "
                "export every tensor by its key path"
            )
        names = under
    else:
        names = {p: p for p in paths}
    if strip_prefix:
        if not any(n.startswith(strip_prefix) for n in names.values()):
            raise ExportError(
                f"no tensor name starts with {strip_prefix!r} (names such as "
                f"{sorted(names.values())[:3]}); check the prefix"
            )
        names = {p: n[len(strip_prefix):] if n.startswith(strip_prefix) else n
                 for p, n in names.items()}
    seen: dict[str, str] = {}
    for p, n in names.items():
        if not n or n in seen:
            raise ExportError(
                f"tensors {seen.get(n)!r} and {p!r} would both be named {n!r} in the "
                "export; choose another key or prefix"
            )
        seen[n] = p
    return names


def export_safetensors(store: CheckpointStore, manifest: Manifest, out: Path, *,
                       key: str | None = None, strip_prefix: str | None = None,
                       force: bool = False) -> dict[str, Any]:
    """Load the tensors of the checkpoint ``manifest`` names (verified) from ``store``
    and write them to ``out`` (safetensors): all of them by key path, or those under
    top-level ``key`` by their path below it; ``strip_prefix`` then leaves a prefix
    off the names that have it. An existing ``out`` is refused unless ``force``.
    Returns what was written. Needs the ``safetensors`` package."""
    from safetensors.torch import save_file

    names = _names(manifest, key, strip_prefix)
    if out.exists() and not force:
        raise ExportExistsError(
            f"{out} already exists; pass --force (force=True) to replace it, or choose "
            "another output"
        )
    keys = [key] if key is not None else sorted({_top_key(p) for p in manifest.tensors})
    state: dict[str, Any] = {}
    store.load(state, step=manifest.step, keys=keys)
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if path in names:
                tensors[names[path]] = value.detach().contiguous().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, join_path(path, k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, join_path(path, i))

    for k in keys:
        walk(state[k], join_path("", k))
    missing = set(names.values()) - set(tensors)
    if missing:
        raise ExportError(f"tensors {sorted(missing)} of the manifest were not loaded")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    metadata = {"format": "pt", "trainguard.step": str(manifest.step),
                "trainguard.uid": manifest.uid}
    if key is not None:
        metadata["trainguard.key"] = key
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"step": manifest.step, "path": str(out), "tensors": len(tensors),
            "bytes": out.stat().st_size, "key": key, "strip_prefix": strip_prefix,
            "format": "pt", "names": sorted(tensors)}
