"""Per-rank state objects: what one rank alone needs to resume, beside its shards.

A save may carry, per rank, a small JSON document (``save(..., rank_state=doc)``: a
``TrainingSession`` puts there the offsets of the partitions that rank reads, its
batch counts, random states and epoch position). Each rank writes its own object at
``data/<uid>/ranks/<rank>.json`` with its arrays, before it reports to rank 0; the
manifest (format 3) holds only the index: one digest per rank, so it stays small at
any world size (35 bytes a rank: 573 KB at 16,384 ranks), and a restore reads the
objects it needs, never all of them.

An object's bytes are canonical JSON (sorted keys, compact, ASCII)::

    {"format": "trainguard.rank_state", "version": 1, "uid": <save uid>,
     "step": <step>, "rank": r, "world_size": W, "state": <the document given>}

and the index's digest of rank ``r`` is the first 32 hex digits (128 bits) of the
SHA-256 of exactly those bytes. A reader checks the digest, then the uid, step and
rank inside, so an object copied from another save or rank is refused as damaged.

A save of several ranks (manifest format 4) writes every rank's object, as version 2:
the same fields plus the rank's own ``arrays`` and ``tensors`` entries (what format 3
kept in the manifest, :mod:`checkpoint_store.rank_content`), with ``"state": null``
when the save carried no rank states. A single-rank save writes version 1 as before.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from checkpoint_store.backends import Backend
from checkpoint_store.layout import data_dir
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = [
    "DIGEST",
    "RANK_STATE_FORMAT",
    "RANK_INDEX_VERSION",
    "RANK_STATE_VERSION",
    "RANKS_DIR",
    "check_index",
    "decode_rank_state",
    "digest",
    "read_rank_doc",
    "read_rank_object",
    "encode_rank_state",
    "make_index",
    "rank_state_path",
]

RANK_STATE_FORMAT = "trainguard.rank_state"
RANK_STATE_VERSION = 1
"""The object of a single-rank save: its state document only."""
RANK_INDEX_VERSION = 2
"""The object of a save of several ranks: the state (or null) and the rank's arrays
and tensor entries."""
RANKS_DIR = "ranks"
DIGEST = "sha256/128"
"""The index's digest: SHA-256 cut to 128 bits (a damaged object is told apart with
certainty; a forged one needs 2^64 work, beyond what a checksum is there to stop)."""
_HEX = re.compile(r"[0-9a-f]{32}\Z")
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                            allow_nan=False)


def rank_state_path(uid: str, rank: int) -> str:
    """Where rank ``rank``'s object of save ``uid`` lies, relative to the store root."""
    return f"{data_dir(uid)}/{RANKS_DIR}/{rank}.json"


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def encode_rank_state(state: Mapping[str, Any] | None, *, uid: str, step: int, rank: int,
                      world_size: int,
                      content: tuple[dict[str, Any], dict[str, Any]] | None = None) -> bytes:
    """The object's exact bytes: version 1 of ``state``, or with ``content`` (the
    rank's arrays and tensor entries) version 2. Raises ``TypeError``/``ValueError``
    when ``state`` is not plain JSON (str, int, float, bool, None, lists and
    str-keyed objects)."""
    doc: dict[str, Any] = {
        "format": RANK_STATE_FORMAT, "version": RANK_STATE_VERSION, "uid": uid,
        "step": step, "rank": rank, "world_size": world_size,
        "state": None if state is None else dict(state),
    }
    if content is not None:
        doc.update(version=RANK_INDEX_VERSION, arrays=content[0], tensors=content[1])
    elif state is None:
        raise ValueError("a rank state object of version 1 needs a state document")
    return _ENCODER.encode(doc).encode()


def make_index(digests: Sequence[str]) -> dict[str, Any]:
    """The manifest's ``ranks`` field: digest of rank r at position r."""
    return {"digest": DIGEST, "objects": list(digests)}


def check_index(name: str, index: Any, world_size: int) -> None:
    """A manifest's ``ranks`` field is None or a well-formed index of every rank."""
    if index is None:
        return
    objects = index.get("objects") if isinstance(index, dict) else None
    if not isinstance(index, dict) or index.get("digest") != DIGEST \
            or not isinstance(objects, list) or len(objects) != world_size \
            or not all(isinstance(d, str) and _HEX.match(d) for d in objects):
        raise CorruptCheckpointError(
            f"manifest {name}: 'ranks' is not an index of {world_size} rank objects "
            f"({{'digest': {DIGEST!r}, 'objects': [32 hex digits per rank]}}); the manifest "
            "is damaged or forged: load an earlier checkpoint"
        )


def decode_rank_state(raw: bytes, *, name: str, index: Mapping[str, Any], uid: str,
                      step: int, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s document from its object's bytes, checked against manifest
    ``name``'s index (None: a version 2 object of a save without rank states);
    CorruptCheckpointError on any mismatch."""
    return _state_of(decode_rank_doc(raw, name=name, index=index, uid=uid, step=step,
                                     rank=rank), name, rank)


def _state_of(doc: dict[str, Any], name: str, rank: int) -> dict[str, Any] | None:
    state = doc.get("state")
    if state is None and doc["version"] == RANK_INDEX_VERSION:
        return None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"the state object of rank {rank} of checkpoint {name} "
                                     "holds no state document")
    return state


def decode_rank_doc(raw: bytes, *, name: str, index: Mapping[str, Any], uid: str,
                    step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s whole object, checked as :func:`decode_rank_state` says."""
    expected = index["objects"][rank]
    if digest(raw) != expected:
        raise CorruptCheckpointError(
            f"the state object of rank {rank} of checkpoint {name} does not match the "
            f"manifest's digest ({DIGEST} {expected}): it is damaged; load an earlier "
            "checkpoint"
        )
    try:
        doc = json.loads(raw)
    except ValueError as e:  # a digest collision aside, unreachable: kept for clarity
        raise CorruptCheckpointError(f"the state object of rank {rank} of checkpoint "
                                     f"{name} is not JSON: {e}") from e
    version = doc.get("version") if isinstance(doc, dict) else None
    found = (doc.get("format"), version, doc.get("uid"), doc.get("step"),
             doc.get("rank")) if isinstance(doc, dict) else (None,) * 5
    if version not in (RANK_STATE_VERSION, RANK_INDEX_VERSION) \
            or found != (RANK_STATE_FORMAT, version, uid, step, rank):
        raise CorruptCheckpointError(
            f"the state object of rank {rank} of checkpoint {name} is {found}, expected "
            f"{(RANK_STATE_FORMAT, f'{RANK_STATE_VERSION} or {RANK_INDEX_VERSION}', uid, step, rank)}: "
            "it belongs to another save or rank; load an earlier checkpoint"
        )
    return doc


def read_rank_object(backend: Backend, manifest: Any, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s document of the parsed ``manifest`` (a ``Manifest``) on
    ``backend``; None when its save carried no rank states."""
    if manifest.ranks is None:
        return None
    return _state_of(read_rank_doc(backend, manifest, rank), manifest.name, rank)


def read_rank_doc(backend: Backend, manifest: Any, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s whole object of ``manifest`` (which has an index), verified."""
    index = manifest.ranks
    assert index is not None
    if not 0 <= rank < manifest.world_size:
        raise IndexError(f"rank {rank} is not one of the {manifest.world_size} ranks that "
                         f"wrote checkpoint {manifest.name}")
    try:
        raw = backend.read(rank_state_path(manifest.uid, rank))
    except FileNotFoundError as e:
        raise CorruptCheckpointError(
            f"the state object of rank {rank} of checkpoint {manifest.name} is missing: the "
            "checkpoint is damaged; load an earlier one"
        ) from e
    return decode_rank_doc(raw, name=manifest.name, index=index, uid=manifest.uid,
                           step=manifest.step, rank=rank)
