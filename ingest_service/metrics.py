"""Prometheus metrics of the ingestion service, in a registry of their own.

Each app (and each test) gets its own ``CollectorRegistry``, so several apps in one
process do not collide on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["IngestMetrics"]


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.records = Counter(
            "trainguard_ingest_records", "Records appended to partitions", ["dataset"], registry=r
        )
        self.bytes = Counter(
            "trainguard_ingest_bytes", "Bytes of records appended", ["dataset"], registry=r
        )
        self.dead_letters = Counter(
            "trainguard_ingest_dead_letters", "Records sent to the dead-letter stream",
            ["dataset", "reason"], registry=r,
        )
        self.pauses = Counter(
            "trainguard_ingest_pauses", "Times a partition was paused by backpressure",
            ["dataset"], registry=r,
        )
        self.paused = Gauge(
            "trainguard_ingest_paused_partitions", "Partitions paused now", ["dataset"],
            registry=r,
        )
        self.backlog = Gauge(
            "trainguard_ingest_backlog_entries", "Untrimmed entries in a partition (XLEN)",
            ["dataset", "partition"], registry=r,
        )
        self.lag = Gauge(
            "trainguard_ingest_lag_entries", "Entries after the smallest committed offset",
            ["dataset", "partition"], registry=r,
        )
        self.lag_bytes = Gauge(
            "trainguard_ingest_lag_bytes", "Bytes after the smallest committed offset",
            ["dataset", "partition"], registry=r,
        )
        self.redis_losses = Counter(
            "trainguard_ingest_redis_losses",
            "Times Redis was found to have lost records (restart without data); refilled",
            ["dataset"], registry=r,
        )
        self.push_body_bytes = Gauge(
            "trainguard_ingest_push_body_bytes",
            "Bytes of push bodies held in memory now (bounded by max_inflight_bytes)",
            registry=r,
        )
        self.push_requests = Counter(
            "trainguard_ingest_push_requests", "Push requests by HTTP status",
            ["dataset", "status"], registry=r,
        )
