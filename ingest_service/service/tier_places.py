"""Where each checkpoint of a store root lives: the ``tiers`` of each row of the admin
API's checkpoint lists and the dashboard's tier column.

A root's own URL is the ``disk`` tier when it is a local directory, else ``remote``;
its remote tier (``name=local|remote``) adds ``remote`` to the checkpoints committed
there. A root whose node has a RAM tier with partner copies
(:class:`checkpoint_store.node_tiers.NodeTierStore`) names the job's tier servers in
``TRAINGUARD_TIER_SERVERS``::

    TRAINGUARD_TIER_SERVERS="n0=0:http://node0:7070 http://node1:7070 http://node2:7070"

(store root ``n0`` holds node 0's checkpoints, e.g. its remote root; the URLs are the
tier servers of nodes 0, 1, 2 in node order). Each server's index of that node
(``GET /v1/index/<node>``) then adds ``ram`` (on the node's own server), ``disk``
(its disk tier there) and ``partner:n<r>`` (a copy held by node ``r``'s server). A
server out of reach adds nothing and is logged: the column says what is known now.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from trainguard.core import lists
from trainguard.core.checkpoints import (
    CheckpointError,
    CheckpointStatus,
    one_tier_status,
    store_tier,
)

__all__ = ["TIERS_SCHEMA", "Held", "TierServers", "parse_tier_servers", "server_places",
           "with_places", "with_servers"]

log = logging.getLogger(__name__)
R = TypeVar("R")
TIER_ORDER = ("ram", "partner", "disk", "remote")
TIERS_SCHEMA = {"type": "array", "items": {"type": "string"}, "description": (
    "where the checkpoint lives, cheapest first: ram (its node's RAM tier), partner:n<r> (a "
    "copy on node r's tier server; TRAINGUARD_TIER_SERVERS), disk (local disk), remote")}
"""The OpenAPI schema of a row's ``tiers`` (checkpoint lists and run histories)."""


@dataclass(frozen=True)
class TierServers:
    """The tier servers of a job (node by node) and the node a store root belongs to."""

    node: int
    urls: tuple[str, ...]


def parse_tier_servers(text: str) -> dict[str, TierServers]:
    """``"n0=0:http://a:7070 http://b:7070,n1=1:..."`` -> tier servers by store name."""
    expected = "store=<node>:<url> <url> ... (the job's tier servers, node by node)"
    out: dict[str, TierServers] = {}
    for name, value in lists.pairs(text, what="tier servers", expected=expected).items():
        node, _, urls = value.partition(":")
        found = tuple(u for u in urls.split() if u)
        if not node.strip().isdigit() or not found or int(node) >= len(found) or not all(
                u.startswith(("http://", "https://")) for u in found):
            raise ValueError(f"tier servers {name}={value!r} are not valid: expected {expected}, "
                             f"the node a number below the count of URLs, each URL http(s)://")
        out[name] = TierServers(int(node), found)
    return out


def with_servers(roots: dict[str, R], text: str) -> dict[str, R]:
    """The store roots (dataclasses with a ``tier_servers`` field) with the tier servers
    of ``text`` (:func:`parse_tier_servers`) attached; a name that is no root is refused."""
    out = dict(roots)
    for name, servers in parse_tier_servers(text).items():
        if name not in out:
            raise ValueError(f"tier servers name the store {name!r}, which is not among the "
                             f"checkpoint stores {sorted(out)}: name one of those "
                             "(TRAINGUARD_CHECKPOINT_STORES)")
        root: Any = out[name]
        out[name] = replace(root, tier_servers=servers)
    return out


@dataclass(frozen=True)
class Held:
    """What the tier servers hold of a node: checkpoint name -> places (module doc),
    and each one's manifest text (for those the root itself lacks)."""

    places: dict[str, list[str]]
    manifests: dict[str, str]


def server_places(servers: TierServers, *, timeout_s: float = 2.0) -> Held:
    """What the tier servers hold of ``servers.node`` (module doc)."""
    held = Held({}, {})
    for host, url in enumerate(servers.urls):
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/v1/index/{servers.node}",
                                        timeout=timeout_s) as reply:
                doc = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError) as e:
            log.warning("tier server of node %d (%s) is out of reach: %s", host, url, e)
            continue
        for tier, entries in (doc.get("tiers") or {}).items():
            place = tier if host == servers.node else f"partner:n{host}"
            for entry in entries:
                name = str(entry.get("name"))
                held.places.setdefault(name, []).append(place)
                held.manifests.setdefault(name, str(entry.get("manifest")))
    return held


def _order(place: str) -> tuple[int, str]:
    kind = place.split(":", 1)[0]
    return (TIER_ORDER.index(kind) if kind in TIER_ORDER else len(TIER_ORDER)), place


def with_places(url: str, manifests: list[Any], labels: dict[str, list[CheckpointStatus]],
                held: Held | None) -> tuple[list[Any], dict[str, list[CheckpointStatus]],
                                            dict[str, list[str]]]:
    """The root's manifests and status labels, plus those only the tier servers hold
    (a RAM-tier checkpoint not yet on the root's tier: committed there), and each
    one's places, cheapest first: the root's own tier (:func:`store_tier`), ``remote``
    when its label says so, and where the servers hold it."""
    from checkpoint_store.manifest import parse_manifest  # as read_catalog: torch on use only

    own = store_tier(url)
    places = held.places if held is not None else {}
    extra = []
    for name, text in (held.manifests if held is not None else {}).items():
        if name in labels:
            continue
        try:
            extra.append(parse_manifest(name, text.encode("utf-8")))
        except CheckpointError as e:
            log.warning("a tier server sent a damaged manifest %s: %s", name, e)
            continue
    out_labels = {**labels, **{m.name: one_tier_status(m.pinned) for m in extra}}
    out = manifests
    if extra:
        out = sorted([*manifests, *extra], key=lambda m: (m.step, m.created_at or 0.0, m.name))
    tiers = {m.name: sorted({*([own] if m.name in labels else []),
                             *(["remote"] if "remote" in out_labels[m.name] else []),
                             *places.get(m.name, [])}, key=_order) for m in out}
    return out, out_labels, tiers
