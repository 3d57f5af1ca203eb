"""What the session takes from a loader, so that no loader loses records silently.

- :func:`in_worker_order`: deterministic mode's merge of a DataLoader's workers into
  the order of an uninterrupted run. A worker's batches arrive in its own order, with
  contiguous indices; one that skips (or repeats) an index would make the merge wait
  for a batch that never comes and drop every later one at the end of the pass, so
  it raises :class:`BatchGapError` at once, naming what is missing.
- :func:`refuse_own_position`: the session is the one keeper of the data position
  (the offsets in each checkpoint). A loader that keeps one of its own (torchdata's
  ``StatefulDataLoader``: ``state_dict`` holds the batches it yielded) in the
  checkpointed state would be restored too, and on resume skip that many batches past
  the offsets: records lost with no error. Refused before anything is loaded or saved.
- :func:`refuse_resuming_loader`: the same for a loader handed to
  ``session.batches`` after ``load_state_dict`` gave it a position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from trainer_client.errors import BatchGapError, LoaderPositionError

if TYPE_CHECKING:
    from trainer_client.batch import Batch

__all__ = ["in_worker_order", "refuse_own_position", "refuse_resuming_loader"]

_INSTEAD = ("the session already commits the data position (the consumed offsets) in "
            "every checkpoint and resumes the loader there: keep the loader out of the "
            "state and pass it to session.batches() only (a StatefulDataLoader works "
            "there, as does a plain torch DataLoader)")


def in_worker_order(batches: Iterable[Batch], next_seq: dict[int, int]) -> Iterator[Batch]:
    """Deterministic mode: a DataLoader's batches in the order an uninterrupted run
    yields them, i.e. by (worker batch index, worker), whatever the loader's order.

    ``next_seq`` maps each worker to the index of its next batch (its batches already
    consumed). A resumed loader starts with worker 0 however far each worker had got;
    batches that come early wait here (at most about one per worker). A worker's
    ``final`` marker says it has no more; markers are not yielded. Raises
    :class:`BatchGapError` when a worker's batch index is not the one it owes next."""
    nxt = dict(next_seq)
    arriving = dict(next_seq)  # per worker, the index its next batch must have
    alive = set(nxt)
    held: dict[tuple[int, int], Batch] = {}

    def ready() -> Iterator[Batch]:
        while True:
            keys = [(nxt[w], w) for w in nxt if w in alive or (nxt[w], w) in held]
            if not keys:
                return
            key = min(keys)
            if key not in held:
                return
            nxt[key[1]] += 1
            yield held.pop(key)

    for b in batches:
        expected = arriving.get(b.worker)
        if expected is None or b.seq != expected:
            raise BatchGapError(
                f"deterministic mode expected batch #{expected} of loader worker {b.worker} "
                f"(a worker yields its batches in order), got #{b.seq}"
                f"{' (its end marker)' if b.final else ''}: the loader "
                f"{'skipped' if expected is not None and b.seq > expected else 'repeated'} "
                "batches, and going on would lose or repeat their records. Nothing after "
                "the gap was recorded as consumed. A loader that resumes a position of its "
                f"own does this: {_INSTEAD}"
            )
        arriving[b.worker] = b.seq + 1
        if b.final:
            alive.discard(b.worker)
        else:
            held[(b.seq, b.worker)] = b
        yield from ready()
    alive.clear()
    yield from ready()
    if held:
        # Cannot happen with in-order workers (each gap raised above); kept so that a
        # pass can never end with batches it silently dropped.
        raise BatchGapError(f"deterministic mode ended a pass holding batches {sorted(held)} "
                            "(index, worker) it could not order: records would be lost")


def _keeps_position(value: Any) -> bool:
    if not callable(getattr(value, "state_dict", None)):
        return False
    from trainer_client.dataset import StreamingDataset

    return isinstance(value, DataLoader) or isinstance(getattr(value, "dataset", None),
                                                       StreamingDataset)


def _walk(state: Any, path: str, depth: int = 3) -> Iterator[tuple[str, Any]]:
    # A few levels ({"train": {"loader": ...}}), not every tensor of a model's
    # state dict: this runs at every checkpoint.
    if isinstance(state, Mapping) and depth > 0:
        for key, value in state.items():
            where = f"{path}[{key!r}]"
            yield where, value
            yield from _walk(value, where, depth - 1)


def refuse_own_position(state: Any) -> None:
    """Raise :class:`LoaderPositionError` when ``state`` holds a loader with
    ``state_dict`` (a DataLoader, or anything reading a ``StreamingDataset``)."""
    for where, value in _walk(state, "state"):
        if _keeps_position(value):
            raise LoaderPositionError(
                f"{where} is a {type(value).__name__}, a loader that keeps its own position "
                "(its state_dict counts the batches it yielded): restored with the "
                "checkpoint, it would skip that many batches past the session's offsets on "
                f"resume, and their records would never be trained. Expected model, "
                f"optimizer and the like in the state; {_INSTEAD}"
            )


def refuse_resuming_loader(loader: Any) -> None:
    """Raise :class:`LoaderPositionError` when a torchdata ``StatefulDataLoader`` was
    given a position (``load_state_dict``) that its next pass would resume."""
    if getattr(loader, "next_iter_state", None) is not None:
        raise LoaderPositionError(
            f"this {type(loader).__name__} was given a position with load_state_dict(): its "
            "next pass would skip the batches that state counts, past the session's "
            f"offsets, and their records would never be trained; {_INSTEAD}"
        )
