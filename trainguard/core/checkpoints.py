"""The checkpoint port: what the rest of trainguard may assume of a checkpoint store.

``checkpoint_store`` implements it (:class:`~checkpoint_store.CheckpointStore`,
:class:`~checkpoint_store.TieredCheckpointStore`); ``trainer_client`` and the admin
API are written against it, so the training client never imports the store (the two
are independent parts, checked by import-linter). Three things live here:

- the protocols: :class:`CheckpointStoreAPI` (save, list, verify, load, pin, delete),
  :class:`ManifestView` (what a committed checkpoint tells its readers) and
  :class:`SaveHandleView` (the future of one save);
- the errors a store raises, one hierarchy under :class:`CheckpointError`, each also
  the built-in that matches it (``except FileNotFoundError`` keeps working for callers
  who do not know trainguard);
- :func:`open_store`: a store from a URL, made by the implementation registered under
  the ``trainguard.checkpoint_stores`` entry point (``checkpoint_store`` registers
  ``default``), so that a session given a URL needs no import of it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Literal, Protocol, TypedDict, cast, get_args

from trainguard.core.errors import TrainguardError

__all__ = [
    "STORE_ENTRY_POINTS",
    "CHECKPOINT_STATUSES",
    "CheckpointError",
    "CheckpointStatus",
    "CheckpointSummary",
    "store_tier",
    "CheckpointStoreAPI",
    "CheckpointWriteError",
    "IF_BUSY",
    "IfBusy",
    "CheckpointExistsError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DistributedSaveError",
    "ExportError",
    "ExportExistsError",
    "ManifestView",
    "NoCheckpointError",
    "StoreNotRegisteredError",
    "PinnedCheckpointError",
    "RankStateStoreAPI",
    "SaveHandleView",
    "SaveInProgressError",
    "StateMismatchError",
    "UnsupportedValueError",
    "check_if_busy",
    "checkpoint_summary",
    "one_tier_status",
    "open_store",
    "rank_state_store",
]

STORE_ENTRY_POINTS = "trainguard.checkpoint_stores"
"""Entry-point group of store implementations: ``name = "module:factory"``, where
``factory(url, **options)`` returns a :class:`CheckpointStoreAPI`."""

IfBusy = Literal["wait", "raise"]
"""What ``save`` does while an earlier save is in flight: wait for it, or raise
:class:`SaveInProgressError`. Every store's ``save`` takes this one type."""

IF_BUSY: tuple[IfBusy, ...] = get_args(IfBusy)


def check_if_busy(if_busy: object) -> IfBusy:
    """``if_busy`` itself when it is one of :data:`IF_BUSY`; the type does not reach
    callers who pass a string read from a config, so the boundary checks it."""
    if if_busy not in IF_BUSY:
        raise ValueError(f"if_busy must be 'wait' or 'raise', got {if_busy!r}")
    return cast(IfBusy, if_busy)


class ManifestView(Protocol):
    """A committed checkpoint as its readers see it (``checkpoint_store.Manifest``)."""

    @property
    def name(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def uid(self) -> str:
        """Starts with the commit time: uids sort in commit order."""
        ...

    @property
    def extra(self) -> Mapping[str, Any]:
        """Exactly the ``extra`` given to ``save`` (the session record lives here)."""
        ...

    @property
    def pinned(self) -> bool: ...


CheckpointStatus = Literal["committed", "pinned", "local_only", "remote"]
"""A checkpoint's status words: always committed; pinned; with a remote tier, remote
(a copy is there) or local_only (not yet uploaded)."""

CHECKPOINT_STATUSES: tuple[CheckpointStatus, ...] = get_args(CheckpointStatus)


class CheckpointSummary(TypedDict):
    """One checkpoint of a store listing: a row of ``GET /admin/checkpoints/{store}``
    (and the head of a checkpoint's document) and of ``trainguard ckpt ls --json``. Both
    build it with :func:`checkpoint_summary`; the OpenAPI ``Checkpoint`` schema is
    tested against these keys (test_document_shapes)."""

    step: int
    uid: str
    name: str
    created_at: float | None
    nbytes: int | None
    parent: str | None
    world_size: int | None
    pinned: bool
    status: list[CheckpointStatus]
    tiers: list[str]
    """Where the checkpoint lives, cheapest first: ``ram`` (its node's RAM tier),
    ``partner:n<r>`` (a copy on node r's tier server), ``disk`` (local disk),
    ``remote`` (remote storage)."""


def store_tier(url: str) -> str:
    """The tier a store at ``url`` is: ``disk`` for a local directory (a path or
    ``file://``), else ``remote``."""
    return "disk" if "://" not in url or url.startswith("file://") else "remote"


def one_tier_status(pinned: bool) -> list[CheckpointStatus]:
    """The status words of a checkpoint in a store without a remote tier."""
    return ["committed", "pinned"] if pinned else ["committed"]


def checkpoint_summary(m: Any, status: Sequence[CheckpointStatus] | None = None,
                       tiers: Sequence[str] | None = None) -> CheckpointSummary:
    """``m`` (a ``checkpoint_store.Manifest``, slim or whole) as a listing row.
    ``status`` and ``tiers`` come from the caller that knows the tiers; without them,
    a store of one tier: committed, and pinned when it is; on local disk, and remote
    too when the status says so."""
    if status is None:
        status = one_tier_status(m.pinned)
    if tiers is None:
        tiers = ["disk", *(["remote"] if "remote" in status else [])]
    return {"step": m.step, "uid": m.uid, "name": m.name, "created_at": m.created_at,
            "nbytes": m.nbytes, "parent": m.parent, "world_size": m.world_size,
            "pinned": bool(m.pinned), "status": list(status), "tiers": list(tiers)}


class SaveHandleView(Protocol):
    """The future of one save: completes when the manifest is committed or the save
    failed; callbacks run once, after either."""

    @property
    def step(self) -> int: ...

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> ManifestView: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class CheckpointStoreAPI(Protocol):
    """Save, list, verify, load, pin and delete checkpoints of one run.

    ``CheckpointStore`` and ``TieredCheckpointStore`` mirror these signatures on
    purpose; ``test_both_stores_implement_the_shared_api`` keeps them from drifting."""

    url: str

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def save(self, state: Mapping[str, Any], *, step: int,
             extra: Mapping[str, Any] | None = None, blocking: bool = True,
             if_busy: IfBusy = "wait") -> SaveHandleView: ...

    def load(self, state: Mapping[str, Any], *, step: int | None = None,
             keys: Iterable[str] | None = None, strict: bool = False) -> ManifestView | None: ...

    def list(self) -> Sequence[ManifestView]: ...

    def latest(self) -> ManifestView | None: ...

    def verify(self, step: int) -> ManifestView: ...

    def pin(self, step: int) -> ManifestView: ...

    def unpin(self, step: int) -> None: ...

    def delete(self, step: int) -> builtins.list[str]: ...

    def gc(self) -> object: ...

    def close(self) -> object: ...


class RankStateStoreAPI(CheckpointStoreAPI, Protocol):
    """A store with per-rank state objects (``supports_rank_state`` true): each rank's
    ``save(rank_state=...)`` document is written beside its shards and indexed in the
    manifest; :meth:`read_rank_state` reads one rank's back, verified. A session writes
    its offsets, batch counts and random states there; with a store without them, it
    keeps its whole record in the manifest's ``extra`` (session record version 2).

    ``precommit``: called on every rank in the save's background writer once that
    rank's data and object are written, before it reports to rank 0; an exception it
    raises fails the save on every rank (nothing is committed) and is the save's error
    on that rank, as raised. A session checks its fences there, off the loop's path."""

    supports_rank_state: bool

    def save(self, state: Mapping[str, Any], *, step: int,
             extra: Mapping[str, Any] | None = None, blocking: bool = True,
             if_busy: IfBusy = "wait",
             rank_state: Mapping[str, Any] | None = None,
             precommit: Callable[[], None] | None = None) -> SaveHandleView: ...

    def read_rank_state(self, manifest: ManifestView, rank: int) -> dict[str, Any] | None: ...


def rank_state_store(store: CheckpointStoreAPI) -> RankStateStoreAPI | None:
    """``store`` as a :class:`RankStateStoreAPI` when it has the capability, else None."""
    if getattr(store, "supports_rank_state", False) is True:
        return cast(RankStateStoreAPI, store)
    return None


def open_store(url: str, *, implementation: str = "default", **options: Any) -> CheckpointStoreAPI:
    """A store at ``url`` (``options`` go to the implementation's constructor, e.g.
    ``keep_last``, ``storage_options``, ``process_group``)."""
    found = entry_points(group=STORE_ENTRY_POINTS, name=implementation)
    if not found:
        raise StoreNotRegisteredError(
            f"no checkpoint store implementation {implementation!r} is registered under the "
            f"{STORE_ENTRY_POINTS!r} entry points: install trainguard (pip install -e .), "
            "or pass a store object instead of a URL"
        )
    factory = next(iter(found)).load()
    return cast(CheckpointStoreAPI, factory(url, **options))


# --------------------------------------------------------------------------- errors


class CheckpointError(TrainguardError):
    """Base class of every error raised by ``checkpoint_store``."""


class StoreNotRegisteredError(CheckpointError, LookupError):
    """``open_store`` found no implementation of that name among the entry points."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored data does not match its checksum, or a record cannot be parsed."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No (valid) checkpoint matches the request."""


class SaveInProgressError(CheckpointError, RuntimeError):
    """A save is in flight and the caller asked not to wait (``if_busy="raise"``)."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (full disk, I/O error, permission); ``errno`` is kept.

    The previous checkpoint is untouched: nothing is published before the data is
    durable."""


class CommitConflictError(CheckpointError, FileExistsError):
    """The manifest name already exists: another writer committed the same record."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint of the step already exists and the save was asked not to add one
    (DCP's ``overwrite=False``)."""


class ExportError(CheckpointError, ValueError):
    """An export cannot be written as asked (no tensors under the key, names that
    collide once a prefix is stripped)."""


class ExportExistsError(CheckpointError, FileExistsError):
    """The export's output file already exists; it is replaced only when forced."""


class DistributedSaveError(CheckpointError, RuntimeError):
    """At least one rank failed its part of a save, so nothing was committed."""


class PinnedCheckpointError(CheckpointError, PermissionError):
    """The checkpoint is pinned; unpin it before deleting it."""


class StateMismatchError(CheckpointError, ValueError):
    """The state to load into does not match the checkpoint (keys, shapes or dtypes)."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be checkpointed; the message names its key path."""
