"""``python -m ingest_service``: the same as ``trainguard serve``."""

from __future__ import annotations

import argparse

from ingest_service.cli import add_serve_arguments, run_serve

parser = argparse.ArgumentParser(prog="python -m ingest_service", description="Run the ingestion service.")
add_serve_arguments(parser)
raise SystemExit(run_serve(parser.parse_args()))
