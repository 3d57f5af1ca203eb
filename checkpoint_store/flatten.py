"""State <-> (tensor leaves, msgpack skeleton).

``flatten`` walks the user's state: tensors (and ``Shard`` blocks) become leaves named
by their key path (``"model/layer.weight"``, ``"optim/state/0/exp_avg"``; ``/`` and
``~`` in keys escaped as ``~1`` and ``~0``); everything else is kept in a skeleton that
msgpack encodes with a few extension types (below). No pickle: a value of any other
type raises :class:`UnsupportedValueError` naming its key path.

msgpack extension types (FORMAT.md): 1 tensor reference (UTF-8 key path),
2 tuple (msgpack array), 3 numpy array ``[dtype.str, shape, bytes]``,
4 numpy scalar ``[dtype.str, bytes]``, 5 integer beyond 64 bits (signed big-endian),
6 ``io.BytesIO`` (its contents; it loads as a new ``BytesIO`` at position 0).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from checkpoint_store.dtensor import LocalBlock, is_dtensor, local_block
from checkpoint_store.dtypes import dtype_name, is_supported
from checkpoint_store.shard import Shard, Shards
from trainguard.core.checkpoints import CorruptCheckpointError, UnsupportedValueError

__all__ = [
    "TensorLeaf", "TensorRef", "decode_skeleton", "encode_values", "flatten", "is_stateful",
    "join_path",
]

EXT_TENSOR, EXT_TUPLE, EXT_NDARRAY, EXT_NPSCALAR, EXT_BIGINT, EXT_BYTESIO = 1, 2, 3, 4, 5, 6
_I64_MIN, _U64_MAX = -(2**63), 2**64 - 1

_SUPPORTED = (
    "tensors, DTensors (Shard/Replicate placements), Shard, Shards, objects with "
    "state_dict()/load_state_dict(), dicts with str or int keys, lists, tuples, None, bool, "
    "int, float, str, bytes, io.BytesIO, numpy arrays and scalars"
)


@dataclass(frozen=True)
class TensorLeaf:
    path: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sharded: bool
    writes: bool = True
    """False on a DTensor replica whose block another rank writes."""
    layout: dict[str, Any] | None = None
    """A DTensor's mesh shape and placements, recorded in the manifest."""


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor in a decoded skeleton (and, given to ``flatten``, a
    reference to a tensor that another rank saves)."""

    path: str


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def join_path(parent: str, key: Any) -> str:
    part = _escape(str(key))
    return f"{parent}/{part}" if parent else part


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, Mapping | torch.Tensor)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[TensorLeaf] = []
        self._paths: set[str] = set()

    def _leaf(self, path: str, t: torch.Tensor, shard: Shard | LocalBlock | None,
              *, more_of: bool = False) -> msgpack.ExtType:
        """``more_of``: another block of the tensor ``path`` already has (``Shards``)."""
        if t.layout != torch.strided or t.is_quantized or t.is_meta or not is_supported(t.dtype):
            raise UnsupportedValueError(
                f"cannot checkpoint the tensor at {path!r}: dtype {dtype_name(t.dtype)}, "
                f"layout {t.layout}, device {t.device}; only dense tensors of "
                "non-quantized dtypes on CPU or CUDA are supported"
            )
        if path in self._paths and not more_of:
            raise UnsupportedValueError(
                f"two tensors map to the key path {path!r} (e.g. keys 1 and '1' in one "
                "dict); rename one of them"
            )
        self._paths.add(path)
        if t.requires_grad:
            # A new tensor object only where needed: each Python object a save keeps
            # alive for its duration feeds the cyclic GC's full collections.
            t = t.detach()
        if shard is None:
            shape = tuple(t.shape)
            self.leaves.append(TensorLeaf(path, t, shape, (0,) * len(shape), False))
        elif isinstance(shard, LocalBlock):
            self.leaves.append(TensorLeaf(path, t, shard.global_shape, shard.offsets, True,
                                          shard.writes, shard.layout))
        else:
            self.leaves.append(TensorLeaf(path, t, shard.global_shape, shard.offsets, True))
        return msgpack.ExtType(EXT_TENSOR, path.encode())

    def walk(self, value: Any, path: str) -> Any:
        if type(value) is torch.Tensor:
            # The common leaf first (exact type: a subclass such as DTensor is not a
            # plain tensor); the checks below cost ~1 us per tensor of a large state.
            return self._leaf(path, value, None)
        if value is None:
            return None
        # Subclasses (enums, numpy.float64) are stored as their base type.
        for base in (bool, str, float):
            if isinstance(value, base):
                return base(value)
        if isinstance(value, int):
            value = int(value)
            if _I64_MIN <= value <= _U64_MAX:
                return value
            size = (value.bit_length() + 8) // 8
            return msgpack.ExtType(EXT_BIGINT, value.to_bytes(size, "big", signed=True))
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        if isinstance(value, Shard):
            return self._leaf(path, value.tensor, value)
        if isinstance(value, Shards):
            for i, one in enumerate(value.blocks):
                ref = self._leaf(path, one.tensor, one, more_of=i > 0)
            return ref
        if isinstance(value, io.BytesIO):
            return msgpack.ExtType(EXT_BYTESIO, value.getvalue())
        if isinstance(value, TensorRef):
            # A tensor that other ranks write (the DCP writer): referenced, no leaf here.
            return msgpack.ExtType(EXT_TENSOR, value.path.encode())
        if is_dtensor(value):
            block = local_block(value, path)
            return self._leaf(path, block.tensor, block)
        if isinstance(value, torch.Tensor):
            return self._leaf(path, value, None)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject or value.dtype.kind not in "biufcmMSUV":
                raise UnsupportedValueError(
                    f"cannot checkpoint the numpy array at {path!r}: dtype {value.dtype} "
                    "holds Python objects"
                )
            payload = [value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes()]
            return msgpack.ExtType(EXT_NDARRAY, _packb(payload))
        if isinstance(value, np.generic):
            return msgpack.ExtType(EXT_NPSCALAR, _packb([value.dtype.str, value.tobytes()]))
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise UnsupportedValueError(
                        f"cannot checkpoint the dict at {path or '<root>'!r}: key {k!r} is "
                        f"a {type(k).__name__}; keys must be str or int"
                    )
                out[k if isinstance(k, str) else int(k)] = self.walk(v, join_path(path, k))
            return out
        if isinstance(value, list):
            return [self.walk(v, join_path(path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.walk(v, join_path(path, i)) for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, _packb(items))
        if is_stateful(value):
            sd = value.state_dict()
            if not isinstance(sd, Mapping):
                raise UnsupportedValueError(
                    f"state_dict() of the {type(value).__name__} at {path!r} returned a "
                    f"{type(sd).__name__}, expected a mapping"
                )
            return self.walk(sd, path)
        raise UnsupportedValueError(
            f"cannot checkpoint the value at {path or '<root>'!r}: type "
            f"{type(value).__module__}.{type(value).__qualname__} is not supported; "
            f"supported are {_SUPPORTED}"
        )


def flatten(state: Mapping[str, Any]) -> tuple[list[TensorLeaf], bytes]:
    """Tensor leaves in walk order, and the msgpack skeleton of everything."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            f"the state to save must be a mapping of names to values, got {type(state).__name__}"
        )
    f = _Flattener()
    tree = f.walk(state, "")
    try:
        skeleton = _packb(tree)
    except (TypeError, ValueError, OverflowError) as e:  # pragma: no cover - walk guards
        raise UnsupportedValueError(f"cannot encode the state with msgpack: {e}") from e
    return f.leaves, skeleton


MAX_SKELETON_CONTAINERS = 1_000_000
"""Lists and maps a skeleton may decode to: a container costs ~60 bytes of memory and
one byte of msgpack, so a bound on the bytes alone lets a small state blow up."""
MAX_EXT_DEPTH = 32
"""Extension values (tuples, arrays) nested in each other: each level is decoded from a
copy of its bytes, so deep nesting costs time and memory in the square of its size."""


class _Decoder:
    """One skeleton's decode, within a budget of containers and extension nesting."""

    def __init__(self, nbytes: int) -> None:
        self.containers = 0
        self.depth = 0
        # A skeleton's extension payloads are copied out once per nesting level.
        self.ext_bytes_left = 8 * nbytes + (1 << 20)

    def _spent(self, value: Any) -> Any:
        self.containers += 1
        if self.containers > MAX_SKELETON_CONTAINERS:
            raise CorruptCheckpointError(
                f"the checkpoint's msgpack state holds more than {MAX_SKELETON_CONTAINERS} "
                "lists and maps: it is not a state skeleton this store wrote")
        return value

    def ext(self, code: int, data: bytes) -> Any:
        self.ext_bytes_left -= len(data)
        if self.depth >= MAX_EXT_DEPTH or self.ext_bytes_left < 0:
            raise CorruptCheckpointError(
                "the checkpoint's msgpack state nests its extension values deeper or larger "
                "than any state this store writes")
        self.depth += 1
        try:
            return self._ext(code, data)
        finally:
            self.depth -= 1

    def _ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            return TensorRef(data.decode())
        if code == EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == EXT_NDARRAY:
            dtype, shape, raw = self.unpack(data)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        if code == EXT_NPSCALAR:
            dtype, raw = self.unpack(data)
            return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
        if code == EXT_BIGINT:
            return int.from_bytes(data, "big", signed=True)
        if code == EXT_BYTESIO:
            return io.BytesIO(data)
        raise CorruptCheckpointError(f"unknown msgpack extension type {code} in checkpoint state")

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext, strict_map_key=False, raw=False,
                               list_hook=self._spent, object_hook=self._spent)


def _unpackb(data: bytes) -> Any:
    return _Decoder(len(data)).unpack(data)


def decode_skeleton(data: bytes) -> Any:
    try:
        return _unpackb(data)
    except CorruptCheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"cannot decode the checkpoint's msgpack state: {e}") from e


def encode_values(values: Mapping[str, Any], *, what: str) -> bytes:
    """msgpack of plain values (no tensors), with the same types and extension types
    as a skeleton; ``what`` names them in the error for a value holding a tensor."""
    f = _Flattener()
    tree = {k: f.walk(v, join_path("", k)) for k, v in values.items()}
    if f.leaves:
        raise UnsupportedValueError(
            f"{what} {f.leaves[0].path!r} holds a tensor inside a non-tensor value; only "
            "top-level tensors can be saved from it"
        )
    return _packb(tree)
