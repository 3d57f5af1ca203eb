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
  names, offsets included (see "Which commit a marker resumes" below).
- :class:`TrainguardCallback` confirms each batch as Lightning starts training it:
  Lightning fetches one batch ahead, and a fetched batch is not a trained one.

Which commit a marker resumes. A kill between a commit and its marker leaves
``last.ckpt`` naming the commit before; a ``last`` marker therefore resumes the newest
commit of its lineage (the commit it names, or one made after it: see
:mod:`trainguard.integrations._lineage`), never an older one, so nothing committed is
thrown away and no second lineage starts. Any other marker (a top-k file, a path given
to ``trainer.save_checkpoint``) resumes exactly its own commit. At the start of each
fit the commit it resumed is marked ``last`` again (and, when it is not the newest
commit, committed again first), so the commit ``last.ckpt`` names is always one of the
two newest: retention keeps it until a newer marker exists, which is why
``keep_last`` must be at least 2.

A fresh ``fit`` on a run that already has checkpoints is refused (the weights would
start over while the data would not): pass ``ckpt_path="last"``, or a new run name.
Several processes: ``strategy="ddp"`` (any ``DDPStrategy``; others, which shard the
state differently, are refused). Each rank reads its own partitions, every rank
commits with each checkpoint (the offsets of all ranks end in one manifest; rank 0
writes the marker), and a restart may run on another number of processes: the
partitions are assigned anew and every record is still trained once. A rank whose
partitions run out first trains empty batches (zero rows) until every rank is out, so
that all ranks take the same steps: ``training_step`` must run on an empty batch (a
zero loss that still reaches every parameter, for DDP's gradient all-reduce). One
Lightning epoch is one pass over the stream (for a finite dataset, all of it).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import lightning.pytorch as pl
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from trainer_client import TrainingSession
from trainguard.integrations import _lineage, _ranks
from trainguard.integrations._consumption import ConfirmedBatches
from trainguard.integrations._consumption import session_options as session_options_for
from trainguard.integrations._logged import scalars

__all__ = ["MARKER_FORMAT", "TrainguardCallback", "TrainguardCheckpointIO", "TrainguardDataModule"]

MARKER_FORMAT = "trainguard-lightning-checkpoint"
_MARKER_VERSION = 2
_STATE_KEY = "lightning"
_ID_KEY = "trainguard_commit"
"""Lightning's checkpoint dict carries its commit's id here: a load knows which
commit it got (a damaged newest one falls back to the one before)."""


@dataclass(frozen=True)
class _Start:
    """The commit a fit resumed: its id, and what its start must redo (see the module)."""

    commit: str | None
    step: int
    newest: bool  # the newest commit by commit time (the order retention keeps)
    marked: bool  # the marker it was loaded from is a ``last`` marker naming it


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
        if self.batches.session.world_size > 1:
            return _ranks.in_step(self.batches)
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
        if int(self._options.get("keep_last", 3)) < 2:
            raise ValueError(
                f"keep_last={self._options['keep_last']}: the Lightning integration needs "
                "keep_last >= 2, because last.ckpt names the previous commit until the "
                "marker of the newest one is written (a kill in between must find it)"
            )
        self._session: TrainingSession | None = None
        self._restored: int | None = None
        self._start: _Start | None = None
        self._batches: ConfirmedBatches | None = None
        self.checkpoint_io = TrainguardCheckpointIO(self)
        self.callback = TrainguardCallback(self)

    @property
    def session(self) -> TrainingSession:
        """The run's session, one per rank: made on first use, once the Trainer's
        processes are set up (its rank and world size are the Trainer's)."""
        if self._session is None:
            trainer = self.trainer
            rank, world = (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)
            self._session = TrainingSession(self.redis_url, dataset=self.dataset_name,
                                            run=self.run, store=self.store, rank=rank,
                                            world_size=world, **self._options)
        return self._session

    @property
    def restored_step(self) -> int | None:
        """The step of the checkpoint the run resumed from (0: a fresh run), once known."""
        return self._restored

    def _restore(self) -> None:
        """A fresh run (no marker): restore the session, refused when the run has
        checkpoints that consumed data."""
        session = self.session
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
        self._restored = session.restore({_STATE_KEY: _Received()})

    def _resume(self, marker: dict[str, Any], path: Any) -> dict[str, Any]:
        """Restore the session from the commit ``marker`` resumes (module docstring);
        returns Lightning's checkpoint dict of it."""
        session = self.session
        candidates = session.checkpoints()
        target = _lineage.pick(marker, candidates)
        if target is None:
            raise FileNotFoundError(
                f"{path} names step {marker['step']} of run {self.run!r}, but the store "
                f"{self.store} holds neither that commit nor one made after it: resume "
                "from another marker, or train under a new run name")
        want, _ = _lineage.lineage_of(target)
        received = _Received()
        state = {_STATE_KEY: received}
        got = session.restore(state) if self._restored is None else None
        if got != target.step or _commit_of(received.loaded) != want:
            got = session.rollback(state, to_step=target.step)
        if received.loaded is None or _commit_of(received.loaded) != want:
            raise RuntimeError(
                f"{path} resumes commit {want} (step {target.step}) of run {self.run!r}, "
                f"but loading step {target.step} gave commit {_commit_of(received.loaded)} "
                "(another commit of that step ranks first): resume from another marker")
        self._restored = got
        newest = max(m.uid for m in candidates) == target.uid
        marked = bool(marker.get("last")) and marker.get("commit") == want
        self._start = _Start(want, target.step, newest, marked)
        self.checkpoint_io.resumed(self._start)
        loaded = dict(received.loaded)
        loaded.pop(_ID_KEY, None)
        return loaded

    def train_dataloader(self) -> Any:
        if self._restored is None:
            self._restore()
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
        self._start = None


def _commit_of(loaded: dict[str, Any] | None) -> str | None:
    value = None if loaded is None else loaded.get(_ID_KEY)
    return value if isinstance(value, str) else None


def _mark_last(trainer: pl.Trainer) -> None:
    """Save a checkpoint to ``ModelCheckpoint``'s ``last`` file, and tell it so: else
    it finds a ``last.ckpt`` it did not write and versions its own (``last-v1.ckpt``),
    leaving two ``last`` markers that Lightning tells apart by modification time."""
    checkpoint = trainer.checkpoint_callback
    # Without save_last no one would update the file: it would name this commit until
    # retention dropped it.
    if (not isinstance(checkpoint, ModelCheckpoint) or not checkpoint.dirpath
            or not checkpoint.save_last):
        return
    name = f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
    path = checkpoint.last_model_path or posixpath.join(str(checkpoint.dirpath), name)
    trainer.save_checkpoint(path)
    checkpoint.last_model_path = path


class TrainguardCallback(pl.Callback):
    """Confirms each batch as training starts on it; several processes: DDP only."""

    def __init__(self, datamodule: TrainguardDataModule) -> None:
        self.datamodule = datamodule

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            if not isinstance(trainer.strategy, DDPStrategy):
                raise RuntimeError(
                    f"the trainguard Lightning integration runs several processes with DDP "
                    f"only; this Trainer's strategy is {type(trainer.strategy).__name__}: use "
                    "strategy='ddp', or TrainingSession directly (Shard blocks) for sharded state"
                )
            _ranks.save_on_every_rank(trainer)
        if not isinstance(trainer.strategy.checkpoint_io, TrainguardCheckpointIO):
            raise RuntimeError("pass plugins=[datamodule.checkpoint_io] to the Trainer: "
                               "checkpoints must go through trainguard to commit the offsets")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fresh run commits its step-0 state and marks it ``last.ckpt`` before the
        first step. A run killed between its first commit and that commit's marker
        then still finds a ``last`` to resume from; and a step-0 commit without a
        marker consumed nothing, so a fresh fit may start over it.

        A resumed run marks the commit it resumed ``last`` unless its marker already
        did (a ``last`` marker one commit behind, or another marker), and commits it
        again first when it is not the newest commit: the commit ``last.ckpt`` names
        is then one of the two newest, which retention keeps (``keep_last >= 2``)."""
        dm = self.datamodule
        start = dm._start
        if start is None:
            if dm.restored_step == 0 and trainer.global_step == 0:
                _mark_last(trainer)
            return
        if not start.newest:
            dm.checkpoint_io.resumed(None)  # a new commit of the resumed state
        if not (start.newest and start.marked):
            _mark_last(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self.datamodule.confirm()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Forward the step's loss and what the module logged (``self.log``) to the
        run page (``session.log``)."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        values = scalars({"loss": loss} if loss is not None else None,
                         trainer.callback_metrics)
        if values:
            self.datamodule.session.log(trainer.global_step, **values)


class TrainguardCheckpointIO(CheckpointIO):
    """Lightning checkpoints as trainguard commits, with a marker file at the path."""

    def __init__(self, datamodule: TrainguardDataModule) -> None:
        self.datamodule = datamodule
        # (step, commit id) of the newest commit: markers at that step name it.
        self._saved: tuple[int, str] | None = None
        # The commits since (and with) the one the last ``last`` marker names.
        self._lineage: list[str] = []

    def resumed(self, start: _Start | None) -> None:
        """The fit resumed ``start`` (None: forget it, so the next save commits)."""
        if start is None or start.commit is None:
            self._saved = None
            return
        self._saved = (start.step, start.commit)
        self._lineage = [start.commit]

    def _last_name(self) -> str:
        trainer = getattr(self.datamodule, "trainer", None)
        checkpoint = getattr(trainer, "checkpoint_callback", None) if trainer else None
        return str(getattr(checkpoint, "CHECKPOINT_NAME_LAST", "last") or "last")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        dm = self.datamodule
        step = int(checkpoint["global_step"])
        # ModelCheckpoint saves top-k and last.ckpt at the same step: one commit, two markers.
        if self._saved is None or self._saved[0] != step:
            commit = uuid.uuid4().hex
            if dm.session.world_size > 1:
                commit = _ranks.same_on_every_rank(commit)
            extra = {_lineage.EXTRA_KEY: {"id": commit,
                                          "after": self._lineage[-_lineage.MAX_AFTER:]}}
            dm.session.checkpoint({_STATE_KEY: {**checkpoint, _ID_KEY: commit}}, step,
                                  blocking=True, extra=extra)
            self._saved = (step, commit)
            self._lineage = [*self._lineage[-_lineage.MAX_AFTER + 1:], commit]
        step, commit = self._saved
        stem = posixpath.splitext(posixpath.basename(str(path)))[0]
        last = _lineage.is_last_name(stem, self._last_name())
        if dm.session.rank == 0:
            self.write_marker(path, {"format": MARKER_FORMAT, "version": _MARKER_VERSION,
                                     "run": dm.run, "dataset": dm.dataset_name,
                                     "store": dm.store, "step": step, "commit": commit,
                                     "last": last})
        if last:
            self._lineage = [commit]

    def write_marker(self, path: Any, marker: dict[str, Any]) -> None:
        """Write ``marker`` at ``path`` whole (temp file, then a move): after the
        commit it names, so a marker never names a save that did not commit."""
        fs, _, (target,) = fsspec.get_fs_token_paths(str(path))
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        tmp = f"{target}.{uuid.uuid4().hex}.tmp"
        fs.pipe_file(tmp, json.dumps(marker).encode())
        fs.mv(tmp, target)

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
        if marker.get("version") not in (1, _MARKER_VERSION):
            raise ValueError(f"{path} is a trainguard marker of version {marker.get('version')}, "
                             f"this trainguard reads versions 1 and {_MARKER_VERSION}: upgrade it")
        if marker.get("run") != dm.run or marker.get("dataset") != dm.dataset_name:
            raise ValueError(f"{path} belongs to run {marker.get('run')!r} of dataset "
                             f"{marker.get('dataset')!r}, not run {dm.run!r} of {dm.dataset_name!r}")
        return dm._resume(marker, path)

    def remove_checkpoint(self, path: Any) -> None:
        # The marker only: the store keeps (and retires) the commits themselves.
        fs, _, (target,) = fsspec.get_fs_token_paths(str(path))
        if fs.exists(target):
            fs.rm(target)

    def teardown(self) -> None:
        self._saved = None
