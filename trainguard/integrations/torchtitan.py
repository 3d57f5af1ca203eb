"""torchtitan: trainguard as a torchtitan job's data loader and its checkpoint storage.

::

    from trainguard.integrations.torchtitan import TrainguardDataLoader, checkpoint_manager

    loader = TrainguardDataLoader("redis://127.0.0.1:6379/0", dataset="tokens", run="llama",
                                  store="file:///ckpt/llama", batch_size=8)
    manager = checkpoint_manager(loader, CheckpointManager.Config(interval=50),
                                 model_parts=[model], optimizers=optimizers,
                                 lr_schedulers=lr_schedulers, states={"train_state": ts})
    manager.load()                      # the newest commit (or a fresh start)
    for step, batch in enumerate(loader, start=1 + ts.step):
        ...                             # one training step
        manager.save(step)

Two pieces, each in torchtitan's own shape:

- :class:`TrainguardDataLoader` is the job's data loader (torchtitan's ``BaseDataLoader``
  protocol: ``__iter__`` plus ``state_dict``/``load_state_dict``, which its
  ``CheckpointManager`` checkpoints under ``"dataloader"``). Its position is the
  session's: the offsets it consumed, committed in the same manifest as the weights.
  Its ``state_dict`` is small and the same on every rank (which run and dataset it
  reads, and the session-record version), so it survives a change of the data-parallel
  degree, which torchtitan's own ``ParallelAwareDataloader`` refuses ("dataloader
  resharding is not supported yet"): on resume the partitions are assigned anew to
  the new number of ranks and each reads on from the committed offsets.
- :func:`checkpoint_manager` makes torchtitan's ``CheckpointManager`` save through the
  session (``DcpCheckpointStore``: ``dcp.save`` with trainguard's ``StorageWriter``, the
  offsets committed with it) and load the newest commit (or the step asked) with
  trainguard's ``StorageReader``. torchtitan's ``step-N`` folders are not used: the
  store's manifests are the checkpoints, and the store's retention (``keep_last``)
  replaces ``keep_latest_k`` (ignored). The last step's save is a whole one like the
  others (``last_save_model_only`` is ignored). Async saves and HF-format saves are refused (say so in
  ``CheckpointManager.Config``); the HF initial load is torchtitan's own.

torchtitan fetches one batch per step and trains it before the next fetch, so a batch
is recorded as consumed when the loader hands it out. With several ranks, a rank whose
partitions run out first gets empty batches (zero rows) until every rank is out, so
that the ranks take the same steps (see :mod:`trainguard.integrations._ranks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from checkpoint_store.dcp_store import DcpCheckpointStore
from trainer_client import TrainingSession
from trainguard.integrations import _ranks
from trainguard.integrations._consumption import ConfirmedBatches
from trainguard.integrations._consumption import session_options as session_options_for

__all__ = ["STATE_FORMAT", "TrainguardDataLoader", "checkpoint_manager"]

STATE_FORMAT = "trainguard-torchtitan-dataloader"
_STATE_VERSION = 1


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TrainguardDataLoader:
    """The run's data as torchtitan's data loader (see the module). ``decode``/``collate``
    are those of ``TrainingSession.dataset``; ``num_workers`` the inner DataLoader's.
    Other keyword arguments go to ``TrainingSession``. Make it after
    ``torch.distributed`` is initialised: its rank and world size are the job's
    (the data-parallel ones: every rank of the job is a data-parallel rank)."""

    def __init__(self, redis_url: str, *, dataset: str, run: str, store: str, batch_size: int,
                 num_workers: int = 0, decode: Callable[[Any], Any] | None = None,
                 collate: Callable[[list[Any]], Any] | None = None,
                 **session_options: Any) -> None:
        self.run, self.dataset_name, self.store_url = run, dataset, store
        rank, world = _rank_world()
        options = session_options_for("torchtitan", session_options)
        self.session = TrainingSession(redis_url, dataset=dataset, run=run,
                                       store=DcpCheckpointStore(store), rank=rank,
                                       world_size=world, **options)
        self._reader = self.session.dataset(batch_size, decode=decode, collate=collate)
        self.num_workers = num_workers
        self._batches: ConfirmedBatches | None = None
        self.restored_step: int | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.restored_step is None:
            raise RuntimeError("TrainguardDataLoader iterated before the checkpoint manager's "
                               "load(): call manager.load() first (it restores the data "
                               "position, or starts the run fresh)")
        inner = DataLoader(self._reader, batch_size=None, num_workers=self.num_workers,
                           persistent_workers=self.num_workers > 0)
        if self._batches is not None:
            self._batches.close()
        self._batches = batches = ConfirmedBatches(self.session, inner)
        data: Iterator[Any] = (_ranks.in_step(batches) if self.session.world_size > 1
                               else (b.data for b in batches))
        for item in data:
            batches.confirm()  # torchtitan trains each batch it takes before the next
            yield item

    def state_dict(self) -> dict[str, Any]:
        """What torchtitan checkpoints for the loader: a reference, the same on every
        rank; the position itself is the offsets the session commits with it."""
        return {"format": STATE_FORMAT, "version": _STATE_VERSION, "run": self.run,
                "dataset": self.dataset_name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the loaded state belongs to this run (the session already moved the
        position to the checkpoint's offsets). An empty state is torchtitan's "none"."""
        if not state_dict:
            return
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"the checkpoint's dataloader state is not a trainguard one "
                             f"(found keys {sorted(state_dict)}): it was saved by another "
                             "data loader; resume it with that loader, or start a new run")
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"the checkpoint's dataloader state is of version "
                             f"{state_dict.get('version')}, this trainguard reads version "
                             f"{_STATE_VERSION}: upgrade trainguard")
        if state_dict.get("run") != self.run or state_dict.get("dataset") != self.dataset_name:
            raise ValueError(f"the checkpoint's dataloader read run {state_dict.get('run')!r} "
                             f"of dataset {state_dict.get('dataset')!r}, not run {self.run!r} "
                             f"of {self.dataset_name!r}: resume with the loader of that run")

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self.session.close()


def _step_of(checkpoint_id: str) -> int:
    found = re.search(r"step-(\d+)$", str(checkpoint_id).rstrip("/"))
    if found is None:
        raise ValueError(f"torchtitan checkpoint id {checkpoint_id!r} does not end in "
                         "'step-<N>': trainguard commits each checkpoint under its step")
    return int(found.group(1))


def checkpoint_manager(loader: TrainguardDataLoader, config: Any, **kwargs: Any) -> Any:
    """torchtitan's ``CheckpointManager`` of ``config``, with ``loader`` as its data
    loader, saving and loading through ``loader``'s session (see the module).
    ``kwargs`` are the manager's own (``model_parts``, ``optimizers``,
    ``lr_schedulers``, ``states``, ``sd_adapter``, ``base_folder``)."""
    from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

    if not getattr(config, "enable", True):
        raise ValueError("checkpoint.enable is False: nothing would commit the data position, "
                         "and a restart would train the records again; enable checkpointing")
    if str(getattr(config, "async_mode", "disabled")) not in ("disabled", AsyncMode.DISABLED):
        raise ValueError(f"checkpoint.async_mode={config.async_mode!r}: the trainguard manager "
                         "saves synchronously (the offsets commit with the save); set "
                         "async_mode='disabled'")
    if getattr(config, "last_save_in_hf", False):
        raise ValueError("checkpoint.last_save_in_hf=True: the trainguard manager commits "
                         "the whole state at the last step too; export the weights with "
                         "`trainguard ckpt export --key model`, and leave it False")
    session = loader.session

    class TrainguardCheckpointManager(CheckpointManager):  # type: ignore[misc]
        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> None:
            session.checkpoint(state_dict, _step_of(checkpoint_id), blocking=True)

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            if from_hf:
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
                return
            step = _step_of(checkpoint_id)
            got = session.restore(state_dict)
            if got != step:
                got = session.rollback(state_dict, to_step=step)
            if got != step:
                raise FileNotFoundError(f"run {loader.run!r} has no checkpoint of step {step} "
                                        f"in {loader.store_url}")
            loader.restored_step = got
            if MODEL in self.states:  # torchtitan flattens the model's state: load it back
                self.states[MODEL].load_state_dict(state_dict)

        def _find_load_step(self, folder: str = "") -> int:
            return max((m.step for m in session.checkpoints()), default=-1)

        def _load(self, step: int = -1) -> bool:
            load_step = self._find_load_step() if step == -1 else step
            if load_step == -1:
                if self.initial_load_path or self.initial_load_in_hf:
                    raise ValueError("initial_load_path / initial_load_in_hf with the "
                                     "trainguard manager: load the weights into the model "
                                     "before manager.load(), which starts the run fresh")
                loader.restored_step = session.restore({})  # takes the run; reads from 0
                return False
            states = self._states_to_load(model_only=False)
            self.dcp_load(states, self._create_checkpoint_id(load_step), False, False)
            return True

        def _save_last_step(self, curr_step: int) -> None:
            # The whole state, as every save: the last commit is the one a restart of a
            # longer run resumes (exports are `trainguard ckpt export`'s job).
            self.dcp_save(self._flattened_model_states_sd(),
                          self._create_checkpoint_id(curr_step), AsyncMode.DISABLED)

        def _should_purge(self) -> bool:
            return False  # the store's retention keeps what a kept manifest names

    return TrainguardCheckpointManager(config, dataloader=loader, **kwargs)
