"""``TrainingSession``: restore, read and checkpoint so that every record trains once.

Call order (each method's docstring has the details)::

    session = TrainingSession(redis_url, dataset="tokens", run="exp42", store=url)
    step = session.restore(state)             # 1. weights + offsets + RNG, new generation
    loader = DataLoader(session.dataset(batch_size=32), batch_size=None, num_workers=2)
    for batch in session.batches(loader):     # 2. only what the loop consumed counts
        ...; step += 1
        session.checkpoint(state, step)       # 3. offsets go into the manifest
    session.checkpoint(state, step, blocking=True)   # 4. the steps since the last one
    session.close()

Bitwise resume (the default, deterministic mode, on the same world size and worker
count): a resumed run trains exactly the batches, in the same order, with the same
random numbers as an uninterrupted one. The session saves each rank's global random
states (torch CPU and CUDA, NumPy, Python ``random``) with every checkpoint and sets
them back on restore, and gives each DataLoader pass a generator derived from the run
seed, so iterating the loader never draws from the global generator. Anything with
``state_dict``/``load_state_dict`` in the state (LR schedulers, ...) is saved and
restored with it. On another world size or worker count every record is still
trained exactly once, but batches are formed differently, so bitwise identity
cannot hold (a warning says so). Greedy mode (``deterministic=False``) forms batches
from whatever partitions are ready: faster when partitions arrive unevenly, still
exactly once, but a resumed run's batches differ from an uninterrupted run's.

The checkpoint manifest is the truth: its ``extra["trainguard"]`` holds the consumed
offsets (per partition, the last stream ID the loop consumed), the dataset, the
partition count and the fencing generation (format: :mod:`trainguard.core.record`).
Only after the manifest is committed are entries
acknowledged (XACK) and the offsets published to Redis; a crash in between is
harmless, because restore moves the group to the manifest's offsets and acknowledges
again. A zombie (a trainer of the same run from before a newer restore) is refused by
the fence on every read, acknowledgement and checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainer_client import _rng
from trainer_client import offsets as ofs
from trainer_client._checkpointing import Checkpointing
from trainer_client._loaders import in_worker_order, refuse_resuming_loader
from trainer_client._restore import Restoring, warn_if_reshaped
from trainer_client._uneven import UNEVEN_MODES, Uneven, in_step
from trainer_client.dataset import Batch, StreamingDataset
from trainer_client.health import HealthMonitor, HealthProbe, HealthReport

__all__ = ["TrainingSession"]

log = logging.getLogger(__name__)

class TrainingSession(Restoring, Checkpointing):
    """Ties a run's checkpoints to its consumer group. See the module docstring.

    ``store`` is a ``CheckpointStore`` or its URL (then ``keep_last``, ``keep_every``,
    ``storage_options`` and ``process_group`` configure the one made here).
    ``deterministic`` (default True) makes resumes bitwise; False is greedy mode
    (see the module docstring for what it trades away). ``seed`` is the run seed
    DataLoader passes derive their generators from (default: from the run name; a
    restored checkpoint's seed wins). ``health_monitor`` (optional) answers
    :meth:`health`. ``interval`` tunes the checkpoint interval advisor behind
    :meth:`should_checkpoint`; ``checkpoint_every`` says what it answers: None
    (default) that advisor's interval, ``n`` every n-th step, ``"auto"`` the
    multi-level plan over a store of several tiers (``NodeTierStore``,
    ``TieredCheckpointStore``: each tier its interval from its measured cost and the
    failures it survives, ``tier_policy`` the priors; with a plain store, the
    single-tier advisor; :mod:`trainguard.core.tier_plan` states the formula and
    :meth:`checkpoint_plan` shows the plan). With ``world_size > 1``, call
    ``dist.init_process_group`` first (gloo works on CPU; or
    :func:`trainer_client.init_process_group`, with the watchdog's collective
    timeout); every rank then calls
    ``restore``, ``checkpoint`` and ``rollback`` in the same order, and ``batches``
    keeps the ranks in step.

    ``watchdog`` (a :class:`~trainer_client.watchdog.WatchdogConfig`; False: off;
    default ``$TRAINGUARD_WATCHDOG``) exits a process that makes no progress (exit 86)
    and tightens the collective timeout; ``loop_breaker`` (a
    :class:`~trainguard.core.incidents.LoopPolicy`; False: off; default
    ``$TRAINGUARD_LOOP_BREAKER``) answers a failure that repeats after restores (older
    checkpoint, skipped batches, then exit 87). Every attempt and failure is recorded
    in Redis (:mod:`trainguard.core.incidents`); :meth:`close` marks the attempt ok.
    """


    # ------------------------------------------------------------------ reading

    def dataset(
        self,
        batch_size: int,
        *,
        decode: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        straddle_epochs: bool = False,
        epochs: int | None = None,
    ) -> StreamingDataset:
        """A :class:`StreamingDataset` of this run's rank; pass it to a DataLoader with
        ``batch_size=None`` and iterate that through :meth:`batches`. Batches span
        this rank's partitions and never hold two epochs: only a worker's last batch
        of an epoch may be short, or with ``drop_last`` is consumed (acknowledged)
        without being trained; ``straddle_epochs=True`` fills batches across
        epochs instead. ``epochs``: train this many epochs (up to the dataset's own;
        any number of an endless one, whose producer writes epochs as they drain)."""
        ds = StreamingDataset(
            self.redis_url,
            self.dataset_name,
            self.run,
            batch_size=batch_size,
            rank=self.rank,
            world_size=self.world_size,
            decode=decode,
            collate=collate,
            deterministic=self.deterministic,
            drop_last=drop_last,
            straddle_epochs=straddle_epochs,
            epochs=epochs,
            seed=self.seed,
            # May be made before restore (to size an LR schedule from progress()):
            # restore then hands it the new generation.
            generation=self.generation or 0,
            block_ms=self.block_ms,
            reconnect_timeout_s=self.redis_timeout_s,
            spec=self.spec,
        )
        ds.session_made = True
        self._datasets.append(ds)
        return ds

    def _loop_batches(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """The batches the loop gets: end markers skipped, dropped tails recorded."""
        for batch in source:
            if batch.final:
                continue
            if batch.dropped:
                self._consumed.record(batch)
                continue
            yield batch

    def batches(
        self, loader: Iterable[Batch], *, uneven: Uneven = "join",
        health: HealthMonitor | None = None,
    ) -> Iterator[Batch]:
        """Yield the loader's batches, recording each one's offsets as consumed when it
        is handed to the loop. Before each pass over the loader, the seek of this
        rank's partitions is set to the consumed offsets, so a pass never skips what an
        abandoned pass had prefetched; and the loader gets a generator derived from
        the run seed (unless it has one), so the pass leaves the global random state
        as the restore set it. In deterministic mode, batches come in the order an
        uninterrupted run would have had them (the loader's workers are merged by
        each worker's batch index). A session restored at the end of a finished dataset
        (:attr:`finished`) yields nothing.

        With several ranks, every rank leaves the loop in the same iteration (see
        :mod:`trainer_client._uneven`): ``uneven="join"`` hands a rank that ran out
        empty batches (``len(batch) == 0``) until all are out; ``"stop"`` ends the
        loop everywhere when the first rank runs out. The same per-step all-reduce
        carries each rank's GPU verdict (``health``, default the session's
        ``health_monitor``): once one rank's is CRITICAL, every rank raises at the same
        step boundary (GpuCriticalError there, PeerGpuCriticalError on the others)."""
        if uneven not in UNEVEN_MODES:
            raise ValueError(f"uneven must be one of {UNEVEN_MODES}, got {uneven!r}")
        refuse_resuming_loader(loader)
        if self._finished is not None:
            return  # restored at the end of a finished dataset: nothing left to train
        num_workers = int(getattr(loader, "num_workers", 0))
        if self.deterministic:
            warn_if_reshaped(self._restored, self.world_size, num_workers)
        self._num_workers = num_workers
        owned = self._owned(num_workers)
        mine = sorted(p for ps in owned.values() for p in ps)
        self._place(mine)
        while True:
            self._reseek = False
            positions, counts = self._consumed.start_pass(mine)
            self._call(
                ofs.write_seek, self._redis, self.dataset_name, self.run, self._gen(),
                positions, counts,
            )
            ds = loader if isinstance(loader, StreamingDataset) else getattr(loader, "dataset", None)
            if isinstance(ds, StreamingDataset):
                # Full table: the partitions of any rank could be asked for (a
                # dataset made elsewhere); ours are the ones that changed.
                ds.seek = self._consumed.seek_table()
            if getattr(loader, "generator", False) is None:
                loader.generator = _rng.loader_generator(  # type: ignore[attr-defined]
                    self.seed, self.rank, sum(counts.values()))
            it = iter(loader)
            source: Iterator[Batch] = it
            try:
                if self.deterministic:
                    nxt = {w: sum(counts[p] for p in ps) for w, ps in owned.items()}
                    source = in_worker_order(it, nxt)
                source = self._loop_batches(source)
                if self.world_size > 1:
                    source = in_step(source, mode=uneven, group=self.process_group,
                                     monitor=health or self.health_monitor)
                for batch in source:
                    self._consumed.record(batch)
                    if self._heal.handing(batch):
                        yield batch
                    if self._reseek:
                        break
                else:
                    self._heal.loop_ended()
                    return
            finally:
                # Close the abandoned pass's generators now: their frames hold the
                # loader's iterator (and with it, without workers, the reader's Redis
                # connections) until closed.
                close = getattr(source, "close", None)
                if close is not None:
                    close()
                if isinstance(ds, StreamingDataset):
                    ds.seek = None  # a pass not started here is refused (bypass)
                # Stop an abandoned pass's workers before the next pass seeks, so none
                # of them reads on. Persistent workers stay: the loader's next pass
                # resets them, and each starts its new pass at the seek.
                if not getattr(loader, "persistent_workers", False):
                    shutdown = getattr(it, "_shutdown_workers", None)
                    if shutdown is not None:
                        shutdown()
                del it

    def log(self, step: int | None = None, **values: Any) -> None:
        """Report the loop's figures for the dashboard: ``session.log(loss=loss)``
        (numbers or one-element tensors; ``lr=...`` and a few more as you like).
        ``step``: default the loop's own (the restored step plus the batches handed
        out). Rank 0's values are kept, at most one entry a second (the newest wins)
        in a capped Redis stream (:mod:`trainguard.core.trainlog`): the run page
        shows the loss, steps/s, the ETA, and turns red when the log stops."""
        self._trainlog.log(self._heal.step if step is None else step, values,
                           self._heal.attempts.attempt)

    def close(self) -> None:
        """Wait for in-flight checkpoints, then release connections (and the store
        when the session made it). Raises a fencing refusal met in the background."""
        try:
            self._trainlog.flush()
            self.wait()
            self._committer.raise_background()
            self._heal.closed()
        finally:
            self._heal.close()
            self._health.close()
            if self._owns_store:
                self.store.close()
            self._redis.close()

    # ------------------------------------------------------------------ health

    def health(
        self, monitor: HealthMonitor | None = None, *, probe: HealthProbe | None = None
    ) -> HealthReport:
        """GPU health of this node: the latest report of ``monitor`` (default: the
        session's ``health_monitor``), probing now if it has none yet; without a
        monitor, a probe now with ``probe`` or the session's own (made on first use,
        closed by :meth:`close`). A node without GPUs reports ``no_gpu=True``."""
        return self._health.report(monitor, probe=probe)

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
