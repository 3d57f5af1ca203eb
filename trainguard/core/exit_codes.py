"""The one home of the exit codes a trainer process ends with for its agent to read.

The trainer (:mod:`trainer_client`) exits with them; the operations layer
(:mod:`trainguard.ops.exits`) documents them beside the CLI's own codes and maps
errors to them; ``trainguard node fail`` decides from them whether a node is at fault.
"""

from __future__ import annotations

__all__ = ["EXIT_GPU_CRITICAL", "EXIT_HUNG", "EXIT_PEER_CRITICAL", "EXIT_RESTART_LOOP"]

EXIT_GPU_CRITICAL = 75
"""After a CRITICAL GPU health report (sysexits ``EX_TEMPFAIL``: "temporary failure,
retry later"): replace the node and restart the run from its checkpoint."""

EXIT_PEER_CRITICAL = 76
"""A healthy rank's code after another node's rank reported CRITICAL and the job
checkpointed: not this node's fault (a failure counter must not count it), but the
worker must restart so that its torchrun agent rendezvous again without the bad node
(an exit of 0 would end the job on this node)."""

EXIT_HUNG = 86
"""A trainer's watchdog found no progress within its budget: the process dumped its
threads' stacks into a report and exited so that the agent restarts the group
(retryable)."""

EXIT_RESTART_LOOP = 87
"""The same failure came back after every remedy the restart-loop breaker tried: not
retryable; a person must look at the run's last incident."""
