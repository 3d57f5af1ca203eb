"""trainguard's ingestion service: datasets from files or HTTP push into Redis streams.

The stream layout it writes is :mod:`trainguard.core.streams` (shared with the trainer
client). Wings over a shared floor (``datasets``, ``errors``, ``metrics``,
``redis_client``, ``backlog``, ``inspection``, ``seek``, the wire code): ``sources``
(what records there are and where each goes), ``producer`` (exactly-once appends,
backpressure, leases, dead letters), ``push`` (HTTP push ingestion's core) and
``service`` (the aiohttp app, its routes, admin API and dashboard). The
``trainguard ingest`` and ``serve`` commands are the operations layer's
(:mod:`trainguard.ops`).
"""

from ingest_service.datasets import (
    create_dataset,
    delete_dataset,
    describe_dataset,
    list_datasets,
)
from ingest_service.errors import DatasetExistsError, DatasetNotFoundError, IngestError
from ingest_service.producer.producer import Producer, ProducerProgress

__all__ = [
    "DatasetExistsError",
    "DatasetNotFoundError",
    "IngestError",
    "Producer",
    "ProducerProgress",
    "create_dataset",
    "delete_dataset",
    "describe_dataset",
    "list_datasets",
]
