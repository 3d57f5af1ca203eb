"""Which commit a Lightning marker resumes, and the lineage each commit records.

A kill can land between a commit and the marker Lightning writes after it, so
``last.ckpt`` may name the commit before the newest. Rolling back to it would throw
away a committed (trained, consistent) checkpoint, and start a second lineage beside
the abandoned one; so each commit records, in its manifest's ``extra``, its own id and
the ids of the commits it follows since the last ``last`` marker (``after``). A
``last`` marker then stands for the newest commit of its lineage: the first, in the
session's restore order, that is the named commit or follows it. Any other marker
(top-k files, a path the user saved to) names exactly its own commit: a user who
passes it asks for that step.

Marker versions: 1 named a step only (resumed as that step); 2 names the commit id
and whether it is a ``last`` marker.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.core.checkpoints import ManifestView

__all__ = ["EXTRA_KEY", "MAX_AFTER", "follows", "is_last_name", "lineage_of", "pick"]

EXTRA_KEY = "lightning"
"""The manifest ``extra`` key of the lineage record: ``{"id": ..., "after": [...]}``."""

MAX_AFTER = 64
"""At most this many ids in ``after``: a run without ``last`` markers (no
``save_last``) never resets the list, and a manifest must stay small."""


def lineage_of(manifest: ManifestView) -> tuple[str | None, tuple[str, ...]]:
    """The commit id and the ids it follows (None, () for a commit made without one)."""
    doc = manifest.extra.get(EXTRA_KEY)
    if not isinstance(doc, Mapping) or not isinstance(doc.get("id"), str):
        return None, ()
    after = doc.get("after")
    return doc["id"], tuple(a for a in after if isinstance(a, str)) if isinstance(after, list) else ()


def follows(manifest: ManifestView, commit: str) -> bool:
    """Whether ``manifest`` is the commit ``commit`` or one made after it in its lineage."""
    own, after = lineage_of(manifest)
    return own == commit or commit in after


def is_last_name(stem: str, last_name: str = "last") -> bool:
    """Lightning's own test for a ``save_last`` file, the one ``ckpt_path="last"``
    finds (``ModelCheckpoint._find_last_checkpoints``: the stem starts with the name)."""
    return re.match(rf"^{re.escape(last_name)}(-(\d+))?", stem) is not None


def pick(marker: Mapping[str, Any], candidates: Sequence[ManifestView]) -> ManifestView | None:
    """The commit a marker resumes, among ``candidates`` (the session's restore order).

    A ``last`` marker: the newest commit that is its commit or follows it. Another
    marker: its commit. A version-1 marker (a step only): the first of that step."""
    commit = marker.get("commit")
    if not isinstance(commit, str):
        return next((m for m in candidates if m.step == int(marker["step"])), None)
    if marker.get("last"):
        return next((m for m in candidates if follows(m, commit)), None)
    return next((m for m in candidates if lineage_of(m)[0] == commit), None)
