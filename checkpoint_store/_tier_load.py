"""Loading from a tiered store: the local copy of a checkpoint if it verifies, else the
remote copy, else the previous checkpoint (the order restores prefer)."""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint_store.layout import parse_manifest_name
from checkpoint_store.manifest import Manifest
from checkpoint_store.store import CheckpointStore
from trainguard.core.checkpoints import CorruptCheckpointError, NoCheckpointError
from trainguard.core.newest import newest_first, newest_save_of, saves_of

__all__ = ["Tiers", "load_from_tiers", "newest_of"]

log = logging.getLogger("checkpoint_store.tiered")


def newest_of(step: int, names: Iterable[str]) -> str | None:
    """The newest save of ``step`` among manifest ``names`` (None: none)."""
    newest = newest_save_of(step, [p for p in map(parse_manifest_name, names) if p])
    return newest.name if newest else None


@dataclass(frozen=True)
class Tiers:
    """The two stores of a tiered store and how the remote one is called."""

    local: CheckpointStore
    remote: CheckpointStore
    remote_call: Callable[..., Any]
    """Runs a remote call, waiting out an outage (a retrier's ``call``)."""
    transient: tuple[type[BaseException], ...]
    retention_lock: threading.Lock
    url: str
    remote_url: str
    served: builtins.list[str] = field(default_factory=list)
    """The tier each load served from (``disk``, ``remote``), appended by the load."""

    def no_such_step(self, step: int) -> NoCheckpointError:
        return NoCheckpointError(f"no checkpoint of step {step} in {self.url} or "
                                 f"{self.remote_url}; list() shows the steps there are")


def load_from_tiers(
    tiers: Tiers,
    local: Mapping[str, Manifest],
    remote: Mapping[str, Manifest],
    state: Mapping[str, Any],
    *,
    step: int | None,
    keys: builtins.list[str] | None,
    strict: bool,
) -> Manifest | None:
    """``TieredCheckpointStore.load`` over the manifests ``local`` and ``remote``."""
    local_names = set(local)
    if step is None:  # the order a restart resumes in
        ordered = [m.name for m in newest_first({**remote, **local}.values())]
    else:  # that step's newest save first
        ordered = [p.name for p in saves_of(step, [p for p in map(
            parse_manifest_name, {*local_names, *remote}) if p])]
    candidates = [p for p in map(parse_manifest_name, dict.fromkeys(ordered))
                  if p and (step is None or p.step == step)]
    if not candidates:
        if step is not None:
            raise tiers.no_such_step(step)
        return None
    problems: builtins.list[str] = []
    for cand in candidates:
        name, s = cand.name, cand.step
        if name in local_names and newest_of(s, local_names) == name:
            try:
                with tiers.retention_lock:
                    loaded = tiers.local.load(state, step=s, keys=keys, strict=True)
                tiers.served.append("disk")
                return loaded
            except (CorruptCheckpointError, NoCheckpointError) as e:
                problems.append(f"local {name}: {e}")
                log.warning("local copy of %s cannot be loaded (%s); falling back to the "
                            "remote copy in %s", name, e, tiers.remote_url)
        if name in remote and newest_of(s, remote) == name:
            try:
                manifest: Manifest | None = tiers.remote_call(
                    tiers.remote.load, state, step=s, keys=keys, strict=True)
            except (CorruptCheckpointError, NoCheckpointError) as e:
                problems.append(f"remote {name}: {e}")
                log.warning("remote copy of %s cannot be loaded either (%s)", name, e)
            except tiers.transient as e:
                problems.append(f"remote {name}: unreachable ({e})")
                log.warning("remote copy of %s is unreachable (%s)", name, e)
            else:
                log.warning("loaded checkpoint %s from the remote tier %s", name,
                            tiers.remote_url)
                tiers.served.append("remote")
                return manifest
        if strict:
            break
        log.warning("checkpoint %s could not be loaded from either tier; trying the "
                    "previous one", name)
    raise CorruptCheckpointError(
        f"no loadable checkpoint in {tiers.url} or {tiers.remote_url}: {problems}; "
        "restore from another copy"
    )
