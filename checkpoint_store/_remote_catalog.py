"""What a tiered store knows of its remote root: the remote manifests, listed once and
then kept current by the store (uploads, pins, deletions), so that ``list``, ``load``
and the trainer's per-commit calls never wait on the remote."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from checkpoint_store.backends import Backend
from checkpoint_store.layout import MANIFEST_DIR, PINS_DIR, manifest_path, parse_manifest_name
from checkpoint_store.manifest import Manifest, parse_manifest
from checkpoint_store.rank_content import with_content
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError

__all__ = ["RemoteCatalog"]

log = logging.getLogger("checkpoint_store.tiered")


class RemoteCatalog:
    """The remote manifests by name. ``read`` runs a remote call waiting out an outage
    (a retrier's ``call``), ``try_once`` runs it once (a breaker's ``call``);
    ``transient`` are the errors of an outage; ``on_listed`` learns the names of each
    successful listing."""

    def __init__(self, backend: Backend, url: str, *, read: Callable[..., Any],
                 try_once: Callable[..., Any], transient: tuple[type[BaseException], ...],
                 on_listed: Callable[[set[str]], None]) -> None:
        self._backend = backend
        self._url = url
        self._read = read
        self._try_once = try_once
        self._transient = transient
        self._on_listed = on_listed
        self._lock = threading.Lock()
        self._known: dict[str, Manifest] = {}
        self._listed = False

    @property
    def listed(self) -> bool:
        """True once a listing succeeded: from then on :meth:`known` is current."""
        return self._listed

    def known(self) -> dict[str, Manifest]:
        with self._lock:
            return dict(self._known)

    def list(self, *, wait: bool) -> dict[str, Manifest]:
        """List the remote root (manifests are read once, then cached: they are
        immutable). ``wait``: retry through an outage and raise CheckpointError when
        the policy runs out; otherwise one try, and on failure what is known."""
        call = self._read if wait else self._try_once
        cache = self.known()
        try:
            names = [n for n in call(self._backend.listdir, MANIFEST_DIR)
                     if parse_manifest_name(n)]
            pins = set(call(self._backend.listdir, PINS_DIR))
            found: dict[str, Manifest] = {}
            for n in names:
                m = cache.get(n)
                if m is None:
                    try:
                        m = with_content(self._backend, parse_manifest(
                            n, call(self._backend.read, manifest_path(n))))
                    except FileNotFoundError:
                        continue  # deleted between listing and reading
                    except CorruptCheckpointError as e:
                        log.warning("skipping damaged remote manifest %s: %s", n, e)
                        continue
                found[n] = dataclasses.replace(m, pinned=n in pins)
        except self._transient as e:
            if wait:
                raise CheckpointError(
                    f"the remote tier {self._url} is unreachable ({type(e).__name__}: "
                    f"{e}), so its checkpoints are unknown; retry when it is back"
                ) from e
            log.info("remote tier %s unreachable (%s: %s); using what is known of it",
                     self._url, type(e).__name__, e)
            return cache
        with self._lock:
            self._known = found
            self._listed = True
        self._on_listed(set(found))
        return dict(found)

    def remember(self, manifest: Manifest, *, replace: bool = True) -> None:
        """``manifest`` is committed remotely (``replace=False``: unless known)."""
        with self._lock:
            if replace or manifest.name not in self._known:
                self._known[manifest.name] = manifest

    def set_pinned(self, manifests: Iterable[Manifest], pinned: bool) -> None:
        with self._lock:
            for m in manifests:
                self._known[m.name] = dataclasses.replace(m, pinned=pinned)

    def forget(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                self._known.pop(name, None)
