"""Apply a checkpoint to the caller's state, in place.

Two passes over the same walk: a dry pass collects every byte range the state needs
(only the blocks a ``Shard`` target overlaps, so resharded loads read their part),
the reader fetches and verifies them all, then the real pass copies. A damaged
checkpoint is therefore detected before anything in the caller's state changes.
Given a :class:`~checkpoint_store.direct.DirectLoad`, the dry pass hands it the tensor
targets and blocks (``Shard``, DTensor local shards) it can read in place instead; those are the caller's to run, and they
are exempt from that guarantee (see ``CheckpointStore.load``).

Rules: a tensor target is ``copy_``'d into (same shape and dtype, else
StateMismatchError); a ``Shard`` target (each block of a ``Shards``), or a DTensor's
local shard, receives its block, assembled from whatever blocks were saved (``reshard.plan_region``); an object with ``load_state_dict`` gets the saved state merged into
its current ``state_dict()``; a dict or list target is updated item by item; anything
else is replaced by the saved value.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from checkpoint_store.direct import DirectLoad
from checkpoint_store.dtensor import is_dtensor, local_block
from checkpoint_store.dtypes import dtype_from_name, dtype_name, raw_view
from checkpoint_store.flatten import TensorRef, is_stateful, join_path
from checkpoint_store.reader import ChunkReader
from checkpoint_store.reshard import plan_region
from checkpoint_store.shard import Shard, Shards
from trainguard.core.checkpoints import CorruptCheckpointError, StateMismatchError

__all__ = ["Applier"]

_MISSING: Any = object()


def _empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        # complex32 warns that its support is experimental; it is only stored here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(shape, dtype=dtype)


def _to_tensor(data: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if len(data) == 0:
        return _empty(shape, dtype)
    with warnings.catch_warnings():
        # Verified chunk bytes are read-only; these views are only copied from.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    if flat.data_ptr() % 64:
        # Kernels of wide dtypes (complex128) assume aligned data; re-home the bytes.
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


class _Walker:
    def __init__(self, manifest_name: str, tensors: Mapping[str, Any], reader: ChunkReader,
                 direct: DirectLoad | None = None):
        self.name = manifest_name
        self.tensors = tensors
        self.reader = reader
        # Tensors read in place by ``direct``, by key path: neither fetched nor copied here.
        self.direct = direct
        self.claimed: dict[str, torch.Tensor] = {}
        self.dry = True
        self.ranges: list[tuple[str, int, int]] = []
        self.skeleton: dict[Any, Any] = {}
        self.selected: list[str] = []

    def _entry(self, ref: TensorRef, offsets: tuple[int, ...] | None = None,
               shape: tuple[int, ...] | None = None) -> dict[str, Any]:
        """``ref``'s index entry; with a block (``offsets``, ``shape``), one whose
        saved blocks cover it when the index can read on (``rank_content.RankReads``:
        a load reads only the rank objects that hold its blocks)."""
        covering = getattr(self.tensors, "covering", None)
        entry = self.tensors.get(ref.path) if covering is None or offsets is None \
            else covering(ref.path, offsets, shape)
        if entry is None:
            raise CorruptCheckpointError(
                f"manifest {self.name} references tensor {ref.path!r} but has no index entry"
            )
        return entry

    def region(self, entry: Mapping[str, Any], offsets: tuple[int, ...],
               shape: tuple[int, ...], path: str) -> torch.Tensor | None:
        """The block ``[offsets, offsets + shape)`` of a saved tensor (the dry pass
        only records the byte ranges it needs)."""
        dtype = dtype_from_name(entry["dtype"])
        pieces = plan_region(entry["shards"], offsets, shape,
                             where=f"tensor {path!r} in {self.name}")
        if self.dry:
            self.ranges.extend((p.array, p.offset, p.nbytes) for p in pieces)
            return None
        out: torch.Tensor | None = None
        for p in pieces:
            src = _to_tensor(self.reader.read(p.array, p.offset, p.nbytes), dtype, list(p.shape))
            if p.offsets == offsets and p.shape == shape:
                return src
            if out is None:
                out = _empty(shape, dtype)
            lo = [max(a, b) for a, b in zip(offsets, p.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, p.offsets, p.shape)]
            src_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offsets))
            dst_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            raw_view(out)[dst_idx].copy_(raw_view(src)[src_idx])
        return out if out is not None else _empty(shape, dtype)

    def _check(self, path: str, entry: Mapping[str, Any], t: torch.Tensor,
               shape: tuple[int, ...]) -> None:
        if dtype_name(t.dtype) != entry["dtype"] or tuple(t.shape) != shape:
            raise StateMismatchError(
                f"tensor {path!r}: the state has {dtype_name(t.dtype)} {tuple(t.shape)}, the "
                f"checkpoint {self.name} has {entry['dtype']} {shape}; build the model with "
                "the saved shapes before loading"
            )

    def _fill(self, dest: torch.Tensor, entry: Mapping[str, Any], offsets: tuple[int, ...],
              path: str) -> None:
        """Load the block at ``offsets`` into ``dest``: claimed by the direct path in the
        dry pass when it qualifies, else fetched (dry pass) and copied (real pass)."""
        if self.dry and self.direct is not None and self.direct.claim(
                dest, entry, offsets, where=f"tensor {path!r} in {self.name}"):
            self.claimed[path] = dest
        if path in self.claimed:
            return
        data = self.region(entry, offsets, tuple(dest.shape), path)
        if data is not None:
            with torch.no_grad():
                raw_view(dest).copy_(raw_view(data))

    def load_tensor(self, target: Any, ref: TensorRef, path: str) -> Any:
        entry = self._entry(ref)
        global_shape = tuple(entry["shape"])
        if is_dtensor(target):
            block = local_block(target, path)
            if block.global_shape != global_shape:
                raise StateMismatchError(
                    f"DTensor at {path!r} has global shape {block.global_shape}, checkpoint "
                    f"{self.name} has {global_shape}"
                )
            self._check(path, entry, block.tensor, tuple(block.tensor.shape))
            entry = self._entry(ref, block.offsets, tuple(block.tensor.shape))
            self._fill(block.tensor, entry, block.offsets, path)
            return target
        if isinstance(target, Shards):
            if target.blocks[0].global_shape != global_shape:
                raise StateMismatchError(
                    f"Shards at {path!r} have global shape {target.blocks[0].global_shape}, "
                    f"checkpoint {self.name} has {global_shape}"
                )
            # Several blocks of one path: through the staged reads (the in-place path
            # claims one target per key path).
            for one in target.blocks:
                self._check(path, entry, one.tensor, tuple(one.tensor.shape))
                entry = self._entry(ref, one.offsets, tuple(one.tensor.shape))
                data = self.region(entry, one.offsets, tuple(one.tensor.shape), path)
                if data is not None:
                    with torch.no_grad():
                        raw_view(one.tensor).copy_(raw_view(data))
            return target
        if isinstance(target, Shard):
            if target.global_shape != global_shape:
                raise StateMismatchError(
                    f"Shard at {path!r} has global shape {target.global_shape}, checkpoint "
                    f"{self.name} has {global_shape}"
                )
            self._check(path, entry, target.tensor, tuple(target.tensor.shape))
            entry = self._entry(ref, target.offsets, tuple(target.tensor.shape))
            self._fill(target.tensor, entry, target.offsets, path)
            return target
        # A whole tensor: every block of it, found before any buffer of its size exists.
        entry = self._entry(ref, (0,) * len(global_shape), global_shape)
        if isinstance(target, torch.Tensor):
            self._check(path, entry, target, global_shape)
            self._fill(target, entry, (0,) * len(global_shape), path)
            return target
        if self.dry and self.direct is not None:
            # No tensor to load into (e.g. a fresh optimizer's state): read into a new one.
            fresh = _empty(global_shape, dtype_from_name(entry["dtype"]))
            if self.direct.claim(fresh, entry, where=f"tensor {path!r} in {self.name}"):
                self.claimed[path] = fresh
        if path in self.claimed:
            return self.claimed[path]
        data = self.region(entry, (0,) * len(global_shape), global_shape, path)
        # Clone through the raw view: some dtypes (bits, sub-byte ints) have no kernels.
        return None if data is None else raw_view(data).clone().view(data.dtype)

    def load(self, target: Any, saved: Any, path: str) -> Any:
        if isinstance(saved, TensorRef):
            return self.load_tensor(target, saved, path)
        if isinstance(saved, dict):
            if is_stateful(target):
                return self._load_stateful(target, saved, path)
            if isinstance(target, MutableMapping):
                for k, v in saved.items():
                    new = self.load(target.get(k, _MISSING), v, join_path(path, k))
                    if not self.dry:
                        target[k] = new
                return target
            return {k: self.load(_MISSING, v, join_path(path, k)) for k, v in saved.items()}
        if isinstance(saved, list):
            if isinstance(target, list) and len(target) == len(saved):
                for i, v in enumerate(saved):
                    new = self.load(target[i], v, join_path(path, i))
                    if not self.dry:
                        target[i] = new
                return target
            return [self.load(_MISSING, v, join_path(path, i)) for i, v in enumerate(saved)]
        if isinstance(saved, tuple):
            same = isinstance(target, tuple) and len(target) == len(saved)
            items = target if same else (_MISSING,) * len(saved)
            return tuple(self.load(t, s, join_path(path, i)) for i, (t, s) in
                         enumerate(zip(items, saved)))
        return saved

    def _load_stateful(self, target: Any, saved: dict[Any, Any], path: str) -> Any:
        current = target.state_dict()
        if isinstance(target, torch.nn.Module):
            missing = sorted(str(k) for k in current.keys() - saved.keys())
            unexpected = sorted(str(k) for k in saved.keys() - current.keys())
            if missing or unexpected:
                raise StateMismatchError(
                    f"{type(target).__name__} at {path!r} does not match checkpoint "
                    f"{self.name}: missing keys {missing}, unexpected keys {unexpected}"
                )
        merged = dict(current)
        self.load(merged, saved, path)
        in_place = isinstance(target, torch.nn.Module) and all(
            isinstance(v, torch.Tensor) and v is current.get(k, _MISSING)
            for k, v in merged.items()
        )
        if not self.dry and not in_place:
            # A module whose state_dict is all tensors shares storage with them, so the
            # copies above already loaded it; anything else goes through its own
            # load_state_dict (optimizers cast and re-key their state there).
            target.load_state_dict(merged)
        return target


class Applier(_Walker):
    """``prepare`` checks the state against the checkpoint and fetches (verifies) every
    byte it needs without changing anything; ``apply`` then copies."""

    def prepare(self, state: Any, skeleton: Any, keys: list[str] | None) -> None:
        if not isinstance(skeleton, dict):
            raise CorruptCheckpointError(f"the state of {self.name} is not a mapping")
        selected = list(keys) if keys is not None else list(state.keys())
        missing = [k for k in selected if k not in skeleton]
        if missing:
            raise StateMismatchError(
                f"checkpoint {self.name} has no keys {missing}; it has "
                f"{sorted(map(str, skeleton))}"
            )
        self.skeleton, self.selected = skeleton, selected
        self.dry = True
        for k in selected:
            self.load(state.get(k, _MISSING), skeleton[k], join_path("", k))
        self.reader.fetch(self.ranges)

    def apply(self, state: Any) -> None:
        self.dry = False
        for k in self.selected:
            new = self.load(state.get(k, _MISSING), self.skeleton[k], join_path("", k))
            if k in state and state[k] is new:
                continue
            if not isinstance(state, MutableMapping):
                raise StateMismatchError(f"cannot replace key {k!r}: the state is read-only")
            state[k] = new
