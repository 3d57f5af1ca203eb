"""trainguard: keeps long training runs alive through crashes.

The three parts live in their own packages: ``ingest_service`` (datasets into Redis
streams), ``checkpoint_store`` (crash-consistent Zarr v3 checkpoints) and
``trainer_client`` (the IterableDataset and the session that commits offsets inside
checkpoints). This package holds the floor below them, :mod:`trainguard.core` (the
stream contract, the session record, the checkpoint port, settings, resilience), and
the floor above them, :mod:`trainguard.ops` (the ``trainguard`` command, the demo,
the service process). ARCHITECTURE.md draws the layers.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainguard")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
