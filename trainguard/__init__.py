"""trainguard: keeps long training runs alive through crashes.

The three parts live in their own packages: ``ingest_service`` (datasets into Redis
streams), ``checkpoint_store`` (crash-consistent Zarr v3 checkpoints) and
``trainer_client`` (the IterableDataset and the session that commits offsets inside
checkpoints). This package holds what they share: the stream contract
(:mod:`trainguard.streams`) and the ``trainguard`` command line.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainguard")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
