"""The default admission check of the trainguard rendezvous: a node that a quarantine
record in the rendezvous' Redis keeps out (`trainguard.core.quarantine`: written by a
CRITICAL probe, by ``trainguard node gate`` or after N failures in a window) does not
join, whatever its launcher does. Without it a quarantined node's agent, restarted by
its supervisor, would rejoin the very next round and bring its bad GPU back."""

from __future__ import annotations

from trainguard.core import quarantine
from trainguard.elastic._redis import Connection

__all__ = ["QuarantineAdmission"]


class QuarantineAdmission:
    """Admits this node unless a quarantine record holds for it. The node is named as
    the quarantine names it (``$TRAINGUARD_NODE_ID``, else the host name), not by the
    agent's address: the record is the one ``trainguard nodes ls`` shows."""

    def __init__(self, conn: Connection, node: str | None = None) -> None:
        self._conn = conn
        self.node = quarantine.node_id(node)

    def __call__(self, request: object) -> str | None:
        try:
            self._conn.call(quarantine.check_admission, self._conn.client, self.node)
        except quarantine.NodeQuarantinedError as e:
            return str(e)
        return None
