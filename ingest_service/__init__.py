"""trainguard's ingestion service: datasets from files or HTTP push into Redis streams.

The stream layout it writes is ``trainguard.streams`` (shared with the trainer client).
Modules: ``datasets`` (registry), ``sources`` and ``planner`` (what goes where),
``producer`` (exactly-once appends, backpressure, retention, dead letters), ``push``
(HTTP push ingestion), ``app`` (the aiohttp service), ``cli`` (``trainguard ingest`` and
``trainguard serve``). Importing this package imports none of aiohttp.
"""

from ingest_service.datasets import create_dataset, delete_dataset, describe_dataset, list_datasets
from ingest_service.errors import DatasetExistsError, DatasetNotFoundError, IngestError
from ingest_service.producer import Producer, ProducerProgress

__all__ = [
    "create_dataset",
    "delete_dataset",
    "describe_dataset",
    "list_datasets",
    "DatasetExistsError",
    "DatasetNotFoundError",
    "IngestError",
    "Producer",
    "ProducerProgress",
]
