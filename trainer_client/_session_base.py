"""What every part of a ``TrainingSession`` stands on: its construction (the Redis
client and its breaker, the store, the committer, the healing), the partitions this
rank reads and their placement at the checkpoint's offsets, and the small helpers
(generation, broadcast, progress) that restore, reading and checkpointing share.
:class:`trainer_client.session.TrainingSession` is the public face."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer_client import _rng, redis_client
from trainer_client import offsets as ofs
from trainer_client._commit import OffsetCommitter, PositionReader
from trainer_client._consumed import Consumed
from trainer_client._every import CheckpointEvery, EveryMode, check_every
from trainer_client._healing import Healing
from trainer_client._progress import EpochSizes, Progress, measure
from trainer_client._timing import SaveClock
from trainer_client._trainlog import TrainLog
from trainer_client.dataset import StreamingDataset, load_spec
from trainer_client.health import HealthMonitor, NodeHealth
from trainer_client.redis_retry import trainer_redis_breaker, trainer_redis_retrier
from trainer_client.watchdog import WatchdogConfig
from trainguard.core import streams
from trainguard.core.checkpoints import (
    CheckpointStoreAPI,
    ManifestView,
    open_store,
    rank_state_store,
)
from trainguard.core.incidents import LoopPolicy
from trainguard.core.interval import IntervalPolicy
from trainguard.core.newest import newest_first
from trainguard.core.rank_record import Positions
from trainguard.core.record import SessionRecord
from trainguard.core.tier_plan import TierPolicy

__all__ = ["SessionBase"]


class SessionBase:
    """The state and helpers of a session (see :class:`~trainer_client.session.TrainingSession`)."""

    def __init__(
        self,
        redis_url: str,
        *,
        dataset: str,
        run: str,
        store: CheckpointStoreAPI | str,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        deterministic: bool = True,
        seed: int | None = None,
        block_ms: int = 1000,
        redis_timeout_s: float = 900.0,
        health_monitor: HealthMonitor | None = None,
        interval: IntervalPolicy | None = None,
        watchdog: WatchdogConfig | bool | None = None,
        loop_breaker: LoopPolicy | bool | None = None,
        checkpoint_every: EveryMode = None,
        tier_policy: TierPolicy | None = None,
    ) -> None:
        check_every(checkpoint_every)  # before anything is opened: a bad value leaves nothing
        streams.check_name("dataset", dataset)
        streams.check_name("run", run)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if world_size > 1 and not dist.is_initialized():
            raise ValueError(
                f"world_size={world_size} needs torch.distributed initialised first "
                "(e.g. dist.init_process_group('gloo')): offsets of all ranks end in one manifest"
            )
        self.redis_url = redis_url
        self.dataset_name = dataset
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.deterministic = deterministic
        self.block_ms = block_ms
        self.redis_timeout_s = redis_timeout_s
        self.process_group = process_group
        self._redis = redis_client.client(redis_url, socket_timeout=30, socket_connect_timeout=5)
        # Every Redis call goes through one breaker and waits out an outage (restart,
        # AOF loading) for up to redis_timeout_s instead of failing the training step.
        self._call = trainer_redis_retrier(trainer_redis_breaker(f"redis:{run}"), redis_timeout_s).call
        try:
            self.spec = self._call(load_spec, self._redis, dataset)
            self._owns_store = isinstance(store, str)
            self.store: CheckpointStoreAPI = open_store(
                store, keep_last=keep_last, keep_every=keep_every,
                storage_options=storage_options, process_group=process_group,
            ) if isinstance(store, str) else store
        except BaseException:
            self._redis.close()
            raise
        self.generation: int | None = None
        self._consumed = Consumed(self.spec.partitions)
        self._commits = 0
        self._num_workers = 0
        self._restored: SessionRecord | None = None
        # Per-rank state objects when the store has them: no rank gathers offsets.
        self._rank_store = rank_state_store(self.store)
        self._positions = PositionReader(self._rank_store)
        self._basis: tuple[ManifestView, SessionRecord] | None = None
        # The restored checkpoint when it consumed every record of a finished dataset:
        # the loop then gets nothing and checkpoints write nothing (_finished.py).
        self._finished: ManifestView | None = None
        self._placed: set[int] = set()
        self._committer = OffsetCommitter(self._redis, self._call, self.store,
                                          dataset=dataset, run=run, reader=self._positions,
                                          lists=self.rank == 0)
        self._reseek = False
        self._datasets: list[StreamingDataset] = []
        self.seed = _rng.default_seed(run) if seed is None else int(seed)
        self._sizes = EpochSizes(self._redis, dataset, self.spec.partitions)
        self.health_monitor = health_monitor
        self._health = NodeHealth(health_monitor)
        self._clock = SaveClock(interval)
        self._every = CheckpointEvery(checkpoint_every, self.store, self._clock, tier_policy)
        self._trainlog = TrainLog(self._redis, self._call, dataset=dataset, run=run, rank=rank,
                                  steps_left=self._steps_left)
        try:
            self._heal = Healing(redis_url, dataset=dataset, run=run, rank=rank,
                                 world_size=world_size, call=self._call,
                                 broadcast=self._broadcast, process_group=process_group,
                                 watchdog=watchdog, loop_breaker=loop_breaker)
        except BaseException:
            self._redis.close()
            raise

    def watch(self, phase: str, limit_s: float) -> contextlib.AbstractContextManager[None]:
        """A block between steps (evaluation, a long log write) that may run for up to
        ``limit_s`` seconds without the watchdog taking it for a hang."""
        return self._heal.phase(phase, limit_s)

    def collective_timeout(self) -> timedelta:
        """The collective timeout from the watchdog's figures now: the session sets it
        on ``process_group`` itself; use it for the groups the script makes."""
        return self._heal.collective_timeout()

    # ------------------------------------------------------------------ helpers

    def _gen(self) -> int:
        if self.generation is None:
            raise RuntimeError("call session.restore(state) before reading or checkpointing")
        return self.generation

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]

    @property
    def offsets(self) -> dict[int, str]:
        """Per partition, the last stream ID the training loop consumed (all ranks'
        partitions as of the last restore, this rank's as consumed since)."""
        return self._consumed.snapshot().offsets

    @property
    def last_commit_offsets_s(self) -> float | None:
        """Seconds the last checkpoint spent acknowledging and publishing offsets."""
        return self._committer.last_publish_s

    def checkpoints(self) -> list[ManifestView]:
        """The store's committed checkpoints (manifests; one store per run), in the
        order restores prefer them (:func:`trainguard.core.newest.restore_order`).
        ``rollback(state, to_step)`` loads the first of them with that step."""
        return newest_first(self.store.list())

    def _mine(self, num_workers: int) -> list[int]:
        return streams.rank_partitions(self.spec.partitions, world_size=self.world_size,
                                       num_workers=num_workers, rank=self.rank)

    def _place(self, partitions: list[int]) -> Positions | None:
        """Move the group of those of ``partitions`` not placed since the restore to
        their offsets in the newest checkpoint (the restored one, or this session's
        latest commit), reading only the objects of the ranks that owned them; then
        acknowledge up to them. O(partitions + objects read)."""
        todo = [p for p in partitions if p not in self._placed]
        if not todo:
            return None
        basis = self._basis
        if self._placed and self._committer.last_committed is not None:
            # A loader of another worker count moved partitions between ranks: their
            # newest positions are in this run's latest commit.
            self._committer.wait()
            basis = self._committer.last_committed
        if basis is None:
            pos = Positions({p: streams.ZERO_ID for p in todo}, {p: 0 for p in todo}, {})
        else:
            pos = self._positions.positions(basis[0], basis[1], todo)
        # The seek and the acknowledgement of every partition in one script call (per
        # master on a cluster): 16,384 ranks' restores queue on the same servers.
        self._call(ofs.place_partitions, self._redis, self.dataset_name, self.run,
                   self._gen(), pos.offsets, pos.batches)
        self._consumed.place(pos.offsets, pos.batches)
        self._placed.update(todo)
        return pos

    def _owned(self, num_workers: int) -> dict[int, list[int]]:
        return {
            w: streams.assign_partitions(
                self.spec.partitions,
                world_size=self.world_size,
                num_workers=num_workers,
                rank=self.rank,
                worker=w,
            )
            for w in range(max(1, num_workers))
        }

    def progress(self) -> Progress:
        """Where this rank stands in the current epoch: the epoch, the batches and
        records consumed in it, the records remaining, and the steps an epoch takes
        for this world size, worker count and batch size (from the latest
        :meth:`dataset`). Exact once the producer has finished the epoch, estimated
        from what it produced so far before that (``exact``). Reads Redis (a few
        commands): call it every few steps, not in the innermost loop."""
        mine = sorted(p for ps in self._owned(self._num_workers).values() for p in ps)
        return measure(
            self._consumed.snapshot(), lambda e: self._call(self._sizes.get, e), mine,
            world_size=self.world_size, num_workers=self._num_workers,
            dataset=self._datasets[-1] if self._datasets else None, epochs=self.spec.epochs,
        )

    def _steps_left(self) -> int | None:
        """Loop iterations to the end of the run's epochs (None: endless or unknown)."""
        p = self.progress()
        if p.steps_per_epoch is None or p.epochs is None:
            return None
        return max(0, (p.epochs - p.epoch) * p.steps_per_epoch - p.batches)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every checkpoint started here committed and acknowledged."""
        with self._heal.phase("checkpoint"):
            self._committer.wait(timeout_s)

