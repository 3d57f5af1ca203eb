"""A plain Accelerate loop on one or several processes: the trainguard loader through
``accelerator.prepare``, and ``save_state``/``load_state`` that commit and restore the
consumed offsets with the weights, so that every record trains exactly once::

    from accelerate import Accelerator
    from trainguard.integrations.hf_accelerate import TrainguardAccelerate

    accelerator = Accelerator()          # sets up the process group (torchrun, accelerate launch)
    tg = TrainguardAccelerate(accelerator, "redis://127.0.0.1:6379/0", dataset="tokens",
                              run="gpt", store="file:///ckpt/gpt", batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, tg.dataloader())
    step = tg.load_state()               # the newest commit (0: a fresh run)
    for batch in loader:                 # this rank's batches, each recorded as taken
        ...                              # forward, accelerator.backward, opt.step
        step += 1
        if step % 50 == 0:
            tg.save_state(step)          # every rank: one commit, offsets of all ranks
    tg.save_state(step)
    tg.close()

- ``tg.dataloader()`` is a ``DataLoader`` of the session's batches, marked prepared:
  ``accelerator.prepare`` registers it and leaves it as it is. Accelerate would
  otherwise shard the stream a second time (``IterableDatasetShard`` keeps a slice of
  every ``world * batch_size`` records on each rank and pads the last slice with
  repeats) or dispatch rank 0's batches, although trainguard already gives each rank
  its own partitions. Move each batch to ``accelerator.device`` in the loop.
- A batch is recorded as consumed when the loop takes it: the loop trains what it
  takes (no fetch ahead, unlike Accelerate's own ``DataLoaderShard``).
- ``tg.save_state(step)`` commits, on every rank, what ``accelerator.save_state``
  saves (the prepared models, unwrapped, optimizers, schedulers and the objects given
  to ``register_for_checkpointing``) with the offsets of all ranks, in one commit.
  ``tg.load_state()`` restores the newest commit into them, in place. With
  ``output_dir`` both also write and read Accelerate's own folder; the commit wins
  (it is written after the folder, so a kill mid-folder leaves the commit before).
- Several processes: a rank out of data gets empty batches (zero rows) until every
  rank is out, so that all ranks take the same steps (the loss must be defined on an
  empty batch), and a restart may run on another number of processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from accelerate import Accelerator
from torch.utils.data import DataLoader

from trainer_client import TrainingSession
from trainguard.integrations import _ranks
from trainguard.integrations._consumption import ConfirmedBatches
from trainguard.integrations._consumption import session_options as session_options_for

__all__ = ["TrainguardAccelerate"]


class _SessionLoader(DataLoader[Any]):
    """The session's batches as a DataLoader that Accelerate takes as prepared. The
    batches are read by an inner DataLoader (this one's own iteration is replaced)."""

    def __init__(self, owner: TrainguardAccelerate, dataset: Any, num_workers: int) -> None:
        super().__init__(dataset, batch_size=None)
        self._owner = owner
        inner = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                           persistent_workers=num_workers > 0)
        self._batches = ConfirmedBatches(owner.session, inner)
        self._is_accelerate_prepared = True

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = self._batches
        data: Iterator[Any] = (_ranks.in_step(batches) if self._owner.session.world_size > 1
                               else (b.data for b in batches))
        for item in data:
            batches.confirm()  # the loop trains what it takes
            yield item

    def __len__(self) -> int:
        raise TypeError("a trainguard stream has no length: run the loop to its end")

    def close(self) -> None:
        self._batches.close()


class TrainguardAccelerate:
    """The session of one Accelerate run, its loader and its checkpoints (see the
    module). Other keyword arguments go to ``TrainingSession``."""

    def __init__(self, accelerator: Accelerator, redis_url: str, *, dataset: str, run: str,
                 store: str, batch_size: int, num_workers: int = 0,
                 decode: Callable[[Any], Any] | None = None,
                 collate: Callable[[list[Any]], Any] | None = None,
                 **session_options: Any) -> None:
        options = session_options_for("Accelerate", session_options)
        self.accelerator = accelerator
        self.session = TrainingSession(redis_url, dataset=dataset, run=run, store=store,
                                       rank=accelerator.process_index,
                                       world_size=accelerator.num_processes, **options)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.decode, self.collate = decode, collate
        self._loaders: list[_SessionLoader] = []

    def dataloader(self) -> DataLoader[Any]:
        """This rank's batches, for ``accelerator.prepare`` (which keeps it as it is)."""
        dataset = self.session.dataset(self.batch_size, decode=self.decode, collate=self.collate)
        loader = _SessionLoader(self, dataset, self.num_workers)
        self._loaders.append(loader)
        return loader

    def _state(self) -> dict[str, Any]:
        acc = self.accelerator
        state: dict[str, Any] = {}
        # Accelerate's own lists of what it prepared: what its save_state saves.
        for name, items in (("model", [acc.unwrap_model(m) for m in acc._models]),
                            ("optimizer", acc._optimizers), ("scheduler", acc._schedulers),
                            ("custom", acc._custom_objects)):
            for i, item in enumerate(items):
                state[f"{name}_{i}"] = item
        return state

    def save_state(self, step: int, output_dir: str | None = None) -> None:
        """Commit the run's state at ``step`` with the offsets (every rank calls it);
        with ``output_dir``, Accelerate's own folder first."""
        if output_dir is not None:
            self.accelerator.save_state(output_dir)
        self.session.checkpoint(self._state(), step, blocking=True)

    def load_state(self, input_dir: str | None = None) -> int:
        """Restore the newest commit in place (every rank calls it, after
        ``accelerator.prepare``); returns its step, 0 for a fresh run. With
        ``input_dir``, Accelerate's folder is loaded first and the commit over it."""
        if input_dir is not None:
            self.accelerator.load_state(input_dir)
        return self.session.restore(self._state())

    def close(self) -> None:
        for loader in self._loaders:
            loader.close()
        self.session.close()

