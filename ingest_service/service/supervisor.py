"""Background work of the service: one producer per registered file dataset, and
retention for push datasets (which have no producer of their own).

Looks for newly registered datasets every ``discover_interval_s``. A producer that
fails (an unreadable source) is logged and tried again at the next look. Work that
ended cleanly starts again only for a new registration of its name (deleted and
registered again: its progress no longer says finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.exceptions as redis_errors
from redis.asyncio import Redis

from ingest_service.backlog import apply_retention
from ingest_service.datasets import describe_dataset, list_datasets
from ingest_service.errors import IngestError
from ingest_service.metrics import IngestMetrics
from ingest_service.producer.producer import Producer
from ingest_service.service.config import IngestConfig
from trainguard.core import streams

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, redis: Redis, config: IngestConfig, metrics: IngestMetrics) -> None:
        self.redis = redis
        self.config = config
        self.metrics = metrics
        self.producers: dict[str, Producer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()
        for producer in self.producers.values():
            producer.stop()

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    await self._discover()
                except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
                    log.warning("cannot list datasets (%s); trying again", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.discover_interval_s)
        finally:
            for producer in self.producers.values():
                producer.stop()
            if self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _discover(self) -> None:
        names = await list_datasets(self.redis)
        wanted = self.config.datasets
        for name in names:
            if wanted is not None and name not in wanted:
                continue
            if not await self._due(name):
                continue
            try:
                spec = await describe_dataset(self.redis, name)
            except IngestError:
                continue  # deleted between the two reads
            if spec.replayable:
                producer = Producer(
                    self.redis, spec, storage_options=self.config.storage_options,
                    limits=self.config.limits, metrics=self.metrics,
                    maintenance_interval_s=self.config.maintenance_interval_s,
                    lease_ms=self.config.lease_ms,
                )
                self.producers[name] = producer
                self._tasks[name] = asyncio.create_task(self._guard(name, producer.run()))
            else:
                self.producers.pop(name, None)
                self._tasks[name] = asyncio.create_task(self._guard(name, self._retain(name)))

    async def _due(self, name: str) -> bool:
        """Whether ``name``'s work must start (again): never started, failed, or ended
        while the dataset listed now is not finished: a producer that stopped because
        its dataset was deleted, or that finished before it was deleted, and a push
        dataset's retention (which ends only on deletion) all serve a new registration
        of the name. A finished file dataset stays done."""
        task = self._tasks.get(name)
        if task is None:
            return True
        if not task.done():
            return False
        if task.exception() is not None:
            return True
        finished = await self.redis.hget(streams.progress_key(name), streams.PROGRESS_FINISHED)
        return finished != b"1"

    async def _guard(self, name: str, work: object) -> None:
        try:
            await work  # type: ignore[misc]
        except (IngestError, OSError, ValueError) as exc:
            log.error("dataset %s: background work failed (%s); retrying later", name, exc)
            raise
        except Exception:
            # Anything else (e.g. a Redis error reply) is retried the same way: log
            # it, or a dataset that never makes progress would say nothing at all.
            log.exception("dataset %s: background work failed; retrying later", name)
            raise

    async def _retain(self, name: str) -> None:
        """Retention of a push dataset, until the service stops or it is deleted."""
        while not self._stop.is_set():
            try:
                spec = await describe_dataset(self.redis, name)
                await apply_retention(self.redis, spec, self.config.limits)
            except IngestError:
                return
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.config.maintenance_interval_s)
