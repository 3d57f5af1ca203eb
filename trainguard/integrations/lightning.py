"""PyTorch Lightning: stream a trainguard dataset, checkpoint through trainguard, resume
with Lightning's own ``ckpt_path="last"``, and train every record exactly once.

::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from trainguard.integrations.lightning import TrainguardDataModule

    dm = TrainguardDataModule("redis://127.0.0.1:6379/0", dataset="tokens", run="gpt",
                              store="file:///ckpt/gpt", batch_size=16)
    trainer = L.Trainer(max_epochs=1, plugins=[dm.checkpoint_io],
                        callbacks=[dm.callback, ModelCheckpoint(dirpath="ckpt/lightning",
                                                                every_n_train_steps=50,
                                                                save_last=True)])
    trainer.fit(model, datamodule=dm, ckpt_path="last")

Three pieces, each in Lightning's own shape:

- :class:`TrainguardDataModule` makes the :class:`~trainer_client.TrainingSession`
  and serves ``train_dataloader()``: the records' ``data`` (a ``[batch, ...]`` tensor
  for token records) read through ``StreamingDataset``.
- :class:`TrainguardCheckpointIO` is where ``ModelCheckpoint`` (and
  ``trainer.save_checkpoint``) writes: Lightning's whole checkpoint dict is saved
  through the session, so the consumed offsets are committed in the same manifest as
  the weights, optimizer and loop state. The ``.ckpt`` file Lightning sees is a small
  marker naming that commit, written only after it: ``last.ckpt``, top-k rotation and
  ``ckpt_path="last"`` work as usual, and loading a marker restores the commit it
  names, offsets included.
- :class:`TrainguardCallback` confirms each batch as Lightning starts training it:
  Lightning fetches one batch ahead, and a fetched batch is not a trained one.

A fresh ``fit`` on a run that already has checkpoints is refused (the weights would
start over while the data would not): pass ``ckpt_path="last"``, or a new run name.
Single process only: a multi-process strategy (DDP) is refused with an error. One
Lightning epoch is one pass over the stream (for a finite dataset, all of it).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import lightning.pytorch as pl
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.utils.data import DataLoader

from trainer_client import TrainingSession
from trainguard.integrations._consumption import ConfirmedBatches
from trainguard.integrations._consumption import session_options as session_options_for

__all__ = ["MARKER_FORMAT", "TrainguardCallback", "TrainguardCheckpointIO", "TrainguardDataModule"]

MARKER_FORMAT = "trainguard-lightning-checkpoint"
_MARKER_VERSION = 1
_STATE_KEY = "lightning"


class _Received:
    """A state entry that takes whatever a checkpoint holds: the store loads the saved
    dict (creating its tensors) and hands it to ``load_state_dict``."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class _Data:
    """``train_dataloader()``'s value: iterates the confirmed batches' data."""

    def __init__(self, batches: ConfirmedBatches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return (b.data for b in self.batches)


class TrainguardDataModule(pl.LightningDataModule):
    """The run's data and its session. ``decode``/``collate`` are those of
    ``TrainingSession.dataset``; ``num_workers`` the DataLoader's (0: read in the
    training process). Other keyword arguments go to ``TrainingSession``."""

    def __init__(self, redis_url: str, *, dataset: str, run: str, store: str, batch_size: int,
                 num_workers: int = 0, decode: Callable[[Any], Any] | None = None,
                 collate: Callable[[list[Any]], Any] | None = None,
                 **session_options: Any) -> None:
        super().__init__()
        self.redis_url, self.dataset_name, self.run, self.store = redis_url, dataset, run, store
        self.batch_size, self.num_workers = batch_size, num_workers
        self.decode, self.collate = decode, collate
        self._options = session_options_for("Lightning", session_options)
        self._session: TrainingSession | None = None
        self._restored: int | None = None
        self._batches: ConfirmedBatches | None = None
        self.checkpoint_io = TrainguardCheckpointIO(self)
        self.callback = TrainguardCallback(self)

    @property
    def session(self) -> TrainingSession:
        if self._session is None:
            self._session = TrainingSession(self.redis_url, dataset=self.dataset_name,
                                            run=self.run, store=self.store, **self._options)
        return self._session

    @property
    def restored_step(self) -> int | None:
        """The step of the checkpoint the run resumed from (0: a fresh run), once known."""
        return self._restored

    def _restore(self, step: int | None) -> dict[str, Any] | None:
        """Restore the session (offsets, fence) from checkpoint ``step`` (None: a fresh
        run, refused when the run has checkpoints); returns Lightning's checkpoint dict."""
        session = self.session
        if step is None:
            existing = session.checkpoints()
            # A step-0 commit (see TrainguardCallback.on_train_start) consumed nothing:
            # starting over it loses nothing.
            if existing and existing[0].step > 0:
                raise RuntimeError(
                    f"run {self.run!r} has committed checkpoints (newest: step "
                    f"{existing[0].step}) but this fit starts from scratch: resume with "
                    "trainer.fit(..., ckpt_path='last') (ModelCheckpoint(save_last=True)), or "
                    "train under a new run name"
                )
        received = _Received()
        state = {_STATE_KEY: received}
        got = session.restore(state) if self._restored is None else None
        if step is not None and got != step:
            got = session.rollback(state, to_step=step)
        self._restored = got if got is not None else self._restored
        return received.loaded

    def train_dataloader(self) -> Any:
        if self._restored is None:
            self._restore(None)
        loader = DataLoader(self.session.dataset(self.batch_size, decode=self.decode,
                                                 collate=self.collate),
                            batch_size=None, num_workers=self.num_workers,
                            persistent_workers=self.num_workers > 0)
        if self._batches is not None:
            self._batches.close()
        self._batches = ConfirmedBatches(self.session, loader)
        return _Data(self._batches)

    def confirm(self) -> None:
        if self._batches is not None:
            self._batches.confirm()

    def teardown(self, stage: str) -> None:
        # The session stays open: trainer.save_checkpoint may still commit after fit.
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def close(self) -> None:
        """Release the session (its connections; the store when it made it)."""
        self.teardown("close")
        if self._session is not None:
            self._session.close()
            self._session = None
        self._restored = None


class TrainguardCallback(pl.Callback):
    """Confirms each batch as training starts on it; refuses multi-process runs."""

    def __init__(self, datamodule: TrainguardDataModule) -> None:
        self.datamodule = datamodule

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise RuntimeError(
                f"the trainguard Lightning integration is single-process; this Trainer runs "
                f"{trainer.world_size} processes: use TrainingSession directly for multi-rank runs"
            )
        if not isinstance(trainer.strategy.checkpoint_io, TrainguardCheckpointIO):
            raise RuntimeError("pass plugins=[datamodule.checkpoint_io] to the Trainer: "
                               "checkpoints must go through trainguard to commit the offsets")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fresh run commits its step-0 state and marks it ``last.ckpt`` before the
        first step. A run killed between its first commit and that commit's marker
        then still finds a ``last`` to resume from; and a step-0 commit without a
        marker consumed nothing, so a fresh fit may start over it."""
        checkpoint = trainer.checkpoint_callback
        dirpath = getattr(checkpoint, "dirpath", None)
        if self.datamodule.restored_step == 0 and trainer.global_step == 0 and dirpath:
            name = f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"  # type: ignore[union-attr]
            trainer.save_checkpoint(posixpath.join(str(dirpath), name))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self.datamodule.confirm()


class TrainguardCheckpointIO(CheckpointIO):
    """Lightning checkpoints as trainguard commits, with a marker file at the path."""

    def __init__(self, datamodule: TrainguardDataModule) -> None:
        self.datamodule = datamodule
        self._saved_step: int | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        dm = self.datamodule
        step = int(checkpoint["global_step"])
        # ModelCheckpoint saves top-k and last.ckpt at the same step: one commit, two markers.
        if step != self._saved_step:
            dm.session.checkpoint({_STATE_KEY: checkpoint}, step, blocking=True)
            self._saved_step = step
        marker = {"format": MARKER_FORMAT, "version": _MARKER_VERSION, "run": dm.run,
                  "dataset": dm.dataset_name, "store": dm.store, "step": step}
        fs, _, (target,) = fsspec.get_fs_token_paths(str(path))
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        tmp = f"{target}.{uuid.uuid4().hex}.tmp"
        fs.pipe_file(tmp, json.dumps(marker).encode())
        fs.mv(tmp, target)  # after the commit, whole: a marker never names a lost save

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        dm = self.datamodule
        try:
            with fsspec.open(str(path), "rb") as f:
                marker = json.loads(f.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a trainguard checkpoint marker (a torch .ckpt?): "
                             "resume it without the trainguard plugin, or start a new run") from exc
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
            raise ValueError(f"{path} is not a trainguard checkpoint marker")
        if marker.get("run") != dm.run or marker.get("dataset") != dm.dataset_name:
            raise ValueError(f"{path} belongs to run {marker.get('run')!r} of dataset "
                             f"{marker.get('dataset')!r}, not run {dm.run!r} of {dm.dataset_name!r}")
        loaded = dm._restore(int(marker["step"]))
        if loaded is None:
            raise FileNotFoundError(f"{path} names step {marker['step']} of run {dm.run!r}, "
                                    f"which the store {dm.store} does not hold")
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        # The marker only: the store keeps (and retires) the commits themselves.
        fs, _, (target,) = fsspec.get_fs_token_paths(str(path))
        if fs.exists(target):
            fs.rm(target)

    def teardown(self) -> None:
        self._saved_step = None
