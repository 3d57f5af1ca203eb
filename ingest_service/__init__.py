"""trainguard's ingestion service: datasets from files or HTTP push into Redis streams.

The stream layout it writes is ``trainguard.streams`` (shared with the trainer client).
Modules: ``datasets`` (registry), ``sources`` and ``planner`` (what goes where),
``producer`` (exactly-once appends, backpressure, retention, dead letters), ``push``
(HTTP push ingestion), ``app`` (the aiohttp service), ``cli`` (``trainguard ingest`` and
``trainguard serve``).

The names below load on first use, so that ``import ingest_service.cli`` (done by every
``trainguard`` command) stays cheap; importing this package imports none of aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest_service.datasets import (
        create_dataset,
        delete_dataset,
        describe_dataset,
        list_datasets,
    )
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

_HOME = {
    "create_dataset": "datasets",
    "delete_dataset": "datasets",
    "describe_dataset": "datasets",
    "list_datasets": "datasets",
    "DatasetExistsError": "errors",
    "DatasetNotFoundError": "errors",
    "IngestError": "errors",
    "Producer": "producer",
    "ProducerProgress": "producer",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ingest_service' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ingest_service.{home}"), name)
