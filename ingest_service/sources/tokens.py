"""Text into token records at ingest: tokenize with a local Hugging Face tokenizer,
then (optionally) pack documents into fixed-length sequences.

A dataset tokenizes when its ``options`` name a tokenizer (``trainguard ingest
--tokenizer tokenizer.json [--pack N]``; :func:`tokenize_options` makes the options):

- ``tokenizer``: fsspec URL of a ``tokenizer.json`` (read at run time; never a hub
  download), ``tokenizer_sha256``: its content hash. The token order is part of the
  dataset's identity, so a producer that finds another file there refuses to go on.
- ``text_field``: where the text is in a structured record (jsonl, parquet, hf,
  webdataset rows); a ``text`` line is its own document.
- ``eos``: the token that ends every document (it must be in the vocabulary).
- ``pack``: with it, documents are concatenated in source order, each followed by
  EOS, and cut into records of exactly ``pack`` tokens (a document longer than the
  rest of a sequence continues in the next one); the last sequence of an epoch is
  filled up with ``pad`` (default: EOS). Without it, each document is one record of
  its tokens and EOS.

Records are NumPy ``int32`` arrays (``kind=nd``), so the trainer gets a ready
``[batch, pack]`` tensor without a collate. A packed record's position is
``<document position>@<token offset>`` of its first token: unique, and enough to
put every sequence back in document order.

Throughput: documents are encoded in blocks, in a pool of spawned processes when
the machine has cores to spare (``TRAINGUARD_TOKENIZE_PROCESSES``), in order, so the
output is the same with or without the pool.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import msgpack
import numpy as np

from ingest_service.errors import SourceError
from ingest_service.sources.files import read_source
from ingest_service.sources.records import BadRecord, GoodRecord, Meta, SourceItem
from trainguard.core import settings, streams

__all__ = ["TokenizeConfig", "dataset_items", "tokenize_options", "tokenized"]

DEFAULT_EOS = "<|endoftext|>"
BLOCK_DOCS = 256
"""Documents per encode call (and per task of the pool): big enough that a task's
pickling is small next to its encoding, small enough to keep memory at a few blocks."""
_DTYPE = np.dtype("<i4")


@dataclass(frozen=True)
class TokenizeConfig:
    tokenizer: str
    sha256: str
    text_field: str
    eos: str
    pad: str
    pack: int | None

    @classmethod
    def from_spec(cls, spec: streams.DatasetSpec) -> TokenizeConfig | None:
        opts = spec.options
        if not opts.get("tokenizer"):
            return None
        pack = opts.get("pack")
        if pack is not None and (not isinstance(pack, int) or pack < 1):
            raise SourceError(f"dataset {spec.name!r}: pack must be a positive number of "
                              f"tokens, got {pack!r}")
        if spec.format in ("npy", "files"):
            raise SourceError(f"dataset {spec.name!r}: a {spec.format} source holds no text "
                              "to tokenize; use text, jsonl, parquet, hf or webdataset")
        eos = str(opts.get("eos", DEFAULT_EOS))
        return cls(tokenizer=str(opts["tokenizer"]), sha256=str(opts.get("tokenizer_sha256", "")),
                   text_field=str(opts.get("text_field", "text")), eos=eos,
                   pad=str(opts.get("pad", eos)), pack=pack)


def _read_tokenizer(url: str) -> str:
    try:
        with fsspec.open(url, "rb") as f:
            raw: bytes = f.read()
    except (OSError, ValueError) as exc:
        raise SourceError(f"tokenizer {url!r} cannot be read ({exc}): expected a local "
                          "tokenizer.json (Hugging Face tokenizers format) or an fsspec URL") from exc
    return raw.decode("utf-8")


def _token_id(tokenizer: Any, token: str, url: str, what: str) -> int:
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise SourceError(f"tokenizer {url!r} has no {what} token {token!r}: add it as a "
                          f"special token when training the tokenizer, or name another with --{what}")
    return int(tid)


def _load(url: str) -> tuple[str, Any]:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise SourceError("tokenizing at ingest needs Hugging Face tokenizers: "
                          "pip install 'trainguard[hf]' (or tokenizers)") from exc
    text = _read_tokenizer(url)
    try:
        return text, Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exception on a bad file
        raise SourceError(f"tokenizer {url!r} is not a tokenizers JSON file: {exc}") from exc


def tokenize_options(
    tokenizer: str, *, pack: int | None = None, text_field: str = "text",
    eos: str = DEFAULT_EOS, pad: str | None = None,
) -> dict[str, Any]:
    """The dataset options that make its source tokenized (and packed): checks the
    tokenizer now (readable, has EOS and pad) and pins its content hash."""
    text, tok = _load(tokenizer)
    _token_id(tok, eos, tokenizer, "eos")
    opts: dict[str, Any] = {"tokenizer": tokenizer,
                            "tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest(),
                            "text_field": text_field, "eos": eos}
    if pad is not None:
        _token_id(tok, pad, tokenizer, "pad")
        opts["pad"] = pad
    if pack is not None:
        if pack < 1:
            raise SourceError(f"--pack must be a positive number of tokens, got {pack}")
        opts["pack"] = pack
    return opts


# --------------------------------------------------------------------------- documents


def _text_of(value: Any, field: str) -> str | None:
    if isinstance(value, dict):
        value = value.get(field)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


Doc = tuple[bytes, str]
"""A document to tokenize: (its source position, its text)."""


def _documents(items: Iterable[SourceItem], field: str) -> Iterator[Doc | BadRecord]:
    for item in items:
        if item.__class__ is BadRecord:
            yield item  # type: ignore[misc]
            continue
        rec: GoodRecord = item  # type: ignore[assignment]
        kind = dict(rec.meta).get(streams.F_KIND)
        value = msgpack.unpackb(rec.data, raw=False) if kind == streams.KIND_MSGPACK else rec.data
        text = _text_of(value, field)
        if text is None:
            yield BadRecord(rec.pos.decode(), "schema",
                            f"expected text (a str, UTF-8 bytes, or an object with a {field!r} "
                            "string field)", rec.data)
        else:
            yield rec.pos, text


# --------------------------------------------------------------------------- encoding

_WORKER_TOKENIZER: list[Any] = []


def _init_worker(text: str) -> None:
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER[:] = [Tokenizer.from_str(text)]


def _encode(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One flat int32 array of every text's tokens and the texts' lengths: two
    buffers to pickle from a pool worker instead of a list per document."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for seq in ids for t in seq), dtype=_DTYPE, count=int(lengths.sum()))
    return flat, lengths


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode(_WORKER_TOKENIZER[0], texts)


def default_processes() -> int:
    """Pool size: ``$TRAINGUARD_TOKENIZE_PROCESSES``, else one per core beyond two
    (on two cores the producer and Redis have them; tokenizers' own threads help)."""
    return settings.tokenize_processes(os.cpu_count() or 1)


Block = list[Doc | BadRecord]


def _blocks(docs: Iterable[Doc | BadRecord]) -> Iterator[Block]:
    block: Block = []
    texts = 0
    for d in docs:
        block.append(d)
        if d.__class__ is tuple:
            texts += 1
            if texts >= BLOCK_DOCS:
                yield block
                block, texts = [], 0
    if block:
        yield block


def _texts(block: Block) -> list[str]:
    return [d[1] for d in block if d.__class__ is tuple]  # type: ignore[index]


def _encoded(blocks: Iterable[Block], text: str, tokenizer: Any,
             processes: int) -> Iterator[tuple[Block, tuple[np.ndarray, np.ndarray]]]:
    """Each block with its encoding, in block order."""
    if processes <= 0:
        for block in blocks:
            yield block, _encode(tokenizer, _texts(block))
        return
    import multiprocessing

    # spawn, not fork: the producer runs an event loop and tokenizers' thread pool,
    # neither of which survives a fork.
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(text,))
    pending: deque[tuple[Block, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
    try:
        for block in blocks:
            pending.append((block, pool.submit(_encode_in_worker, _texts(block))))
            if len(pending) >= 2 * processes:
                done, fut = pending.popleft()
                yield done, fut.result()
        while pending:
            done, fut = pending.popleft()
            yield done, fut.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- records


def _meta(n: int) -> Meta:
    return ((streams.F_KIND, streams.KIND_NDARRAY), (streams.F_DTYPE, _DTYPE.str.encode()),
            (streams.F_SHAPE, str(n).encode()))


class Packer:
    """Documents in, sequences of exactly ``length`` tokens out (see the module)."""

    def __init__(self, length: int, eos: int, pad: int) -> None:
        self.length, self.eos, self.pad = length, eos, pad
        self.meta = _meta(length)
        self._parts: list[np.ndarray] = []
        self._held = 0
        self._docs: deque[tuple[int, bytes]] = deque()
        """(global index of its first token, position) of each document that still has
        tokens not emitted, oldest first."""
        self._total = 0
        self._emitted = 0

    def add(self, pos: bytes, ids: np.ndarray) -> Iterator[GoodRecord]:
        doc = np.empty(len(ids) + 1, dtype=_DTYPE)
        doc[:-1] = ids
        doc[-1] = self.eos
        self._docs.append((self._total, pos))
        self._total += len(doc)
        self._parts.append(doc)
        self._held += len(doc)
        if self._held >= self.length:
            yield from self._cut(final=False)

    def finish(self) -> Iterator[GoodRecord]:
        """The last sequence, filled up with pad tokens (nothing when none is open)."""
        if self._held:
            yield from self._cut(final=True)

    def _cut(self, *, final: bool) -> Iterator[GoodRecord]:
        flat = np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
        n = len(flat) // self.length
        if final and len(flat) % self.length:
            flat = np.concatenate([flat, np.full(self.length - len(flat) % self.length,
                                                 self.pad, dtype=_DTYPE)])
            n += 1
        for k in range(n):
            start = self._emitted
            while len(self._docs) > 1 and self._docs[1][0] <= start:
                self._docs.popleft()
            first, pos = self._docs[0]
            seq = flat[k * self.length:(k + 1) * self.length]
            yield GoodRecord(seq.tobytes(), b"%b@%d" % (pos, start - first), self.meta)
            self._emitted += self.length
        rest = flat[n * self.length:]
        self._parts = [rest] if len(rest) else []
        self._held = len(rest)
        if final:
            self._docs.clear()


def tokenized(spec: streams.DatasetSpec, items: Iterable[SourceItem], *,
              processes: int | None = None) -> Iterator[SourceItem]:
    """``items`` (one epoch of the source, in source order) as token records; bad
    records pass through, documents without text become ``schema`` bad records, and
    documents of no tokens are skipped."""
    cfg = TokenizeConfig.from_spec(spec)
    if cfg is None:
        yield from items
        return
    text, tok = _load(cfg.tokenizer)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if cfg.sha256 and digest != cfg.sha256:
        raise SourceError(
            f"dataset {spec.name!r}: tokenizer {cfg.tokenizer!r} changed since the dataset was "
            f"created (sha256 {digest[:12]}..., expected {cfg.sha256[:12]}...); its token "
            "sequences would differ from those already produced: restore the file, or "
            "create a new dataset"
        )
    eos = _token_id(tok, cfg.eos, cfg.tokenizer, "eos")
    pad = _token_id(tok, cfg.pad, cfg.tokenizer, "pad")
    packer = None
    if cfg.pack is not None:
        size = cfg.pack * _DTYPE.itemsize
        if size > spec.max_record_bytes:
            raise SourceError(f"dataset {spec.name!r}: sequences of {cfg.pack} tokens are "
                              f"{size} bytes, over max_record_bytes {spec.max_record_bytes}")
        packer = Packer(cfg.pack, eos, pad)
    workers = default_processes() if processes is None else processes
    blocks = _blocks(_documents(items, cfg.text_field))
    for block, (flat, lengths) in _encoded(blocks, text, tok, workers):
        ends = np.cumsum(lengths)
        k = 0
        for d in block:
            if d.__class__ is not tuple:
                yield d  # type: ignore[misc]
                continue
            pos, _ = d  # type: ignore[misc]
            ids = flat[ends[k] - lengths[k]:ends[k]]
            k += 1
            if not len(ids):
                continue
            if packer is not None:
                yield from packer.add(pos, ids)
                continue
            rec = np.append(ids, np.int32(eos)).astype(_DTYPE)
            if rec.nbytes > spec.max_record_bytes:
                yield BadRecord(pos.decode(), "oversized",
                                f"{len(rec)} tokens, {rec.nbytes} bytes, limit "
                                f"{spec.max_record_bytes}", rec.tobytes()[:streams.DL_PAYLOAD_LIMIT])
            else:
                yield GoodRecord(rec.tobytes(), pos, _meta(len(rec)))
    if packer is not None:
        yield from packer.finish()


def dataset_items(spec: streams.DatasetSpec,
                  storage_options: Mapping[str, Any] | None = None) -> Iterator[SourceItem]:
    """One epoch of the dataset's records in source order: its source's records,
    tokenized and packed when the dataset says so."""
    items = read_source(spec, storage_options)
    if TokenizeConfig.from_spec(spec) is None:
        return items
    return tokenized(spec, items)
