"""``trainguard ckpt ls|show|verify|pin|unpin|gc|export``: checkpoint stores by URL.

Works on any store URL the checkpoint store reads (local path, ``file://``,
``s3://``...), with no service running. ``export --format safetensors`` writes every
tensor of a checkpoint (bfloat16 included) to one ``.safetensors`` file named by the
tensor's key path in the checkpoint (``model/mlp.1.weight``); ``--key model`` writes
the tensors under ``model`` by their names below it (what ``from_pretrained`` reads),
``--strip-prefix`` leaves a prefix off those names; an existing output is refused
unless ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal, get_args

from trainguard.core.checkpoints import checkpoint_summary, store_tier
from trainguard.core.newest import newest_first, newest_save_of
from trainguard.core.urls import has_password, redact_url
from trainguard.ops.errors import StoreNotFoundError, StorePathError
from trainguard.ops.exits import EXIT_FAILED, EXIT_OK
from trainguard.ops.output import Progress, emit, table

__all__ = ["EXPORT_FORMATS", "ExportFormat", "StoreNotFoundError", "StorePathError", "register"]

ExportFormat = Literal["safetensors"]
"""What ``ckpt export`` writes; the CLI's choices and its check read this one type."""

EXPORT_FORMATS: tuple[ExportFormat, ...] = get_args(ExportFormat)


def _check_local(url: str) -> None:
    """A local store must be an existing directory: every ckpt command reads one, and
    a typo must not read as an empty store."""
    if "://" in url and not url.startswith("file://"):
        return  # s3:// and other remotes: the backend answers
    path = Path(url.removeprefix("file://"))
    if path.is_file():
        raise StorePathError(
            f"expected a checkpoint store directory, found a file at {path}: pass the "
            "directory the trainer's store= URL names (the one holding manifests/)")
    if not path.exists():
        raise StoreNotFoundError(
            f"expected a checkpoint store at {path}, found nothing there: check the path "
            "(it is the trainer's store= / CKPT_URL) or list the parent directory")


def _store(args: argparse.Namespace) -> Any:
    from checkpoint_store import CheckpointStore

    options = json.loads(args.storage_options) if args.storage_options else None
    # A store does not record the retention its writer used, so the CLI applies one
    # only when asked (gc --keep-last): the store's default keep_last (3) would
    # delete, e.g., the archive of a remote tier that keeps everything.
    kwargs: dict[str, Any] = {"storage_options": options, "keep_last": sys.maxsize}
    if getattr(args, "keep_last", None) is not None:
        kwargs["keep_last"] = args.keep_last
    if getattr(args, "keep_every", None) is not None:
        kwargs["keep_every"] = args.keep_every
    if has_password(args.url):
        # Backend errors quote the URL, without its scheme (botocore: "KEY:SECRET@bucket").
        raise ValueError(
            f"the store URL {redact_url(args.url)!r} carries user:password@: give the "
            "credentials to the backend instead (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "or a profile for s3://, or --storage-options) and drop them from the URL")
    _check_local(args.url)
    return CheckpointStore(args.url, **kwargs)


def _find(store: Any, step: int | None) -> Any:
    manifests = store.list()
    if not manifests:
        raise LookupError("the store has no committed checkpoint")
    if step is None:  # the one a restart would resume from
        return newest_first(manifests)[0]
    found = newest_save_of(step, manifests)  # a step saved twice: its newest save
    if found is not None:
        return found
    raise LookupError(f"no checkpoint at step {step}; it has steps {[m.step for m in manifests]}")


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ls(args: argparse.Namespace) -> int:
    rows = [checkpoint_summary(m, tiers=[store_tier(args.url)]) for m in _store(args).list()]
    emit(args, rows, lambda rows: table(
        [(r["step"], _when(r["created_at"]), r["nbytes"], "pinned" if r["pinned"] else "",
          r["uid"]) for r in rows],
        ["STEP", "CREATED", "BYTES", "PIN", "UID"]) if rows else "no checkpoints")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from ingest_service.service.admin_checkpoints import manifest_json

    data = manifest_json(_find(_store(args), args.step))
    print(json.dumps(data, indent=2, sort_keys=True))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from checkpoint_store import CorruptCheckpointError

    store = _store(args)
    steps = [args.step] if args.step is not None else [m.step for m in store.list()]
    if args.step is not None:
        _find(store, args.step)
    progress = Progress(len(steps), "verify")
    results = []
    for step in steps:
        try:
            store.verify(step)
            results.append({"step": step, "valid": True, "reason": None})
        except CorruptCheckpointError as exc:
            results.append({"step": step, "valid": False, "reason": str(exc)})
        progress.step()
    progress.close()
    emit(args, results, lambda rows: table(
        [(r["step"], "ok" if r["valid"] else "CORRUPT", r["reason"] or "") for r in rows],
        ["STEP", "STATUS", "REASON"]) if rows else "no checkpoints")
    return EXIT_OK if all(r["valid"] for r in results) else EXIT_FAILED


def _pin(args: argparse.Namespace) -> int:
    store = _store(args)
    _find(store, args.step)
    if args.pin_command == "pin":
        store.pin(args.step)
    else:
        store.unpin(args.step)
    emit(args, {"step": args.step, "pinned": args.pin_command == "pin"},
         lambda d: f"step {d['step']} {'pinned' if d['pinned'] else 'unpinned'}")
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    store = _store(args)
    before = {m.step for m in store.list()}
    report = store.gc()
    after = {m.step for m in store.list()}
    data = {"deleted_steps": sorted(before - after), "kept_steps": sorted(after),
            **dataclasses.asdict(report)}
    emit(args, data, lambda d: f"deleted steps {d['deleted_steps'] or 'none'}; "
                               f"kept {d['kept_steps']}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from checkpoint_store import export_safetensors

    if args.format not in EXPORT_FORMATS:
        raise ValueError(f"format {args.format!r} is not supported: use one of {EXPORT_FORMATS}")
    store = _store(args)
    result = export_safetensors(store, _find(store, args.step), Path(args.output),
                                key=args.key, strip_prefix=args.strip_prefix, force=args.force)
    emit(args, result, _exported)
    return EXIT_OK


def _exported(d: dict[str, Any]) -> str:
    what = f"the tensors under key {d['key']!r}" if d["key"] is not None else "every tensor"
    stripped = f", prefix {d['strip_prefix']!r} stripped" if d["strip_prefix"] else ""
    shown = ", ".join(d["names"][:3]) + (", ..." if len(d["names"]) > 3 else "")
    return (f"step {d['step']}: {d['tensors']} tensors ({what}{stripped}) -> {d['path']} "
            f"({d['bytes']} bytes, safetensors, format {d['format']}): {shown}")


def register(sub: Any) -> None:
    ck = sub.add_parser("ckpt", help="checkpoints of a store: ls, show, verify, pin, gc, export")
    csub = ck.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    def add(name: str, helptext: str, fn: Any, *, step: str | None = None) -> Any:
        p = csub.add_parser(name, help=helptext)
        p.add_argument("url", help="checkpoint store URL (path, file://, s3://...)")
        if step == "required":
            p.add_argument("step", type=int, help="the checkpoint's step")
        elif step == "optional":
            p.add_argument("step", type=int, nargs="?", help="default: the newest")
        p.add_argument("--storage-options", help="fsspec options as JSON")
        p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
        p.set_defaults(handler=fn)
        return p

    add("ls", "checkpoints, oldest first", _ls)
    add("show", "a checkpoint's manifest (JSON)", _show, step="optional")
    add("verify", "verify checksums (all checkpoints, or one step)", _verify, step="optional")
    add("pin", "keep a checkpoint through retention", _pin, step="required").set_defaults(
        pin_command="pin")
    add("unpin", "release a pin", _pin, step="required").set_defaults(pin_command="unpin")
    p = add("gc", "collect debris of crashed saves; with --keep-last, apply retention", _gc)
    p.add_argument("--keep-last", type=int,
                   help="keep the last N and delete older unpinned ones (default: keep all)")
    p.add_argument("--keep-every", type=int, help="also keep every N-th step")
    p = add("export", "write a checkpoint's tensors to one file", _export, step="optional")
    p.add_argument("--format", default="safetensors", choices=EXPORT_FORMATS,
                   help="output format (default: safetensors)")
    p.add_argument("-o", "--output", required=True, help="output file (.safetensors)")
    p.add_argument("--key", help="export only the tensors under this top-level key of the "
                                 "state (e.g. model), named by their path below it")
    p.add_argument("--strip-prefix", help="leave this prefix off the tensor names that have "
                                          "it (e.g. module. or _orig_mod.)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
