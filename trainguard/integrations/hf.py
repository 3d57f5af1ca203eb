"""Hugging Face: a ``transformers.Trainer`` callback with its dataset glue, and what an
Accelerate loop needs, so that every record trains exactly once across kills.

::

    from transformers import Trainer, TrainingArguments
    from trainguard.integrations.hf import TrainguardHF

    tg = TrainguardHF("redis://127.0.0.1:6379/0", dataset="tokens", run="gpt",
                      store="file:///ckpt/gpt", batch_size=16)
    args = TrainingArguments("out", per_device_train_batch_size=16, max_steps=500,
                             save_steps=50, ignore_data_skip=True, report_to=[])
    trainer = tg.attach(Trainer(model=model, args=args, train_dataset=tg.train_dataset,
                                callbacks=[tg.callback]))
    trainer.train(resume_from_checkpoint=tg.last_checkpoint(args.output_dir))

- ``tg.train_dataset`` is a torch ``IterableDataset`` of the records, each as a dict
  (``{"input_ids": tensor}`` for token records, ``{"input_ids", "labels"}`` with
  ``labels=True``; or what ``decode`` returns), read through ``StreamingDataset`` in
  batches of ``batch_size``, which must be the Trainer's per-device batch size: one
  Trainer batch is then one trainguard batch.
- ``tg.callback`` confirms batches after each optimizer step (the Trainer and
  Accelerate fetch ahead), commits a trainguard checkpoint in ``on_save`` (model,
  optimizer, scheduler and step, with the offsets) after the Trainer wrote its own
  ``checkpoint-N`` folder, and restores the newest commit in ``on_train_begin``, in
  place, over whatever the Trainer loaded: weights and data position always come
  from one commit.
- ``tg.last_checkpoint(output_dir)`` is the Trainer's own ``checkpoint-N`` folder of
  that commit, for ``resume_from_checkpoint``: complete (the commit comes after the
  folder is written), where the newest folder may be torn by a kill.

- ``tg.attach(trainer)`` makes the Trainer train the session's batches as they are
  (its ``get_train_dataloader``): Accelerate would otherwise shard the stream again
  across processes (``IterableDatasetShard``: each rank keeps a slice of every
  ``world * batch_size`` records and pads the last with repeats) although trainguard
  already gave each rank its own partitions. Needed for several processes; with one
  it also ends a finite stream's run cleanly (the epoch ends with the data).

Several processes (``torchrun``/``accelerate launch``, DDP): the session is made on
first use with the process group's rank and world size, each rank reads its own
partitions, every rank commits in ``on_save`` (the offsets of all ranks end in one
manifest), and a restart may run on another number of processes. A rank out of data
trains empty batches (zero rows) until every rank is out, so that all ranks take the
same steps: the model's loss must be defined (and reach every parameter) on an empty
batch. The run's last step is committed in ``on_train_end``.

Needs ``ignore_data_skip=True`` (the stream resumes itself: skipping batches would
lose records) and ``dataloader_num_workers=0`` (``num_workers`` here sets the
reading workers).

An Accelerate loop needs no glue (``examples/accelerate_gpt.py``): prepare the model
and optimizer, not the trainguard loader, and iterate ``session.batches(loader)``.
:class:`ConfirmedBatches` is exported for loops that must let a framework fetch
ahead: ``confirm()`` each batch once it is trained.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainer_client import TrainingSession
from trainguard.integrations import _ranks
from trainguard.integrations._consumption import ConfirmedBatches
from trainguard.integrations._consumption import session_options as session_options_for
from trainguard.integrations._logged import scalars

__all__ = ["ConfirmedBatches", "TrainguardCallback", "TrainguardHF", "TrainguardIterable"]


def _token_record(labels: bool) -> Callable[[Any], dict[str, Any]]:
    def decode(record: Any) -> dict[str, Any]:
        import torch

        ids = torch.tensor(record, dtype=torch.long)  # a copy: the record is a read-only view
        return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}

    return decode


class TrainguardIterable(IterableDataset[Any]):
    """The records of the run's stream, one by one, for the Trainer's DataLoader."""

    def __init__(self, owner: TrainguardHF) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[Any]:
        for batch in self.owner.batches():
            yield from batch.data


class TrainguardHF:
    """The session, the dataset and the callback of one run (see the module)."""

    def __init__(self, redis_url: str, *, dataset: str, run: str, store: str, batch_size: int,
                 num_workers: int = 0, labels: bool = True,
                 decode: Callable[[Any], Any] | None = None, **session_options: Any) -> None:
        self._options = session_options_for("Hugging Face", session_options)
        self.redis_url, self.dataset_name, self.run, self.store = redis_url, dataset, run, store
        self._session: TrainingSession | None = None
        self._attached = False
        self.batch_size, self.num_workers = batch_size, num_workers
        self.decode = decode or _token_record(labels)
        self.train_dataset = TrainguardIterable(self)
        self.callback = TrainguardCallback(self)
        self.restored_step: int | None = None
        self._batches: ConfirmedBatches | None = None

    @property
    def session(self) -> TrainingSession:
        """The run's session, one per process: made on first use, with the rank and
        world size of the process group the Trainer's arguments set up (one process
        without one)."""
        if self._session is None:
            import torch.distributed as dist

            rank, world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                           else (0, 1))
            self._session = TrainingSession(self.redis_url, dataset=self.dataset_name,
                                            run=self.run, store=self.store, rank=rank,
                                            world_size=world, **self._options)
        return self._session

    def attach(self, trainer: Any) -> Any:
        """Make ``trainer`` train this run's batches as the session hands them (see the
        module): its ``get_train_dataloader`` returns them, unsharded by Accelerate.
        Adds the callback when the Trainer lacks it. Returns the trainer."""
        if self.callback not in trainer.callback_handler.callbacks:
            trainer.add_callback(self.callback)
        trainer.get_train_dataloader = self._train_batches
        self._attached = True
        return trainer

    def _train_batches(self) -> _TrainBatches:
        return _TrainBatches(self)

    def batches(self) -> ConfirmedBatches:
        if self.restored_step is None:
            raise RuntimeError("the trainguard dataset was iterated before the Trainer started "
                               "training: pass callbacks=[tg.callback] to the Trainer")
        if self._batches is None:
            collate = _collate if self._attached else None
            loader = DataLoader(self.session.dataset(self.batch_size, decode=self.decode,
                                                     collate=collate),
                                batch_size=None, num_workers=self.num_workers,
                                persistent_workers=self.num_workers > 0)
            self._batches = ConfirmedBatches(self.session, loader)
        return self._batches

    def last_checkpoint(self, output_dir: str) -> str | None:
        """``output_dir/checkpoint-N`` for the newest trainguard commit's step N, when
        that folder exists (else None: the callback restores the commit anyway)."""
        for manifest in self.session.checkpoints():
            folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{manifest.step}")
            return folder if os.path.isdir(folder) else None
        return None

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        if self._session is not None:
            self._session.close()
            self._session = None


def _collate(records: list[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(records)


class _TrainBatches:
    """The attached Trainer's training loader: the session's batches (see attach).
    No ``__len__``: the Trainer runs it to ``max_steps`` or to the end of the data."""

    def __init__(self, owner: TrainguardHF) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[Any]:
        owner = self.owner
        batches = owner.batches()
        if owner.session.world_size == 1:
            return (b.data for b in batches)
        # A rank with no batch of its own yet is handed an empty one shaped like a
        # decoded record of the dataset's sample length.
        length = owner.session.spec.sample_len
        empty = None
        if length:
            import numpy as np

            empty = _ranks.empty_like(_collate([owner.decode(np.zeros(length, np.int64))]))
        return _ranks.in_step(batches, empty)


def _state(kwargs: dict[str, Any], step: int) -> dict[str, Any]:
    state: dict[str, Any] = {"model": kwargs["model"], "trainer": {"global_step": step}}
    for key, name in (("optimizer", "optimizer"), ("lr_scheduler", "scheduler")):
        if kwargs.get(key) is not None:
            state[name] = kwargs[key]
    return state


class TrainguardCallback(TrainerCallback):
    """Restore in ``on_train_begin``, confirm in ``on_step_end``, commit in ``on_save``."""

    def __init__(self, owner: TrainguardHF) -> None:
        self.owner = owner
        self.committed: int | None = None  # the step of the newest commit, once known

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        problems = []
        if not args.ignore_data_skip:
            problems.append("ignore_data_skip=True (the stream resumes itself; skipping "
                            "batches would lose records)")
        if args.dataloader_num_workers:
            problems.append("dataloader_num_workers=0 (set num_workers on TrainguardHF)")
        if args.per_device_train_batch_size != self.owner.batch_size:
            problems.append(f"per_device_train_batch_size={self.owner.batch_size} (the "
                            "TrainguardHF batch_size)")
        if args.world_size > 1 and not self.owner._attached:
            problems.append(f"tg.attach(trainer) for its {args.world_size} processes (else "
                            "Accelerate shards the stream again, dropping and repeating records)")
        if problems:
            raise ValueError("the trainguard callback needs " + "; ".join(problems))
        owner = self.owner
        if owner.restored_step is None:
            owner.restored_step = owner.session.restore(_state(kwargs, state.global_step))
            # The commit's step wins over whatever folder the Trainer resumed from.
            state.global_step = owner.restored_step
            self.committed = owner.restored_step

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        batches = self.owner._batches
        if batches is not None:
            for _ in range(min(args.gradient_accumulation_steps, batches.unconfirmed)):
                batches.confirm()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Forward what the Trainer logs (loss, learning_rate, grad_norm...) to the run
        page (``session.log``), every ``logging_steps``."""
        values = scalars(logs)
        if values and self.owner.restored_step is not None:
            self.owner.session.log(state.global_step, **values)

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> None:
        self.owner.session.checkpoint(_state(kwargs, state.global_step), state.global_step,
                                      blocking=True)
        self.committed = state.global_step

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        # A run whose data ended before max_steps (or between save_steps) would leave
        # its last steps uncommitted: a restart would train them again.
        if self.owner.restored_step is not None and self.committed != state.global_step:
            self.on_save(args, state, control, **kwargs)
