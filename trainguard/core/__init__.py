"""The foundation: what the three parts share, importing none of them.

- :mod:`~trainguard.core.streams`: the stream contract between ingest and trainer
  (Redis keys, the ID scheme, the record encoding, dataset metadata, partition
  assignment);
- :mod:`~trainguard.core.groups`: the fenced group-move protocol (Lua scripts both
  sides run);
- :mod:`~trainguard.core.record`: the session record a checkpoint manifest carries,
  and the one restore order;
- :mod:`~trainguard.core.timing`, :mod:`~trainguard.core.interval`,
  :mod:`~trainguard.core.history`: the timing record a session adds to each manifest,
  the checkpoint interval advisor, and a run's history derived from its manifests;
- :mod:`~trainguard.core.checkpoints`: the checkpoint port (protocols, errors,
  ``open_store``);
- :mod:`~trainguard.core.settings`: environment names and defaults;
- :mod:`~trainguard.core.resilience`: circuit breaker and retries;
- :mod:`~trainguard.core.errors`: ``TrainguardError``, the root of every package's
  errors.

It imports no torch, aiohttp or redis, at import time or later (import-linter checks
it), so DataLoader workers, the CLI and the service import it cheaply.
"""
