"""Phase 3 of the commit protocol: after a manifest committed, acknowledge and publish.

The manifest is the commit point; what follows only tells Redis about it: XACK every
entry up to the committed offsets (fenced), then publish the committed offsets and the
retention floor (the oldest offsets any kept checkpoint of the run may roll back to)
for monitoring and for the producer's trimming. A crash in between is harmless:
restore acknowledges again. This runs in the store's writer thread (the save
handle's done-callback) unless the checkpoint was blocking; a fencing refusal met
there is kept and raised by the session's next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import torch.distributed as dist

from trainer_client import offsets as ofs
from trainer_client.errors import FencedError
from trainguard.core import record, streams
from trainguard.core.checkpoints import CheckpointStoreAPI, SaveHandleView
from trainguard.core.record import RankState

__all__ = ["OffsetCommitter", "gather_offsets"]

log = logging.getLogger("trainer_client.session")


class OffsetCommitter:
    """Acknowledges and publishes the offsets of each committed checkpoint of one run."""

    def __init__(
        self,
        client: redis.Redis,
        call: Callable[..., Any],
        store: CheckpointStoreAPI,
        *,
        dataset: str,
        run: str,
    ) -> None:
        self._redis = client
        self._call = call
        self._store = store
        self._dataset = dataset
        self._run = run
        self._lock = threading.Lock()
        self._inflight: list[threading.Event] = []
        self._background_error: BaseException | None = None
        self.last_publish_s: float | None = None

    def after(self, handle: SaveHandleView, offsets: Mapping[int, str], generation: int,
              *, blocking: bool) -> None:
        """Publish ``offsets`` once ``handle``'s manifest committed (nothing if it
        failed). ``blocking``: now, raising a refusal; else from the handle's callback."""
        done = threading.Event()
        with self._lock:
            self._inflight.append(done)

        def after_commit(h: Any) -> None:
            try:
                h.wait()
            except BaseException:
                done.set()  # the commit failed: nothing to acknowledge
                return
            try:
                self.publish(offsets, generation)
            except BaseException as exc:
                if isinstance(exc, FencedError) or not isinstance(exc, Exception):
                    self._background_error = exc
                else:
                    log.warning("acknowledging offsets after commit failed (restore redoes "
                                "it): %s", exc)
            finally:
                done.set()

        if blocking:
            after_commit(handle)
            self.raise_background()
        else:
            handle.add_done_callback(after_commit)

    def publish(self, offsets: Mapping[int, str], generation: int) -> None:
        """XACK up to ``offsets``, then publish them and the retention floor."""
        t0 = time.perf_counter()
        r = self._redis
        self._call(ofs.ack_upto, r, self._dataset, self._run, generation, offsets)
        floor = record.retention_floor(offsets, self._store.list(), dataset=self._dataset,
                                       run=self._run)
        committed: dict[Any, Any] = streams.offsets_to_wire(offsets)
        floors: dict[Any, Any] = streams.offsets_to_wire(floor)

        def publish() -> None:
            # A new pipeline per attempt: a failed execute() empties its pipeline, so
            # retrying the same one would publish nothing.
            pipe = r.pipeline(transaction=True)
            pipe.hset(streams.committed_key(self._dataset, self._run), mapping=committed)
            pipe.delete(streams.floor_key(self._dataset, self._run))
            pipe.hset(streams.floor_key(self._dataset, self._run), mapping=floors)
            pipe.execute()

        self._call(publish)
        self.last_publish_s = time.perf_counter() - t0

    def raise_background(self) -> None:
        """Raise (once) a fencing refusal or fatal error met in the background."""
        exc, self._background_error = self._background_error, None
        if exc is not None:
            raise exc

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every checkpoint handed to :meth:`after` was published."""
        with self._lock:
            events = list(self._inflight)
        for e in events:
            e.wait(timeout_s)
        with self._lock:
            self._inflight = [e for e in self._inflight if not e.is_set()]


def gather_offsets(
    offsets: dict[int, str], batches: dict[int, int], mine: RankState, world_size: int,
    group: Any,
) -> tuple[dict[int, str], dict[int, int], dict[int, RankState]]:
    """Every rank's offsets, batch counts and rank state, merged (a collective): each
    rank holds all partitions' offsets (the restored ones for partitions it does not
    read), and the newest per partition is its owner's."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (offsets, batches, mine.to_wire()), group=group)
    merged: dict[int, str] = {}
    counts: dict[int, int] = {}
    ranks: dict[int, RankState] = {}
    for rank, (offs, bats, state) in enumerate(gathered):
        for p, i in offs.items():
            merged[p] = streams.max_id(merged.get(p), i) or i
        for p, n in bats.items():
            counts[p] = max(counts.get(p, 0), n)
        ranks[rank] = RankState.from_wire(state)
    return merged, counts, ranks
