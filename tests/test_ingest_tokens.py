"""Tokenized, packed text at ingest: exact sequences for a fixed corpus and seed, the
same after producer kills, and every document token in exactly one sequence."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from redis.asyncio import Redis
from tokenizers import Tokenizer

from ingest_service.errors import SourceError
from ingest_service.producer.producer import Producer
from ingest_service.sources.files import read_source
from ingest_service.sources.records import BadRecord, GoodRecord
from ingest_service.sources.tokens import dataset_items, tokenize_options, tokenized
from tests._ingest_util import expected_partitions, kill_at_random_points, read_partitions
from tests.servers import RedisServer
from trainguard.core import streams

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
TOKENIZER = str(DATA / "tokenizer.json")
CORPUS = (DATA / "corpus.txt").read_text().splitlines()


def _spec(name: str, source: str, fmt: str = "text", *, pack: int | None = 32,
          **kw: object) -> streams.DatasetSpec:
    opts = tokenize_options(TOKENIZER, pack=pack, pad="<pad>",
                            text_field=str(kw.pop("text_field", "text")))
    base: dict[str, object] = dict(name=name, partitions=4, source=source, format=fmt,
                                   seed=11, shuffle_buffer=64, options=opts)
    base.update(kw)
    return streams.DatasetSpec(**base)  # type: ignore[arg-type]


def _write(folder: Path, docs: list[str], files: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // files)
    for f in range(files):
        (folder / f"part-{f}.txt").write_text("".join(d + "\n" for d in docs[f * per:(f + 1) * per]))
    return str(folder / "*.txt")


def _documents_back(parts: list[list[tuple[bytes, dict[bytes, bytes]]]], eos: int,
                    pad: int) -> list[list[int]]:
    """The token sequences of every partition put back in source order (by their
    ``<file>:<line>@<offset>`` positions), concatenated, the last one's padding cut,
    and split at EOS: the documents as the sequences carry them."""
    seqs = []
    for entries in parts:
        for _, fields in entries:
            where, _, offset = fields[streams.F_POS].decode().rpartition("@")
            path, _, line = where.rpartition(":")
            seqs.append(((path, int(line), int(offset)), streams.decode_record(fields)))
    seqs.sort(key=lambda s: s[0])
    flat = np.concatenate([s for _, s in seqs]).tolist()
    while flat and flat[-1] == pad:
        flat.pop()
    assert flat[-1] == eos
    docs: list[list[int]] = [[]]
    for t in flat[:-1]:
        if t == eos:
            docs.append([])
        else:
            docs[-1].append(t)
    return docs


def _encoded(docs: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(TOKENIZER)
    return [ids for ids in (tok.encode(d, add_special_tokens=False).ids for d in docs) if ids]


async def test_packed_sequences_of_a_fixed_corpus_and_seed_are_pinned(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The first 300 documents of the bundled text, the bundled tokenizer, pack 32,
    seed 11, 4 partitions: the producer writes exactly the planned sequences, and
    they are exactly these (a digest of every partition's IDs and tokens, and the
    first sequence written out). A change here changes every tokenized dataset."""
    source = _write(tmp_path / "c", CORPUS[:300], files=3)
    spec = _spec("pinned", source)
    client = Redis.from_url(redis_server.url)
    await Producer(client, spec).run()
    await client.aclose()
    parts = read_partitions(redis_server.url, spec)
    assert parts == expected_partitions(spec)
    digest = hashlib.sha256()
    for entries in parts:
        for sid, fields in entries:
            arr = streams.decode_record(fields)
            assert arr.dtype == np.int32 and arr.shape == (32,)
            digest.update(sid + b"=" + arr.tobytes())
    first = streams.decode_record(parts[0][0][1]).tolist()
    assert sum(map(len, parts)) == 324
    assert digest.hexdigest() == "e0ae483f33cfc875d5b4488d1bc75fe1adb6c6bc8cef741301381a1762ac17dc"
    # One document's end, its EOS (0), the next one's start ("Day 37. A gull..."):
    # documents run across sequence boundaries.
    assert first == [359, 15, 262, 324, 323, 357, 260, 345, 346, 473, 260, 472, 469, 15, 262, 351,
                     341, 260, 387, 385, 15, 0, 280, 475, 24, 15, 368, 369, 406, 276, 376, 375]


async def test_every_document_token_lands_in_exactly_one_sequence(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Put back in source order, the sequences of all partitions are the documents'
    tokens, each document once and followed by EOS, in source order, over file
    boundaries; only the last sequence is padded; documents without tokens (blank
    lines) are not there; every sequence has a distinct position."""
    docs = CORPUS[:500]
    docs[7] = ""  # a blank line is no document
    source = _write(tmp_path / "c", docs, files=4)
    spec = _spec("once", source, pack=48)
    client = Redis.from_url(redis_server.url)
    await Producer(client, spec).run()
    await client.aclose()
    parts = read_partitions(redis_server.url, spec)
    tok = Tokenizer.from_file(TOKENIZER)
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    assert _documents_back(parts, eos, pad) == _encoded(docs)
    positions = [f[streams.F_POS] for entries in parts for _, f in entries]
    assert len(set(positions)) == len(positions)


def test_kill_9_producer_mid_epoch_writes_the_same_sequences(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The producer of a packed dataset (4,000 documents, about 9,000 sequences) is
    SIGKILLed at 4 random points mid-epoch and restarted each time: the partitions
    hold exactly the sequences of an uninterrupted run, and every document token is
    in exactly one of them."""
    docs = CORPUS * 2
    source = _write(tmp_path / "c", docs, files=4)
    spec = _spec("killed", source, pack=16, partitions=8, shuffle_buffer=500)
    total = sum(1 for _ in dataset_items(spec))
    landed = kill_at_random_points(redis_server.url, spec, total, 4, seed=16)
    assert landed >= 3
    parts = read_partitions(redis_server.url, spec)
    assert parts == expected_partitions(spec)
    tok = Tokenizer.from_file(TOKENIZER)
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    assert _documents_back(parts, eos, pad) == _encoded(docs)


def test_a_process_pool_gives_the_same_records_as_one_process(tmp_path: Path) -> None:
    """Tokenizing in two spawned processes yields the same records, in the same order,
    as tokenizing in the producer's own process."""
    source = _write(tmp_path / "c", CORPUS[:1200], files=2)
    spec = _spec("pool", source, pack=None)
    inline = list(tokenized(spec, read_source(spec), processes=0))
    pooled = list(tokenized(spec, read_source(spec), processes=2))
    assert [(r.pos, r.data, r.meta) for r in inline] == [(r.pos, r.data, r.meta) for r in pooled]
    assert len(inline) == 1200
    first = streams.decode_record(inline[0].fields)
    assert first.tolist() == [*_encoded(CORPUS[:1])[0], Tokenizer.from_file(TOKENIZER)
                              .token_to_id("<|endoftext|>")]


def test_jsonl_text_field_and_bad_records(tmp_path: Path) -> None:
    """jsonl documents come from ``text_field``; a line without it, or with a number
    there, is a schema dead letter; a broken line stays an undecodable one; the rest
    are tokenized."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "Day one."}\n{"other": 1}\n{"body": 7}\n{"body": broken\n'
                    '{"body": "Day two."}\n')
    spec = _spec("js", str(path), "jsonl", pack=None, text_field="body")
    items = list(dataset_items(spec))
    good = [i for i in items if isinstance(i, GoodRecord)]
    bad = sorted((i.pos.rpartition(":")[2], i.reason) for i in items if isinstance(i, BadRecord))
    assert [streams.decode_record(g.fields)[:-1].tolist() for g in good] == _encoded(
        ["Day one.", "Day two."])
    assert bad == [("2", "schema"), ("3", "schema"), ("4", "undecodable")]


def test_a_changed_tokenizer_file_is_refused(tmp_path: Path) -> None:
    """The dataset pins its tokenizer's hash: a producer finding another file under the
    same name refuses to produce (its sequences would differ from those in Redis)."""
    tok_path = tmp_path / "tok.json"
    tok_path.write_bytes(Path(TOKENIZER).read_bytes())
    opts = tokenize_options(str(tok_path), pack=8)
    spec = streams.DatasetSpec(name="t", source=str(DATA / "corpus.txt"), format="text",
                               options=opts)
    assert next(iter(dataset_items(spec))) is not None
    doc = json.loads(tok_path.read_text())
    doc["added_tokens"][0]["content"] = "<|end|>"
    tok_path.write_text(json.dumps(doc))
    with pytest.raises(SourceError, match="changed since the dataset was created"):
        next(iter(dataset_items(spec)))


def test_a_tokenizer_without_the_eos_token_is_a_clear_error() -> None:
    with pytest.raises(SourceError, match="has no eos token '</s>'"):
        tokenize_options(TOKENIZER, eos="</s>")
    with pytest.raises(SourceError, match="cannot be read"):
        tokenize_options("/nonexistent/tokenizer.json")


def test_the_bundled_tokenizer_is_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    """``examples/data/build.py`` regenerates the shipped corpus and tokenizer exactly
    (the files in the repository are what the script says they are)."""
    code = ("import sys; sys.path.insert(0, 'examples/data'); import build; from pathlib import Path;"
            f"t = Path({str(tmp_path)!r}); (t / 'c.txt').write_text('\\n'.join(build.corpus()) + '\\n');"
            "build.train_tokenizer(t / 'c.txt', t / 'tok.json')")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert (tmp_path / "c.txt").read_bytes() == (DATA / "corpus.txt").read_bytes()
    assert (tmp_path / "tok.json").read_bytes() == Path(TOKENIZER).read_bytes()
