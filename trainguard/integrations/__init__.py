"""trainguard inside the training frameworks people already use.

- :mod:`trainguard.integrations.lightning` (``pip install 'trainguard[lightning]'``):
  a ``LightningDataModule``, a ``Callback`` and a ``CheckpointIO`` plugin, so that
  ``trainer.fit(model, datamodule=dm, ckpt_path="last")`` resumes exactly once.
- :mod:`trainguard.integrations.hf` (``pip install 'trainguard[hf]'``): a
  ``transformers`` ``TrainerCallback`` with its dataset glue, and the helpers of the
  Accelerate recipe (``examples/accelerate_gpt.py``);
  :mod:`trainguard.integrations.hf_accelerate`: a plain Accelerate loop on one
  process or several (``docs/guides/integrations.md``).

Each module imports its framework; this package imports none, and nothing below it
(``trainer_client``, ``ingest_service``, ``checkpoint_store``, ``trainguard.core``)
imports a framework at all (import-linter checks both). Integrations use only the
public API of :class:`trainer_client.TrainingSession`.
"""
