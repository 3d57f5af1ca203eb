"""A node whose GPU turned CRITICAL leaves the job: quarantined, and its agent stopped.

After the job checkpointed together (``GuardedTraining.exit_on_gpu_critical``), the
bad rank calls :func:`leave_node` before it exits with
:data:`~trainer_client.health.EXIT_GPU_CRITICAL`:

1. it writes the node's quarantine record (:mod:`trainguard.core.quarantine`: the
   reason, the probe report, until when), so that the launcher's gate (``trainguard
   node gate``) and a rendezvous with an admission check keep the node out;
2. under torchrun (``TORCHELASTIC_RUN_ID`` set; the agent is the worker's parent) it
   sends the agent SIGTERM. An agent that saw its worker exit with 75 would restart
   it on this same node, and once out of restarts it would close the rendezvous for
   every node (torch's launcher shuts the rendezvous down when its agent fails); an
   agent ended by a signal leaves the rendezvous open, so the healthy nodes'
   agents form the next round without this one.

Neither step may keep the process from exiting with its code: failures are logged.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

from trainer_client import redis_client
from trainer_client.health.report import HealthReport
from trainguard.core import quarantine as qr

__all__ = ["leave_node", "quarantine_on_critical", "stop_agent"]

log = logging.getLogger("trainer_client.health")

AGENT_ENV = "TORCHELASTIC_RUN_ID"


def stop_agent() -> int | None:
    """SIGTERM to this worker's torchrun agent; its PID, or None outside torchrun."""
    if not os.environ.get(AGENT_ENV):
        return None
    agent = os.getppid()
    if agent <= 1:
        return None  # orphaned: the agent is gone already
    # The agent's shutdown sends its workers SIGTERM: this one is exiting with its
    # own code already, and must not die of the signal before it gets there.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.kill(agent, signal.SIGTERM)
    return agent


def leave_node(
    redis_url: str,
    reason: str,
    *,
    report: Mapping[str, Any] | None = None,
    node: str | None = None,
    policy: qr.QuarantinePolicy | None = None,
) -> qr.QuarantineRecord | None:
    """Quarantine this node (``node``, default ``$TRAINGUARD_NODE_ID`` or the host
    name) for ``reason``, then stop its torchrun agent. Returns the record written
    (None when quarantine is disabled or Redis refused)."""
    rec = None
    try:
        node = qr.node_id(node)
        client = redis_client.client(redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            rec = qr.quarantine(client, node, reason, source="trainer", report=report,
                                policy=policy)
        finally:
            client.close()
        if rec is not None:
            log.critical("%s", rec.describe())
    except Exception:
        # The node must still leave: the agent's restart would land here again, but
        # the operator sees why in this log.
        log.exception("could not write the quarantine record of this node")
    agent = stop_agent()
    if agent is not None:
        log.critical("stopped this node's torchrun agent (pid %d): it must not restart the "
                     "worker here", agent)
    return rec


def quarantine_on_critical(
    redis_url: str, *, node: str | None = None, policy: qr.QuarantinePolicy | None = None
) -> Callable[[HealthReport], None]:
    """An ``on_critical`` callback for a :class:`~trainer_client.health.HealthMonitor`
    (the ``trainguard probe --quarantine`` daemon): the first CRITICAL report writes
    this node's quarantine record (source ``probe``), so that the node's next gate or
    rendezvous join is refused even when no trainer runs on it."""
    node = qr.node_id(node)

    def on_critical(report: HealthReport) -> None:
        client = redis_client.client(redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            rec = qr.quarantine(client, node, "GPU health " + "; ".join(
                report.problems()), source="probe", report=report.to_dict(), policy=policy)
        finally:
            client.close()
        if rec is not None:
            log.critical("%s", rec.describe())

    return on_critical
