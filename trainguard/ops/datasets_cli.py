"""``trainguard datasets|offsets``: the operator's commands on the Redis side.

The commands talk to Redis (and, for ``offsets seek --checkpoint``, to a checkpoint
store) directly, through the same operations as the admin API
(:mod:`ingest_service.inspection`, :mod:`ingest_service.seek`,
:mod:`ingest_service.service.admin_checkpoints`), so they work with or without a running
service. Human tables by default, ``--json`` for scripts; exit codes as in
:mod:`trainguard.ops.exits`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from trainguard.core import groups, lists, settings, streams
from trainguard.core.urls import redact_url, redact_values
from trainguard.ops.exits import EXIT_OK
from trainguard.ops.output import emit, table

__all__ = ["register"]

T = TypeVar("T")


def with_redis(args: argparse.Namespace, op: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    """Run ``op`` on an async client of ``--redis-url`` (every ops command that talks to
    Redis: datasets, nodes), closing it after."""
    from ingest_service import redis_client

    async def main() -> T:
        r = redis_client.client(settings.redis_url(args.redis_url), socket_timeout=10)
        try:
            return await op(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


# --------------------------------------------------------------------------- datasets


def _datasets_ls(args: argparse.Namespace) -> int:
    from ingest_service import inspection

    rows = [_redacted(row) for row in with_redis(args, inspection.list_datasets)]
    emit(args, rows, lambda rows: table(
        [(d["name"], d.get("spec", {}).get("format"), d.get("partitions"), d.get("length"),
          d.get("bytes"), d.get("paused"), d.get("dead_letters"), ",".join(d.get("groups", [])))
         for d in rows],
        ["NAME", "FORMAT", "PARTS", "RECORDS", "BYTES~", "PAUSED", "DEAD", "GROUPS"],
    ) if rows else "no datasets")
    return EXIT_OK


def _redacted(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row with the credentials of its source URL and options redacted."""
    spec = row.get("spec")
    if isinstance(spec, dict) and spec.get("source"):
        spec = {**spec, "source": redact_url(spec["source"])}
    if isinstance(spec, dict) and spec.get("options"):
        spec = {**spec, "options": redact_values(spec["options"])}
    return {**row, "spec": spec} if isinstance(spec, dict) else row


def _show_human(d: dict[str, Any]) -> str:
    spec = d["spec"]
    head = (
        f"dataset {d['name']}: format={spec['format']} source={spec['source']} "
        f"partitions={spec['partitions']} seed={spec['seed']} epochs={spec['epochs']}\n"
        f"dead letters: {d['dead_letters']}  groups: {', '.join(d['groups']) or '-'}  "
        f"producer finished: {d['producer']['finished']}\n"
    )
    rows = [
        (p["partition"], p["length"], p["first_id"], p["last_id"], p["bytes"],
         (f"e{p['producer_position']['epoch']}:{p['producer_position']['records']}"
          if p["producer_position"] else None),
         "yes" if p["paused"] else "", p["retention_floor"])
        for p in d["partitions"]
    ]
    return head + table(
        rows, ["PART", "LEN", "FIRST", "LAST", "BYTES~", "PRODUCED", "PAUSED", "FLOOR"]
    ) + f"\n(BYTES~: {d['bytes_method']})"


def _datasets_show(args: argparse.Namespace) -> int:
    from ingest_service import inspection

    emit(args, _redacted(with_redis(args, lambda r: inspection.show_dataset(r, args.name))),
         _show_human)
    return EXIT_OK


def _datasets_create(args: argparse.Namespace) -> int:
    from ingest_service.datasets import create_dataset
    from trainguard.core.streams import DatasetSpec

    spec = DatasetSpec(
        name=args.name, partitions=args.partitions, source=args.source or "",
        format=args.format, seed=args.seed, epochs=None if args.endless else args.epochs,
        sample_len=args.sample_len,
    )
    stored = with_redis(args, lambda r: create_dataset(r, spec))
    emit(args, {"created": stored.name, "partitions": stored.partitions},
         lambda d: f"dataset {d['created']} registered ({d['partitions']} partitions); a "
                   "running `trainguard serve` produces it, or run `trainguard ingest`")
    return EXIT_OK


def _datasets_delete(args: argparse.Namespace) -> int:
    from ingest_service.datasets import delete_dataset

    if not args.yes:
        raise ValueError(f"deleting {args.name!r} drops its streams and offsets: "
                         "add --yes to confirm")
    with_redis(args, lambda r: delete_dataset(r, args.name))
    emit(args, {"deleted": args.name}, lambda d: f"dataset {d['deleted']} deleted")
    return EXIT_OK


# --------------------------------------------------------------------------- offsets


def _offsets_show(args: argparse.Namespace) -> int:
    from ingest_service import inspection
    from ingest_service.errors import NotFound

    groups = with_redis(args, lambda r: inspection.dataset_groups(r, args.dataset))
    if args.group:
        names = sorted(g["group"] for g in groups)
        groups = [g for g in groups if g["group"] == args.group]
        if not groups:
            raise NotFound("group_not_found",
                           f"group {args.group!r} has no state on {args.dataset!r}: its groups "
                           f"are {names or 'none'}; name one of them, or leave --group out "
                           "to show every group")

    def human(groups: list[dict[str, Any]]) -> str:
        rows = [
            (g["group"], p["partition"], p["last_delivered_id"], p["committed"], p["lag"],
             p["pending"], ",".join(f"{c['name']}({c['idle_ms']}ms)" for c in p["consumers"]))
            for g in groups for p in g["partitions"]
        ]
        return table(rows, ["GROUP", "PART", "DELIVERED", "COMMITTED", "LAG", "PENDING",
                            "CONSUMERS(idle)"]) if rows else "no consumer groups"

    emit(args, groups, human)
    return EXIT_OK


def _parse_ids_arg(text: str) -> dict[str, str]:
    return lists.pairs(text, what="--ids item", expected="PARTITION=ID (e.g. 0=1-41,1=1-40)")


def _offsets_seek(args: argparse.Namespace) -> int:
    from ingest_service import inspection, seek
    from ingest_service.service.admin_checkpoints import StoreRoot, StoreSet

    async def op(r: Any) -> dict[str, Any]:
        if args.to:
            return await seek.seek_group(r, args.dataset, args.group, to=args.to,
                                            force=args.force)
        spec = await inspection.dataset_spec(r, args.dataset)
        if args.ids:
            raw = _parse_ids_arg(args.ids)
        else:
            stores = StoreSet({"cli": StoreRoot("cli", args.checkpoint)})
            raw = await stores.checkpoint_offsets({"store": "cli", "step": args.step},
                                                  args.dataset)
        ids = seek.parse_seek_ids(raw, spec.partitions)
        return await seek.seek_group(r, args.dataset, args.group, ids=ids, force=args.force)

    if args.checkpoint and args.step is None:
        raise ValueError("--checkpoint needs --step")
    result = with_redis(args, op)
    emit(args, result, lambda d: table(sorted(d["offsets"].items(), key=lambda kv: int(kv[0])),
                                       ["PART", "OFFSET"]))
    return EXIT_OK


# --------------------------------------------------------------------------- registration


def _common(p: argparse.ArgumentParser, *, redis: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    if redis:
        p.add_argument(
            "--redis-url", default=None,
            help=f"Redis to inspect (default: ${settings.REDIS_URL_ENV} or "
                 f"{settings.DEFAULT_REDIS_URL})",
        )


def _register_datasets(sub: Any) -> None:
    ds = sub.add_parser("datasets", help="list, show, create and delete datasets")
    dsub = ds.add_subparsers(dest="datasets_command", metavar="ACTION", required=True)
    p = dsub.add_parser("ls", help="datasets with totals")
    _common(p)
    p.set_defaults(handler=_datasets_ls)
    p = dsub.add_parser("show", help="a dataset's partitions, producer position, floors")
    p.add_argument("name", help="dataset name")
    _common(p)
    p.set_defaults(handler=_datasets_show)
    p = dsub.add_parser("create", help="register a dataset (the producer fills it)")
    p.add_argument("name", help="dataset name")
    p.add_argument("--source", help="fsspec URL or glob of the source files")
    p.add_argument("--format", default="jsonl", help=", ".join(streams.FORMATS))
    p.add_argument("--partitions", type=int, default=16, help="Redis streams to shard into (default 16)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the source; 0: endless")
    p.add_argument("--endless", action="store_true", help="no end (push datasets are endless)")
    p.add_argument("--sample-len", type=int, help="tokens per record (npy sources)")
    _common(p)
    p.set_defaults(handler=_datasets_create)
    p = dsub.add_parser("delete", help="drop a dataset's streams and bookkeeping")
    p.add_argument("name", help="dataset name")
    p.add_argument("--yes", action="store_true", help="confirm")
    _common(p)
    p.set_defaults(handler=_datasets_delete)


def _register_offsets(sub: Any) -> None:
    off = sub.add_parser("offsets", help="consumer group offsets: show and seek")
    osub = off.add_subparsers(dest="offsets_command", metavar="ACTION", required=True)
    p = osub.add_parser("show", help="delivered, committed, lag, pending per group/partition")
    p.add_argument("dataset", help="dataset name")
    p.add_argument("--group", help="only this group")
    _common(p)
    p.set_defaults(handler=_offsets_show)
    p = osub.add_parser("seek", help="move a group (refused below the retention floor)")
    p.add_argument("dataset", help="dataset name")
    p.add_argument("group", help="consumer group (a run's name)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", choices=groups.SEEK_TARGETS, help="the stream's start or end")
    target.add_argument("--ids", help="PARTITION=ID,... e.g. 0=1-41,1=1-40")
    target.add_argument("--checkpoint", metavar="STORE_URL",
                        help="the offsets committed in this store's checkpoint --step")
    p.add_argument("--step", type=int, help="checkpoint step (with --checkpoint)")
    p.add_argument("--force", action="store_true",
                   help="seek even while a consumer of the group read in the last 30 s")
    _common(p)
    p.set_defaults(handler=_offsets_seek)


def register(sub: Any) -> None:
    _register_datasets(sub)
    _register_offsets(sub)
