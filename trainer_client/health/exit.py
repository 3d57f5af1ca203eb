"""The process exit of a node whose GPU turned CRITICAL: exit code 75 (sysexits
``EX_TEMPFAIL``: "temporary failure, retry later"), which tells the orchestrator to
replace the node and restart the run from its checkpoint."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from trainer_client.health.report import HealthReport
from trainguard.core.exit_codes import EXIT_GPU_CRITICAL, EXIT_PEER_CRITICAL

__all__ = ["EXIT_GPU_CRITICAL", "EXIT_PEER_CRITICAL", "exit_if_not_handled"]

log = logging.getLogger("trainer_client.health")


def exit_if_not_handled(
    grace_s: float = 300.0, *, exit_fn: Callable[[int], object] = os._exit
) -> Callable[[HealthReport], None]:
    """An ``on_critical`` callback of last resort.

    It gives the training loop ``grace_s`` seconds to notice (:meth:`HealthMonitor.check`
    between steps), checkpoint and exit with :data:`EXIT_GPU_CRITICAL` itself. If the
    process is still alive then, the loop is stuck (typically in a collective on a dead
    GPU), and the process is ended with ``os._exit(EXIT_GPU_CRITICAL)``: no new
    checkpoint, the last committed one is restored on the replacement node.
    ``sys.exit`` would not do: on the monitor thread it only ends that thread.
    """

    def on_critical(report: HealthReport) -> None:
        log.critical("GPU health CRITICAL (%s); exiting with code %d in %.0f s unless the "
                     "training loop exits first", "; ".join(report.problems()),
                     EXIT_GPU_CRITICAL, grace_s)
        timer = threading.Timer(grace_s, exit_fn, args=(EXIT_GPU_CRITICAL,))
        timer.daemon = True
        timer.start()

    return on_critical

