"""Property tests: the msgpack skeleton round-trips any plain value exactly, and a
stateful model of save / pin / unpin / delete / gc / load agrees with the store."""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from checkpoint_store import CheckpointStore, PinnedCheckpointError
from checkpoint_store.flatten import decode_skeleton, flatten

_leaves = (
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
)
_values = st.recursive(
    _leaves,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner,
                                     max_size=4)),
    max_leaves=20,
)


def _same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)  # type: ignore[union-attr]
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))  # type: ignore[arg-type]
    return a == b


@settings(max_examples=150, deadline=None)
@given(_values)
def test_skeleton_round_trips_plain_values_with_their_types(value):
    """Whatever nesting of None/bool/int (beyond 64 bits too)/float/str/bytes/list/
    tuple/dict: decode(flatten(x)) == x with the same types at every level."""
    leaves, skeleton = flatten({"v": value})
    assert leaves == []
    assert _same(decode_skeleton(skeleton), {"v": value})


@given(st.sampled_from(["<i2", ">f8", "<u4", "|b1", "<c16"]), st.lists(st.integers(0, 3), max_size=3))
@settings(max_examples=30, deadline=None)
def test_numpy_arrays_keep_dtype_and_shape(dtype, shape):
    """numpy arrays of any numeric dtype and byte order come back identical."""
    arr = np.zeros(shape, dtype=dtype)
    (out,) = decode_skeleton(flatten({"a": [arr]})[1])["a"]
    assert out.dtype == arr.dtype and out.shape == arr.shape and np.array_equal(out, arr)


# A few paths recur from save to save (so fragments get reused, or must not be);
# any unicode is escaped to ASCII in the JSON.
_paths = st.sampled_from(["w", "b", "model/é", 'q"~1']) | st.text(min_size=1, max_size=6)
_ints = st.lists(st.integers(0, 2**40), max_size=3)
_shards = st.lists(st.fixed_dictionaries(
    {"array": st.sampled_from(["r0/pack", "r1/t0", "r0/spack"]),
     "nbytes": st.integers(0, 2**40), "offset": st.integers(0, 2**40),
     "offsets": _ints, "shape": _ints}), min_size=1, max_size=3)
_layouts = st.fixed_dictionaries(
    {"mesh": _ints, "placements": st.lists(st.sampled_from(["R", "S(0)", "S(1)"]), max_size=2)})
_entries = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["float32", "bfloat16", "int64"]), "shape": _ints,
     "shards": _shards},
    optional={"layout": _layouts},
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(_paths, _entries, max_size=6), min_size=1, max_size=4),
       st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3))
def test_manifest_bytes_equal_canonical_json_whatever_entries_are_reused(saves, extra):
    """One writer's manifests, save after save (entries kept, changed, added and
    dropped): each is byte for byte the canonical JSON of its fields, exactly what a
    writer without reused entry fragments writes, and parses back to the same
    tensors. Any mix-up of a reused fragment would show as a difference."""
    import json

    from checkpoint_store.manifest import TensorFragments, encode_manifest, parse_manifest
    from trainguard.core.checkpoints import CorruptCheckpointError

    fragments = TensorFragments()
    for i, tensors in enumerate(saves):
        fresh = json.loads(json.dumps(tensors))  # new objects each save, as the saver
        kw = dict(step=i, uid="0123456789abcdef-01234567", created_at=1.5 + i, parent=None,
                  world_size=1, extra=extra, arrays={}, tensors=fresh, state=b"\x80")
        raw = encode_manifest(**kw, fragments=fragments)
        assert raw == encode_manifest(**kw)
        body = json.loads(raw)
        body.pop("checksum")
        assert raw[:-87] + b"}" == json.dumps(body, sort_keys=True,
                                               separators=(",", ":")).encode()
        name = f"{i:012d}-0123456789abcdef-01234567.json"
        try:
            assert parse_manifest(name, raw).tensors == tensors
        except CorruptCheckpointError as e:
            # Random entries mostly describe bytes no array holds: refused for their
            # structure, never for their checksum (which must always hold).
            assert "damaged or forged" in str(e) and "checksum mismatch" not in str(e)


class StoreMachine(RuleBasedStateMachine):
    """Model: committed checkpoints in commit order as [step, value, pinned]."""

    def __init__(self) -> None:
        super().__init__()
        self.store = CheckpointStore(f"memory://prop-{uuid.uuid4().hex}", keep_last=2)
        self.model: list[list] = []
        self.counter = 0

    def _retain(self) -> None:
        last = self.model[-2:]
        self.model = [e for e in self.model if e[2] or any(e is x for x in last)]

    @rule(step=st.integers(0, 4))
    def save(self, step):
        self.counter += 1
        self.store.save({"x": torch.tensor(float(self.counter)), "n": self.counter}, step=step)
        self.model.append([step, self.counter, False])
        self._retain()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin(self, data):
        step = data.draw(st.sampled_from([e[0] for e in self.model]))
        self.store.pin(step)
        [e for e in self.model if e[0] == step][-1][2] = True

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def unpin(self, data):
        step = data.draw(st.sampled_from([e[0] for e in self.model]))
        self.store.unpin(step)
        for e in self.model:
            if e[0] == step:
                e[2] = False

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        step = data.draw(st.sampled_from([e[0] for e in self.model]))
        if any(e[2] for e in self.model if e[0] == step):
            with pytest.raises(PinnedCheckpointError):
                self.store.delete(step)
        else:
            self.store.delete(step)
            self.model = [e for e in self.model if e[0] != step]

    @rule()
    def gc(self):
        self.store.gc()
        self._retain()

    @invariant()
    def listing_and_load_match_the_model(self):
        listed = self.store.list()
        assert [(m.step, m.pinned) for m in listed] == [(e[0], e[2]) for e in self.model]
        target = {"x": torch.tensor(0.0), "n": 0}
        manifest = self.store.load(target, strict=True)
        if not self.model:
            assert manifest is None
        else:
            assert target["n"] == self.model[-1][1] and target["x"].item() == self.model[-1][1]


StoreMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_agrees_with_model = StoreMachine.TestCase
