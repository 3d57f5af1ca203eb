"""The service process: ingest (push, producers) and admin routes in one aiohttp app.

``trainguard serve`` runs it until SIGINT or SIGTERM. Shutdown order: the listening
socket closes first, requests in flight finish (their appends are what was
acknowledged), then the producers finish the batches they handed to Redis and stop,
then the Redis clients close (see :mod:`ingest_service.app`). Imported by the command
when it runs, not when the parser is built.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ingest_service.app import create_app
from ingest_service.config import IngestConfig

__all__ = ["serve"]

log = logging.getLogger("trainguard.serve")


def serve(config: IngestConfig) -> int:
    """Run the service until SIGINT/SIGTERM; returns the exit code (0 on a clean stop)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(
        create_app(config), host=config.host, port=config.port,
        shutdown_timeout=config.shutdown_timeout_s, print=lambda msg: log.info("%s", msg),
    )
    return 0
