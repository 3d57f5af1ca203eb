"""trainguard's ingestion service: datasets from files or HTTP push into Redis streams.

The stream layout it writes is :mod:`trainguard.core.streams` (shared with the trainer
client). Modules: ``datasets`` (registry), ``sources`` and ``planner`` (what goes
where), ``producer`` (exactly-once appends, backpressure, retention, dead letters),
``push``, ``push_body``, ``push_route`` and ``auth`` (HTTP push ingestion and who may
push), ``app`` (the aiohttp application: push, health,
metrics and the admin routes of ``admin``), ``inspection`` and ``seek`` (what the admin
API and the CLI read and move). The ``trainguard ingest`` and ``serve`` commands are
the operations layer's (:mod:`trainguard.ops`).
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
