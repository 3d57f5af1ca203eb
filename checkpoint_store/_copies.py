"""Byte copies of one committed checkpoint between tier roots.

A copy is the checkpoint's files (``data/<uid>/...``) and, last, its manifest under
the same name: the commit rule of every tier. The files travel with their SHA-256,
checked where they land; a copy whose manifest is not there was never committed and
is never read (its staged files are debris for :func:`clear_staging`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

from checkpoint_store.backends import LocalBackend
from checkpoint_store.layout import TMP_PREFIX, data_dir, manifest_path, parse_manifest_name
from checkpoint_store.manifest import Manifest, parse_manifest
from trainguard.core.checkpoints import CheckpointError, CorruptCheckpointError

__all__ = ["SERVED_TIERS", "STAGING_DIR", "PartnerCopyError", "ServedTier", "checkpoint_file_names",
           "checkpoint_files", "clear_staging", "commit_staged", "copy_local",
           "sha256_bytes", "sha256_of", "staged_path"]

STAGING_DIR = ".incoming"
"""Where a copy's files wait (``.incoming/<uid>/<relpath>``) until its commit."""

ServedTier = Literal["ram", "disk"]
"""The tiers a node's tier server serves (``?tier=``): its RAM root, and its disk
root when it has one. Both sides of the copy protocol name them with this type."""
SERVED_TIERS: tuple[ServedTier, ...] = get_args(ServedTier)


class PartnerCopyError(CheckpointError, OSError):
    """A copy could not be sent, fetched or committed (network, checksum, budget)."""


def sha256_bytes(data: bytes) -> str:
    """The SHA-256 of bytes already in memory: a copy hashes what it sends or receives
    as it passes, so no file of it is read again only to be hashed."""
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _uid_of(name: str) -> str:
    parsed = parse_manifest_name(name)
    if parsed is None:
        raise PartnerCopyError(f"{name!r} is not a manifest name (<step>-<uid>.json)")
    return parsed.uid


def checkpoint_file_names(root: str | os.PathLike[str], name: str) -> list[str]:
    """The data files of checkpoint ``name`` under ``root`` (paths relative to it); the
    manifest is not among them (it goes last, by itself)."""
    base = Path(root)
    files: list[str] = []
    top = base / data_dir(_uid_of(name))
    for dirpath, _dirs, names in os.walk(top):
        for n in names:
            if not n.startswith(TMP_PREFIX):
                files.append((Path(dirpath) / n).relative_to(base).as_posix())
    if not files:
        raise PartnerCopyError(f"checkpoint {name} has no data files under {base}")
    return sorted(files)


def checkpoint_files(root: str | os.PathLike[str], name: str) -> dict[str, str]:
    """:func:`checkpoint_file_names` with each file's SHA-256."""
    base = Path(root)
    return {rel: sha256_of(base / rel) for rel in checkpoint_file_names(base, name)}


def staged_path(root: Path, uid: str, rel: str) -> Path:
    """Where file ``rel`` of the copy ``uid`` is staged; refuses paths leaving it."""
    if rel.startswith("/") or ".." in Path(rel).parts or not rel.startswith(data_dir(uid) + "/"):
        raise PartnerCopyError(f"file {rel!r} is not inside {data_dir(uid)}/ of its copy")
    return root / STAGING_DIR / uid / rel


def commit_staged(root: Path, name: str, manifest_raw: bytes,
                  files: Mapping[str, str], verified: Mapping[str, str] | None = None) -> Manifest:
    """Commit the copy of ``name`` staged under ``root``: every listed file present with
    its SHA-256, the manifest valid, then the data moved in place and the manifest
    created last (exclusively). Raises :class:`PartnerCopyError` and commits nothing
    when a file is missing or differs.

    ``verified`` is what the caller hashed as each staged file passed through it
    (``rel -> SHA-256``): a file named there is compared by that digest instead of being
    read back; any other file is hashed here."""
    uid = _uid_of(name)
    try:
        manifest = parse_manifest(name, manifest_raw)
    except CorruptCheckpointError as e:
        raise PartnerCopyError(f"the manifest sent for {name} is damaged: {e}") from e
    for rel, digest in files.items():
        path = staged_path(root, uid, rel)
        if not path.is_file():
            raise PartnerCopyError(f"copy {name}: file {rel} never arrived; send it again")
        seen = verified.get(rel) if verified is not None else None
        if (seen if seen is not None else sha256_of(path)) != digest:
            raise PartnerCopyError(f"copy {name}: file {rel} differs from its SHA-256; "
                                   "send it again")
    backend = LocalBackend(str(root))
    target = root / data_dir(uid)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(root / STAGING_DIR / uid / data_dir(uid), target)
        backend.sync_dirs([data_dir(uid).rsplit("/", 1)[0]])
    shutil.rmtree(root / STAGING_DIR / uid, ignore_errors=True)
    if not (root / manifest_path(name)).exists():
        backend.exclusive_create(manifest_path(name), manifest_raw)
    return manifest


def clear_staging(root: Path, keep: set[str] | None = None) -> None:
    """Remove staged copies (all, or all but the uids in ``keep``): a sender that died
    half-way leaves them; nothing reads them."""
    staging = root / STAGING_DIR
    if not staging.is_dir():
        return
    for entry in staging.iterdir():
        if keep is None or entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)


def copy_local(src: str | os.PathLike[str], dst: str | os.PathLike[str], name: str) -> Manifest:
    """Copy committed checkpoint ``name`` from root ``src`` to root ``dst`` (a disk tier
    below a RAM tier): staged, checked and committed as a partner copy is."""
    src_root, dst_root = Path(src), Path(dst)
    manifest_raw = (src_root / manifest_path(name)).read_bytes()
    files = checkpoint_files(src_root, name)
    uid = _uid_of(name)
    for rel in files:
        out = staged_path(dst_root, uid, rel)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_root / rel, out)
        with open(out, "rb+") as f:
            os.fsync(f.fileno())
    return commit_staged(dst_root, name, manifest_raw, files)
