"""The stream contract between ``ingest_service`` and ``trainer_client``.

Everything both sides must agree on lives here and only here: Redis key names, the
stream ID scheme, the record encoding, the dataset metadata, and the pure function
that assigns partitions to consumers. It imports nothing heavy (no aiohttp, no torch,
no redis) so that every process can import it cheaply, DataLoader workers included.

Key layout for dataset ``D`` (``{...}`` is the Redis Cluster hash tag)::

    tg:datasets                      SET     names of all datasets
    tg:{D}:meta                      HASH    DatasetSpec fields (see DatasetSpec.to_redis)
    tg:{D}:dlq                       STREAM  dead letters: reason, source position, payload
    tg:{D}:groups                    SET     consumer groups (one per training run)
    tg:{D}:committed:<group>         HASH    partition -> last committed stream ID
    tg:{D}:floor:<group>             HASH    partition -> retention floor (oldest kept ckpt)
    tg:{D}:paused                    SET     partitions the producer paused (backpressure)
    tg:{D}:progress                  HASH    producer progress (see PROGRESS_* below)
    tg:{D:p0007}                     STREAM  partition 7
    tg:{D:p0007}:seq                 HASH    push producers: producer_id -> last appended seq
    tg:{D:p0007}:fence:<group>       STRING  generation of the trainer that owns the group
    tg:{D:p0007}:seek:<group>        HASH    where the group's next loader pass starts (id, batches)

A partition's own keys share its hash slot, so a Lua script may touch them together.

Stream IDs of replayable (file) sources are deterministic: ``<epoch + 1>-<index>``,
where ``index`` counts the records of that partition in that epoch from 0. Redis
refuses an ID at or below the last one, which makes a repeated append harmless, and a
restarted producer knows where it stopped from the partition's last ID alone.
Push sources use Redis' automatic IDs.

Entries are flat field maps (no base64, no JSON around binary data)::

    k    kind: b"raw" (bytes), b"mp" (msgpack), b"nd" (a NumPy array)
    d    the payload bytes
    dt   (nd only) NumPy dtype string, e.g. b"<i4"
    sh   (nd only) shape as comma-separated ints, e.g. b"128"
    pos  where the record came from in the source: ``path:line`` (jsonl, text; lines
         count from 1), ``path:token_index`` (npy: the index of the record's first
         token in the file's flattened array), ``path:row`` (parquet, from 0),
         ``path`` (files); push records carry none. ``Batch.pos`` hands it on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast, get_args

import msgpack

# The errors and the ID scheme live in modules of their own; every name is re-exported
# here, where both sides import them from.
from trainguard.core.errors import ContractError as ContractError
from trainguard.core.errors import DatasetNotFoundError as DatasetNotFoundError
from trainguard.core.stream_ids import ZERO_ID as ZERO_ID
from trainguard.core.stream_ids import StreamId as StreamId
from trainguard.core.stream_ids import format_id as format_id
from trainguard.core.stream_ids import id_epoch_index as id_epoch_index
from trainguard.core.stream_ids import make_id as make_id
from trainguard.core.stream_ids import max_id as max_id
from trainguard.core.stream_ids import min_id as min_id
from trainguard.core.stream_ids import offsets_from_wire as offsets_from_wire
from trainguard.core.stream_ids import offsets_to_wire as offsets_to_wire
from trainguard.core.stream_ids import parse_id as parse_id

CONTRACT_VERSION = 1
"""Bumped on any incompatible change of the keys, IDs or encoding below."""

PREFIX = "tg"
DEFAULT_PARTITIONS = 16
MAX_PARTITIONS = 65536
"""Up to 8,192 ranks x 8 DataLoader workers each own a partition. Partition keys print
the number with at least four digits (``p0007``, ``p65535``), so keys below 10,000 are
those of every earlier version."""

SourceFormat = Literal["jsonl", "text", "npy", "files", "parquet", "hf", "webdataset", "push"]
"""A dataset's source format. ``hf`` is a Hugging Face ``datasets`` folder
(``save_to_disk`` Arrow or Parquet shards), ``webdataset`` a set of WebDataset tar
shards. ``push`` datasets have no source: records arrive over HTTP."""

FORMATS: tuple[SourceFormat, ...] = get_args(SourceFormat)
"""Every :data:`SourceFormat`, in order: the one list the CLI and the service read."""

SOURCED_FORMATS: tuple[SourceFormat, ...] = tuple(f for f in FORMATS if f != "push")
"""The formats read from a source (all but ``push``): what an ingest job can read."""


def check_format(value: object) -> SourceFormat:
    """``value`` itself when it is one of :data:`FORMATS`; a format read from a config,
    a request or Redis is a plain string, so the boundary checks it."""
    if value not in FORMATS:
        raise ContractError(f"format {value!r} is unknown: expected one of {FORMATS}")
    return cast(SourceFormat, value)


# --------------------------------------------------------------------------- names


def check_name(kind: str, name: str) -> str:
    """Dataset and group names end up inside Redis keys and URLs: keep them plain."""
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name):
        raise ContractError(
            f"{kind} name {name!r} is not valid: expected 1-128 characters from "
            "letters, digits, '-', '_' and '.'")
    return name


def datasets_key() -> str:
    return f"{PREFIX}:datasets"


def meta_key(dataset: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:meta"


def dlq_key(dataset: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:dlq"


def groups_key(dataset: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:groups"


def committed_key(dataset: str, group: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:committed:{group}"


def floor_key(dataset: str, group: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:floor:{group}"


def kept_key(dataset: str, group: str) -> str:
    """The run's kept checkpoints, as rank 0 of its trainer saw them after its last
    commit (JSON: name, step, uid and session record of each): the other ranks read
    it for their retention floor instead of listing the store."""
    return f"{PREFIX}:{{{dataset}}}:kept:{group}"


def generation_key(dataset: str, group: str) -> str:
    """The run's newest fencing generation taken (a counter the trainer's restore
    increments; each partition's fence is raised to it by the rank that reads it)."""
    return f"{PREFIX}:{{{dataset}}}:generation:{group}"


def paused_key(dataset: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:paused"


def progress_key(dataset: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:progress"


def partition_key(dataset: str, partition: int) -> str:
    return f"{PREFIX}:{{{dataset}:p{partition:04d}}}"


def seq_key(dataset: str, partition: int) -> str:
    return f"{partition_key(dataset, partition)}:seq"


def lease_key(dataset: str, partition: int) -> str:
    """Which file producer writes the partition now: its owner id, with a TTL (in the
    partition's slot)."""
    return f"{partition_key(dataset, partition)}:lease"


def producers_key(dataset: str) -> str:
    """Hash of the dataset's live file producers: owner id -> expiry (ms, Redis time)."""
    return f"{PREFIX}:{{{dataset}}}:producers"


def fence_key(dataset: str, partition: int, group: str) -> str:
    return f"{partition_key(dataset, partition)}:fence:{group}"


def seek_key(dataset: str, partition: int, group: str) -> str:
    """Written by the trainer before each pass of its data loader, read by the loader
    worker that owns the partition when the pass starts: ``id`` (the last consumed ID)
    and ``batches`` (batches consumed so far, for deterministic mode). It lives in the
    partition's slot so that a fenced Lua script can write it."""
    return f"{partition_key(dataset, partition)}:seek:{group}"


# --------------------------------------------------------------------------- records

F_KIND, F_DATA, F_DTYPE, F_SHAPE, F_POS = b"k", b"d", b"dt", b"sh", b"pos"
KIND_RAW, KIND_MSGPACK, KIND_NDARRAY = b"raw", b"mp", b"nd"


def encode_record(value: Any, *, pos: str | None = None) -> dict[bytes, bytes]:
    """One record -> the field map of its stream entry.

    ``bytes`` stay raw; NumPy arrays keep dtype and shape beside their raw bytes (so a
    consumer can view them without a copy); anything else msgpack can hold goes as
    msgpack.
    """
    fields: dict[bytes, bytes]
    if isinstance(value, bytes | bytearray | memoryview):
        fields = {F_KIND: KIND_RAW, F_DATA: bytes(value)}
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        arr = value if value.flags["C_CONTIGUOUS"] else value.copy(order="C")
        fields = {
            F_KIND: KIND_NDARRAY,
            F_DATA: arr.tobytes(),
            F_DTYPE: arr.dtype.str.encode(),
            F_SHAPE: ",".join(str(n) for n in arr.shape).encode(),
        }
    else:
        try:
            packed = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ContractError(
                f"record of type {type(value).__name__} cannot be encoded: expected bytes, "
                f"a NumPy array or a msgpack-able value ({exc})"
            ) from exc
        fields = {F_KIND: KIND_MSGPACK, F_DATA: packed}
    if pos is not None:
        fields[F_POS] = pos.encode()
    return fields


def decode_record(fields: Mapping[bytes, bytes]) -> Any:
    """The inverse of :func:`encode_record`.

    NumPy arrays come back as read-only views over the entry's bytes (no copy).
    """
    kind = fields.get(F_KIND)
    data = fields.get(F_DATA)
    if data is None:
        raise ContractError(f"stream entry has no {F_DATA!r} field: {sorted(fields)!r}")
    if kind == KIND_RAW:
        return data
    if kind == KIND_MSGPACK:
        return msgpack.unpackb(data, raw=False)
    if kind == KIND_NDARRAY:
        import numpy as np

        dtype = np.dtype(fields[F_DTYPE].decode())
        shape_text = fields.get(F_SHAPE, b"").decode()
        shape = tuple(int(n) for n in shape_text.split(",")) if shape_text else ()
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise ContractError(f"stream entry kind {kind!r} is unknown: expected raw, mp or nd")


def record_size(fields: Mapping[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


# --------------------------------------------------------------------------- progress

PROGRESS_EPOCHS_DONE = b"epochs_done"
"""Number of epochs whose records are all in every partition (written after them)."""
PROGRESS_FINISHED = b"finished"
"""``b"1"`` once a finite dataset has been produced completely."""
PROGRESS_END_PREFIX = b"end:"
"""``end:<p>`` -> the last stream ID of partition ``p`` of a finished dataset (absent
when the partition received no record): a consumer at that offset has read everything."""


def progress_end_field(partition: int) -> bytes:
    return PROGRESS_END_PREFIX + str(partition).encode()


PROGRESS_DONE_PREFIX = b"done:"
"""``done:<p>`` -> ``1`` once partition ``p`` of a finite dataset holds its last record
(producers sharing a dataset each mark their own; ``finished`` follows when all are)."""


def progress_done_field(partition: int) -> bytes:
    return PROGRESS_DONE_PREFIX + str(partition).encode()


# --------------------------------------------------------------------------- dead letters

DL_REASON, DL_POS, DL_EPOCH, DL_SIZE, DL_PAYLOAD = b"reason", b"pos", b"epoch", b"size", b"payload"
DL_PAYLOAD_LIMIT = 1024
"""Bytes of a bad record's payload kept in its dead letter (the rest is cut)."""
DL_REASONS = ("undecodable", "oversized", "schema")


def encode_dead_letter(
    reason: str, pos: str, payload: bytes, *, detail: str = "", epoch: int | None = None
) -> dict[bytes, bytes]:
    """A dead-letter entry: ``reason`` (one of DL_REASONS, then ``: detail``), where the
    record came from, its full size and the first DL_PAYLOAD_LIMIT bytes of it."""
    if reason not in DL_REASONS:
        raise ContractError(f"dead-letter reason {reason!r} is unknown: expected one of {DL_REASONS}")
    text = f"{reason}: {detail}" if detail else reason
    fields = {
        DL_REASON: text.encode(),
        DL_POS: pos.encode(),
        DL_SIZE: str(len(payload)).encode(),
        DL_PAYLOAD: bytes(payload[:DL_PAYLOAD_LIMIT]),
    }
    if epoch is not None:
        fields[DL_EPOCH] = str(epoch).encode()
    return fields


# --------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset is. Stored in ``meta_key(name)``; compared on re-create."""

    name: str
    partitions: int = DEFAULT_PARTITIONS
    source: str = ""
    format: SourceFormat = "jsonl"
    seed: int = 0
    epochs: int | None = 1
    """Passes over the source; ``None`` means endless (push datasets are endless)."""
    sample_len: int | None = None
    """For ``npy`` token sources: tokens per record."""
    max_record_bytes: int = 16 * 1024 * 1024
    shuffle_buffer: int = 4096
    contract_version: int = CONTRACT_VERSION
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("dataset", self.name)
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ContractError(
                f"partitions must be between 1 and {MAX_PARTITIONS}, got {self.partitions}"
            )
        check_format(self.format)
        if self.format == "push" and self.epochs is not None:
            object.__setattr__(self, "epochs", None)
        if self.format != "push" and not self.source:
            raise ContractError(f"dataset {self.name!r} of format {self.format!r} needs a source")
        if self.epochs is not None and self.epochs < 1:
            raise ContractError(f"epochs must be >= 1 or None (endless), got {self.epochs}")
        if self.format == "npy" and not self.sample_len:
            raise ContractError("an npy token source needs sample_len (tokens per record)")

    @property
    def replayable(self) -> bool:
        return self.format != "push"

    @property
    def finite(self) -> bool:
        return self.epochs is not None

    def to_redis(self) -> dict[str, str]:
        return {k: json.dumps(v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: Mapping[bytes | str, bytes | str]) -> DatasetSpec:
        def text(x: bytes | str) -> str:
            return x.decode() if isinstance(x, bytes) else x

        values = {text(k): json.loads(text(v)) for k, v in raw.items()}
        version = values.get("contract_version")
        if version != CONTRACT_VERSION:
            raise ContractError(
                f"dataset {values.get('name')!r} was written with stream contract "
                f"{version}, this trainguard speaks {CONTRACT_VERSION}: upgrade trainguard")
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})

    @classmethod
    def of_meta(cls, name: str, raw: Mapping[bytes | str, bytes | str]) -> DatasetSpec:
        """Dataset ``name``'s spec from its meta hash as read (empty: not found)."""
        if not raw:
            raise DatasetNotFoundError(
                f"dataset {name!r} does not exist in this Redis (not registered: no "
                f"{meta_key(name)!r}); create it (`trainguard datasets create`, or the "
                "service's file datasets), or check the Redis URL and the name")
        return cls.from_redis(raw)

    def differences(self, other: DatasetSpec) -> dict[str, tuple[Any, Any]]:
        """Fields that differ, as ``{field: (self, other)}``."""
        a, b = asdict(self), asdict(other)
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


# --------------------------------------------------------------------------- assignment


def consumer_count(world_size: int, num_workers: int) -> int:
    return world_size * max(1, num_workers)


def assign_partitions(
    partitions: int, *, world_size: int, num_workers: int, rank: int, worker: int
) -> list[int]:
    """Partitions read by one (rank, worker): a pure function of its arguments.

    Consumer ``c = rank * max(1, num_workers) + worker`` reads partitions ``p`` with
    ``p % C == c`` for ``C`` consumers in all. Every partition has exactly one owner for
    any (world_size, num_workers), so a run may restart with other values and still own
    each partition once. With more consumers than partitions some read nothing.
    """
    workers = max(1, num_workers)
    if not 0 <= rank < world_size:
        raise ContractError(f"rank {rank} is outside world size {world_size}")
    if not 0 <= worker < workers:
        raise ContractError(f"worker {worker} is outside num_workers {num_workers}")
    total = consumer_count(world_size, num_workers)
    me = rank * workers + worker
    # Stepping, not filtering: O(P / consumers) per call, not O(P).
    return list(range(me, partitions, total))


def rank_partitions(partitions: int, *, world_size: int, num_workers: int, rank: int) -> list[int]:
    """Every partition one rank reads (all its workers' :func:`assign_partitions`),
    sorted: O(P / world_size). A pure function of its arguments, like the assignment."""
    workers = max(1, num_workers)
    if not 0 <= rank < world_size:
        raise ContractError(f"rank {rank} is outside world size {world_size}")
    total = consumer_count(world_size, num_workers)
    first = rank * workers
    return sorted(p for c in range(first, first + workers) for p in range(c, partitions, total))


def partition_owner(partition: int, *, partitions: int, world_size: int, num_workers: int) -> int:
    """The rank whose workers read ``partition`` under :func:`assign_partitions`: O(1)."""
    if not 0 <= partition < partitions:
        raise ContractError(f"partition {partition} is outside 0..{partitions - 1}")
    return (partition % consumer_count(world_size, num_workers)) // max(1, num_workers)


def all_partitions(spec: DatasetSpec) -> Iterable[int]:
    return range(spec.partitions)
