"""Names and paths inside a checkpoint root; the only module that spells them.

```
<root>/data/<uid>/                   Zarr v3 group of one save, written once
<root>/manifests/<step>-<uid>.json   commit record of one save, written once
<root>/LATEST                        hint: name of the newest manifest
<root>/inflight/<uid>.r<rank>.json   marker of a save being written (removed after)
<root>/pins/<manifest name>          the checkpoint is pinned (kept forever)
```

``uid`` starts with the commit time in hex nanoseconds, so sorting manifest names by
uid gives commit order even when steps repeat (a run rolled back and saved again).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

__all__ = [
    "DATA_DIR",
    "INFLIGHT_DIR",
    "LATEST",
    "MANIFEST_DIR",
    "PINS_DIR",
    "TMP_PREFIX",
    "ManifestName",
    "data_dir",
    "inflight_marker",
    "is_uid",
    "manifest_path",
    "new_uid",
    "parse_manifest_name",
    "rank_group",
    "uid_time_ns",
]

DATA_DIR = "data"
MANIFEST_DIR = "manifests"
INFLIGHT_DIR = "inflight"
PINS_DIR = "pins"
LATEST = "LATEST"
TMP_PREFIX = ".tmp-"
"""Prefix of every temporary file; ``gc`` removes those whose save is not in flight."""

_UID_RE = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}$")
_MANIFEST_RE = re.compile(r"^(\d{12})-([0-9a-f]{16}-[0-9a-f]{8})\.json$")


def new_uid(not_before_ns: int = 0) -> str:
    """A fresh uid that sorts after every uid whose time part is below ``not_before_ns``."""
    now = max(time.time_ns(), not_before_ns)
    return f"{now:016x}-{secrets.token_hex(4)}"


def uid_time_ns(uid: str) -> int:
    return int(uid.split("-", 1)[0], 16)


def is_uid(text: str) -> bool:
    return bool(_UID_RE.match(text))


@dataclass(frozen=True, order=True)
class ManifestName:
    """A parsed ``<step>-<uid>.json``; orders by commit time (uid), then step."""

    uid: str
    step: int

    @property
    def name(self) -> str:
        return f"{self.step:012d}-{self.uid}.json"


def parse_manifest_name(name: str) -> ManifestName | None:
    m = _MANIFEST_RE.match(name)
    if m is None:
        return None
    return ManifestName(uid=m.group(2), step=int(m.group(1)))


def manifest_path(name: str) -> str:
    return f"{MANIFEST_DIR}/{name}"


def data_dir(uid: str) -> str:
    return f"{DATA_DIR}/{uid}"


def rank_group(rank: int) -> str:
    """The Zarr group of one rank inside ``data/<uid>``."""
    return f"r{rank}"


def inflight_marker(uid: str, rank: int) -> str:
    return f"{INFLIGHT_DIR}/{uid}.r{rank}.json"
