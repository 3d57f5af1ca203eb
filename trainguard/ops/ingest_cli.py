"""``trainguard ingest`` and ``trainguard serve``.

``ingest`` registers the dataset from the flags when it does not exist (or checks the
flags against it when it does), then produces until the dataset is complete, showing
progress per dataset on stderr (the dataset's whole, a percentage and an ETA, then
this process's share: :mod:`trainguard.ops.ingest_progress`). SIGTERM or Ctrl-C stop it after the batches in flight.
``serve`` runs the service process (:mod:`trainguard.ops.serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from typing import Any, TextIO

from trainguard.core import settings, streams
from trainguard.ops.exits import EXIT_INTERRUPTED, EXIT_OK
from trainguard.ops.ingest_progress import DatasetCount, count_dataset, last_ids, progress_line
from trainguard.ops.source_size import epoch_records_up_front

__all__ = ["register"]

_LEASE_HELP = ("several producers (ingest or serve processes) share a dataset's partitions "
               "through leases: how long a killed one's stay leased before the others take "
               "them over, in ms (default 5000)")
_REDIS_HELP = f"Redis URL (default: ${settings.REDIS_URL_ENV} or {settings.DEFAULT_REDIS_URL})"


def register(subparsers: Any) -> None:
    ingest = subparsers.add_parser(
        "ingest", help="register a dataset and produce it into Redis streams",
        description="Create the dataset if needed, then produce every epoch of it.",
    )
    ingest.add_argument("--redis-url", default=None,
                        help=_REDIS_HELP)
    ingest.add_argument("--dataset", required=True, help="dataset name")
    ingest.add_argument("--source", help="fsspec URL, folder or glob (omit to produce an "
                                         "already registered dataset)")
    ingest.add_argument("--format", default="jsonl", choices=streams.SOURCED_FORMATS,
                        help="how to read the source (default: jsonl)")
    ingest.add_argument("--partitions", type=int, default=streams.DEFAULT_PARTITIONS,
                        help="Redis streams to shard into (default %(default)s)")
    ingest.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    ingest.add_argument("--epochs", type=int, default=1, help="passes over the source; 0: endless")
    ingest.add_argument("--sample-len", type=int, default=None, help="tokens per record (npy)")
    ingest.add_argument("--shuffle-buffer", type=int, default=4096,
                        help="records shuffled together (default 4096)")
    ingest.add_argument("--max-record-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger records go to dead letters (default 16 MiB)")
    ingest.add_argument("--lease-ms", type=int, default=None, help=_LEASE_HELP)
    tok = ingest.add_argument_group(
        "tokenize at ingest (text, jsonl, parquet, hf, webdataset; needs trainguard[hf])")
    tok.add_argument("--tokenizer", default=None,
                     help="a Hugging Face tokenizer.json (local path or fsspec URL): records "
                          "become int32 token arrays")
    tok.add_argument("--pack", type=int, default=None, metavar="SEQ_LEN",
                     help="pack documents (each ended by EOS) into records of exactly SEQ_LEN tokens")
    tok.add_argument("--text-field", default="text",
                     help="field of a structured record that holds the text (default: text)")
    tok.add_argument("--eos", default="<|endoftext|>", help="end-of-document token")
    tok.add_argument("--pad", default=None,
                     help="token that fills the last packed sequence (default: the EOS token)")
    ingest.set_defaults(handler=_run_ingest)

    serve = subparsers.add_parser("serve", help="run the ingestion service (HTTP)")
    _add_serve_arguments(serve)
    serve.set_defaults(handler=_run_serve)


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    parser.add_argument("--redis-url", default=None,
                        help=_REDIS_HELP)
    parser.add_argument("--dataset", action="append", default=None,
                        help="produce only this dataset (repeatable; default: all registered)")
    parser.add_argument("--lease-ms", type=int, default=None, help=_LEASE_HELP)
    parser.add_argument("--no-produce", action="store_true",
                        help="serve push and health only, run no file producers")
    parser.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                        help="a Host name clients use to reach the service (repeatable; default "
                             "127.0.0.1, localhost, ::1; '*' for any, e.g. behind a proxy)")
    parser.add_argument("--max-push-bytes", type=int, default=None,
                        help="bytes per push request (default 16 MiB)")
    parser.add_argument("--max-push-records", type=int, default=None,
                        help="records per push request (default 10000)")
    parser.add_argument("--decode-workers", type=int, default=None,
                        help="processes that decode big or container-heavy push bodies off "
                             "the event loop (default 2; 0: all on the loop, in slices)")
    parser.add_argument("--decode-timeout", type=float, default=None,
                        help="seconds a decode worker may take for one body before it is "
                             "killed and the push refused with 413 (default 30)")
    parser.add_argument("--insecure-local", action="store_true",
                        help="accept pushes without a producer token (demos on one machine "
                             "only: allowed with a loopback --host only)")


def _run_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from ingest_service.push.body import BodyLimits
    from ingest_service.service.config import IngestConfig
    from trainguard.ops.serve import serve

    limits = BodyLimits()
    max_bytes = args.max_push_bytes or limits.max_bytes
    limits = dataclasses.replace(
        limits, max_bytes=max_bytes, max_records=args.max_push_records or limits.max_records,
        max_inflight_bytes=max(limits.max_inflight_bytes, 4 * max_bytes),
        decode_workers=limits.decode_workers if args.decode_workers is None
        else args.decode_workers,
        decode_timeout_s=args.decode_timeout or limits.decode_timeout_s,
    )
    config = IngestConfig.from_env(
        redis_url=args.redis_url, host=args.host, port=args.port,
        datasets=tuple(args.dataset) if args.dataset else None, produce=not args.no_produce,
        allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
        push_limits=limits, insecure_local=args.insecure_local, lease_ms=args.lease_ms,
    )
    return serve(config)


# --------------------------------------------------------------------------- ingest


def _spec_from_args(args: argparse.Namespace) -> streams.DatasetSpec:
    options: dict[str, Any] = {}
    if args.tokenizer:
        import os

        import fsspec.utils

        from ingest_service.sources.tokens import tokenize_options

        url = args.tokenizer
        if fsspec.utils.get_protocol(url) in ("file", "local") and "://" not in url:
            url = os.path.abspath(url)  # the service may produce it from another directory
        options = tokenize_options(url, pack=args.pack, text_field=args.text_field,
                                   eos=args.eos, pad=args.pad)
    elif args.pack is not None:
        raise ValueError("--pack needs --tokenizer: packing works on token sequences")
    return streams.DatasetSpec(
        name=args.dataset, partitions=args.partitions, source=args.source, format=args.format,
        seed=args.seed, epochs=args.epochs or None, sample_len=args.sample_len,
        shuffle_buffer=args.shuffle_buffer, max_record_bytes=args.max_record_bytes,
        options=options,
    )


def _run_ingest(args: argparse.Namespace) -> int:
    return asyncio.run(_ingest(args))


async def _ingest(args: argparse.Namespace) -> int:
    from ingest_service import redis_client
    from ingest_service.datasets import create_dataset, describe_dataset
    from ingest_service.producer.leases import LEASE_MS
    from ingest_service.producer.producer import Producer

    client = redis_client.client(settings.redis_url(args.redis_url))
    try:
        if args.source:
            spec = await create_dataset(client, _spec_from_args(args))
        else:
            try:
                spec = await describe_dataset(client, args.dataset)
            except streams.DatasetNotFoundError as exc:
                # The registry's message names `datasets create`; here the fix is a flag.
                raise streams.DatasetNotFoundError(
                    f"dataset {args.dataset!r} is not registered in this Redis: pass --source "
                    "(an fsspec URL, folder or glob) to create it, or check the Redis URL and "
                    "the name"
                ) from exc
        producer = Producer(client, spec, lease_ms=args.lease_ms or LEASE_MS)
        interrupted = False

        def on_signal(signum: int) -> None:
            nonlocal interrupted
            interrupted = signum == signal.SIGINT
            producer.stop()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        task = asyncio.create_task(producer.run())
        started = time.monotonic()
        up_front = await asyncio.to_thread(epoch_records_up_front, spec)
        count = await _count(client, spec, producer, up_front=up_front)
        baseline = None if count.done is None else (started, count.done)
        while not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            count = await _count(client, spec, producer, count, up_front=up_front)
            if baseline is None and count.done is not None:
                baseline = (time.monotonic(), count.done)
            _show(spec, producer, count, started, baseline, sys.stderr, final=task.done())
        await task
        if interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK
    finally:
        await client.aclose()


async def _count(client: Any, spec: streams.DatasetSpec, producer: Any,
                 before: DatasetCount | None = None, *, up_front: int | None) -> DatasetCount:
    """The dataset's count now; the one ``before`` while Redis is away (the producer
    syncs again on its own: the display must not end the run)."""
    from trainguard.redisio import TRANSIENT

    prog = producer.progress
    try:
        lasts = await last_ids(client, spec)
    except TRANSIENT:
        return before or DatasetCount(done=None, whole=None, epoch_records=prog.epoch_records)
    # The producer's own count of a planned epoch wins over what the source said.
    return count_dataset(lasts, spec, epoch_records=prog.epoch_records, finished=prog.finished,
                         up_front=up_front)


def _show(spec: streams.DatasetSpec, producer: Any, count: DatasetCount, started: float,
          baseline: tuple[float, int] | None, out: TextIO, *, final: bool) -> None:
    prog = producer.progress
    state = "done" if prog.finished else ("stopped" if producer.stopping else "producing")
    line = progress_line(spec, prog, count, state=state, started=started,
                         baseline=baseline)
    if out.isatty():
        out.write("\r\x1b[K" + line + ("\n" if final else ""))
    else:
        out.write(line + "\n")
    out.flush()
