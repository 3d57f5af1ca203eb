"""Crash-consistent checkpoints of training state: Zarr v3 arrays + an atomic manifest.

```python
store = CheckpointStore("file:///ckpt/run42", keep_last=3)
handle = store.save({"model": model, "optim": opt, "step": 100}, step=100,
                    extra={"offsets": {...}}, blocking=False)
manifest = handle.wait()                       # durable and committed
store.load({"model": model, "optim": opt})     # newest valid checkpoint, in place
```
The on-disk format is documented in ``FORMAT.md`` (shipped with the package).
"""

from checkpoint_store.export import export_safetensors
from checkpoint_store.handle import SaveHandle
from checkpoint_store.manifest import FORMAT_VERSION, Manifest
from checkpoint_store.ram_tier import RamTierFullError, RamTierStore
from checkpoint_store.retention import GcReport
from checkpoint_store.shard import Shard, Shards
from checkpoint_store.store import CheckpointStore
from checkpoint_store.tiered import TieredCheckpointStore
from checkpoint_store.tiers import TierState, TierStatus, tier_statuses
from trainguard.core.checkpoints import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointStoreAPI,
    CheckpointWriteError,
    CommitConflictError,
    CorruptCheckpointError,
    DistributedSaveError,
    NoCheckpointError,
    PinnedCheckpointError,
    SaveInProgressError,
    StateMismatchError,
    UnsupportedValueError,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointStoreAPI",
    "CheckpointWriteError",
    "CheckpointExistsError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DistributedSaveError",
    "GcReport",
    "Manifest",
    "NoCheckpointError",
    "PinnedCheckpointError",
    "RamTierFullError",
    "RamTierStore",
    "SaveHandle",
    "SaveInProgressError",
    "Shard",
    "Shards",
    "StateMismatchError",
    "TierState",
    "TierStatus",
    "TieredCheckpointStore",
    "UnsupportedValueError",
    "export_safetensors",
    "tier_statuses",
]
