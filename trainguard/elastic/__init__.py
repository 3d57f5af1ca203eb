"""An elastic rendezvous for ``torchrun`` kept in Redis: no node is a single point of
failure.

``torchrun --rdzv-backend=trainguard --rdzv-endpoint=redis://HOST:6379/0
--rdzv-id=JOB --nnodes=MIN:MAX ...`` finds this backend through the
``torchrun.handlers`` entry point (:func:`torchrun_handler`). The modules:
``backend`` (torch's ``RendezvousBackend``: the state and its compare-and-set),
``store`` (a Redis ``torch.distributed.Store``), ``rendezvous`` (the handler: fast
close, no agent-hosted store, the admission check), ``keys`` (every Redis key).
Beside the rendezvous, ``warm``: warm worker starts (``torchrun -m
trainguard.elastic.warm train.py``), each worker forked by its agent's zygote
(``_zygote``).

torchrun imports every registered handler module at start, whichever backend it
runs, so this package imports nothing until the handler is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["torchrun_handler"]


def torchrun_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it once and registers what
    it returns (``RendezvousParameters -> RendezvousHandler``) as ``trainguard``.

    torch registers the entry points whenever ``torch.distributed.elastic.rendezvous``
    is first imported, in any process: a worker too, from inside an import of one of
    this package's modules. So nothing is imported here, only when a handler is made
    (an import now would re-enter that module half-initialized)."""

    def create(params: Any) -> Any:
        from trainguard.elastic.rendezvous import create_handler

        return create_handler(params)

    return create
