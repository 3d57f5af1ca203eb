"""The manifest: the immutable JSON commit record of one checkpoint.

A save is committed when its manifest exists under ``manifests/<step>-<uid>.json``.
The document carries its own checksum, so a damaged or half-written manifest is
recognised and skipped. Version 2 hashes the exact bytes stored: the file ends with
``,"checksum":"sha256:<64 hex>"}`` and a newline (``CHECKSUM_SUFFIX_BYTES`` bytes),
and the SHA-256 covers every byte before that suffix, so any language verifies it
without re-encoding JSON. Version 1 (read, never written) hashed Python's canonical
JSON of the other fields. Version 3 adds ``ranks``: the index of the per-rank state
objects (:mod:`checkpoint_store.rank_state`), None when the save carried none; version 2
(read, no longer written) is version 3 without it. Version 4, written for saves of
several ranks, moves ``arrays`` and ``tensors`` into the ranks' objects (both ``{}``
here, ``ranks`` always an index; :mod:`checkpoint_store.rank_content`); a single-rank
save is written as version 3, which it is byte for byte. See FORMAT.md for every field.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store._manifest_checks import check_structure
from checkpoint_store.layout import data_dir, parse_manifest_name
from checkpoint_store.rank_state import check_index
from trainguard.core.checkpoints import CorruptCheckpointError, UnsupportedValueError

__all__ = [
    "CHECKSUM_SUFFIX_BYTES", "FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "Manifest",
    "SINGLE_RANK_VERSION", "TensorFragments", "check_array_names", "encode_manifest",
    "json_extra", "parse_manifest",
]

FORMAT_NAME = "trainguard.checkpoint"
FORMAT_VERSION = 4
"""What a save of several ranks writes (its tensor index in the ranks' objects)."""
SINGLE_RANK_VERSION = 3
"""What a single-rank save writes: its index fits the manifest, as in version 3."""
READABLE_VERSIONS = (1, 2, 3, 4)
CHECKSUM_SUFFIX_BYTES = len(',"checksum":"sha256:') + 64 + len('"}\n')
_SUFFIX_RE = re.compile(rb',"checksum":"(sha256:[0-9a-f]{64})"\}\n\Z')
MANIFEST_KEYS = frozenset(
    {
        "format", "version", "step", "uid", "created_at", "parent", "world_size", "nbytes",
        "extra", "arrays", "tensors", "state", "ranks", "checksum",
    }
)
_KEYS_BEFORE_3 = MANIFEST_KEYS - {"ranks"}


@dataclass(frozen=True, eq=False)
class Manifest:
    """One committed checkpoint. ``extra`` is exactly the ``extra`` given to ``save``;
    ``pinned`` reflects the pin marker when the manifest was read."""

    name: str
    step: int
    uid: str
    created_at: float
    parent: str | None
    world_size: int
    nbytes: int
    extra: dict[str, Any]
    pinned: bool = False
    tensors: dict[str, Any] = field(default_factory=dict, repr=False)
    arrays: dict[str, Any] = field(default_factory=dict, repr=False)
    state: bytes = field(default=b"", repr=False)
    ranks: dict[str, Any] | None = field(default=None, repr=False)
    """The index of the per-rank state objects (``rank_state.make_index``); None when
    the save carried none (and in manifests of versions 1 and 2)."""
    version: int = SINGLE_RANK_VERSION
    """The format version of the manifest's file. In version 4 (several ranks) the
    store's readers fill ``arrays`` and ``tensors`` from the ranks' objects on first
    use (``rank_content.with_content``)."""

    @property
    def data_dir(self) -> str:
        """The save's Zarr group, relative to the store root."""
        return data_dir(self.uid)


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                            allow_nan=False)
_string = json.encoder.encode_basestring_ascii  # a str as canonical JSON (ensure_ascii)


def _canonical(body: dict[str, Any]) -> bytes:
    return _ENCODER.encode(body).encode()


class TensorFragments:
    """The canonical JSON of each ``tensors`` entry of the previous manifest, to reuse.

    Saves of one training run write the same entries every time (paths, shapes,
    where the bytes lie: nothing that changes from step to step), and encoding them
    was most of a manifest's cost: ~3.5 us per tensor. An entry is re-encoded unless
    it equals the one its fragment was made from, so the output is always exactly
    ``json.dumps`` of the entries. (Entries hold str, int, list, dict and None only:
    the values for which ``==`` and equal JSON agree; an entry must not change once
    encoded, and the saver builds fresh ones each save.) Holds one save's entries."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, str]] = {}

    def encode(self, tensors: dict[str, Any]) -> str:
        """``tensors`` as canonical JSON (sorted keys, compact, ASCII)."""
        last, now, parts = self._last, {}, []
        for path in sorted(tensors):
            entry = tensors[path]
            seen = last.get(path)
            text = seen[1] if seen is not None and seen[0] == entry else _ENCODER.encode(entry)
            now[path] = (entry, text)
            parts.append(f"{_string(path)}:{text}")
        self._last = now
        return "{" + ",".join(parts) + "}"


def _canonical_body(body: dict[str, Any], tensors_json: str) -> bytes:
    """``_canonical(body)`` with the ``tensors`` value given as its JSON text: the
    top level joined exactly as ``json.dumps`` joins it."""
    items = (f"{_string(k)}:{tensors_json if k == 'tensors' else _ENCODER.encode(body[k])}"
             for k in sorted(body))
    return ("{" + ",".join(items) + "}").encode()


def encode_manifest(
    *, step: int, uid: str, created_at: float, parent: str | None, world_size: int,
    extra: dict[str, Any], arrays: dict[str, Any], tensors: dict[str, Any], state: bytes,
    fragments: TensorFragments | None = None, ranks: dict[str, Any] | None = None,
    version: int = SINGLE_RANK_VERSION, nbytes: int | None = None,
) -> bytes:
    """The manifest's bytes. ``fragments`` (kept by the writer from save to save)
    reuses the JSON of unchanged tensor entries; the bytes are the same either way.
    ``nbytes``: the tensor bytes when ``tensors`` does not list them (version 4)."""
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": version,
        "step": step,
        "uid": uid,
        "created_at": created_at,
        "parent": parent,
        "world_size": world_size,
        "nbytes": nbytes if nbytes is not None else
        sum(int(s["nbytes"]) for t in tensors.values() for s in t["shards"]),
        "extra": extra,
        "arrays": arrays,
        "tensors": tensors,
        "state": {"encoding": "msgpack", "base64": base64.b64encode(state).decode()},
        "ranks": ranks,
    }
    tensors_json = (fragments or TensorFragments()).encode(tensors)
    prefix = _canonical_body(body, tensors_json)[:-1]  # without its closing brace
    digest = hashlib.sha256(prefix).hexdigest()
    return prefix + f',"checksum":"sha256:{digest}"}}\n'.encode()


def _check_v2(name: str, raw: bytes) -> None:
    m = _SUFFIX_RE.search(raw)
    if m is None or len(raw) - m.start() != CHECKSUM_SUFFIX_BYTES:
        raise CorruptCheckpointError(
            f"manifest {name} does not end with its checksum field: it is damaged or was "
            "not fully written"
        )
    actual = "sha256:" + hashlib.sha256(raw[: m.start()]).hexdigest()
    if m.group(1).decode() != actual:
        raise CorruptCheckpointError(
            f"manifest {name} checksum mismatch (stored {m.group(1).decode()!r}, computed "
            f"{actual!r}): the record is damaged"
        )


def _check_v1(name: str, body: dict[str, Any], checksum: Any) -> None:
    actual = "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()
    if checksum != actual:
        raise CorruptCheckpointError(
            f"manifest {name} checksum mismatch (stored {checksum!r}, computed {actual!r}): "
            "the record is damaged"
        )


def check_array_names(name: str, arrays: object) -> None:
    """Array names become paths under the checkpoint's data directory: a name that
    could leave it (``..``, an absolute path, a backslash, an empty segment) makes the
    manifest corrupt, whatever its checksum says."""
    if not isinstance(arrays, dict):
        raise CorruptCheckpointError(f"manifest {name}: 'arrays' is not an object")
    for array in arrays:
        parts = str(array).split("/")
        if any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
            raise CorruptCheckpointError(
                f"manifest {name} names array {str(array)[:80]!r}, which is not a relative path "
                "inside the checkpoint's data directory: the manifest is damaged or forged"
            )


def parse_manifest(name: str, raw: bytes, *, pinned: bool = False) -> Manifest:
    """Parse and verify; raises CorruptCheckpointError on any mismatch."""
    parsed_name = parse_manifest_name(name)
    if parsed_name is None:
        raise CorruptCheckpointError(f"{name!r} is not a manifest name (<step>-<uid>.json)")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"manifest {name} is not valid JSON ({e}); it is damaged or was not fully written"
        ) from e
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"manifest {name} is not a {FORMAT_NAME} record")
    version = body.get("version")
    if version not in READABLE_VERSIONS:
        raise CorruptCheckpointError(
            f"manifest {name} has format version {version!r}; this reader understands "
            f"versions {list(READABLE_VERSIONS)}: upgrade trainguard"
        )
    checksum = body.pop("checksum", None)
    if version == 1:
        _check_v1(name, body, checksum)
    else:
        _check_v2(name, raw)
    keys = MANIFEST_KEYS if version >= 3 else _KEYS_BEFORE_3
    if set(body) | {"checksum"} != keys:
        raise CorruptCheckpointError(f"manifest {name} has fields {sorted(body)}, expected "
                                     f"{sorted(keys - {'checksum'})}")
    if body["step"] != parsed_name.step or body["uid"] != parsed_name.uid:
        raise CorruptCheckpointError(
            f"manifest {name} records step {body['step']} uid {body['uid']}, which do not "
            "match its name"
        )
    check_array_names(name, body["arrays"])
    state = body["state"]
    if not isinstance(state, dict) or state.get("encoding") != "msgpack" \
            or not isinstance(state.get("base64"), str):
        raise CorruptCheckpointError(
            f"manifest {name}: the state is not {{'encoding': 'msgpack', 'base64': ...}}")
    check_structure(name, body, len(state["base64"]))
    ranks = body.get("ranks")
    check_index(name, ranks, body["world_size"] if type(body["world_size"]) is int else -1)
    if version == 4 and (ranks is None or body["arrays"] or body["tensors"]
                         or body["world_size"] < 2):
        raise CorruptCheckpointError(
            f"manifest {name} has format version 4, whose arrays and tensors are in the "
            "objects of its ranks: it needs several ranks, an index of their objects and "
            "empty 'arrays' and 'tensors'; the manifest is damaged or forged")
    try:
        state_bytes = base64.b64decode(state["base64"], validate=True)
    except ValueError as e:
        raise CorruptCheckpointError(f"manifest {name}: the state is not valid base64") from e
    return Manifest(
        name=name,
        step=int(body["step"]),
        uid=str(body["uid"]),
        created_at=float(body["created_at"]),
        parent=body["parent"],
        world_size=int(body["world_size"]),
        nbytes=int(body["nbytes"]),
        extra=body["extra"],
        pinned=pinned,
        tensors=body["tensors"],
        arrays=body["arrays"],
        state=state_bytes,
        ranks=ranks,
        version=int(version),
    )


def json_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` as the manifest will hold it: a JSON-able mapping, exactly."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise UnsupportedValueError(f"extra must be a JSON-able mapping, got {type(extra).__name__}")
    try:
        doc: dict[str, Any] = json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(f"extra must be JSON-able (no NaN): {e}") from e
    if doc != extra:
        # Checked so that manifest.extra is exactly what was given, not a lossy copy.
        raise UnsupportedValueError(
            "extra must survive JSON unchanged: use str keys and lists (not int keys or "
            f"tuples); got {extra!r}"
        )
    return doc
