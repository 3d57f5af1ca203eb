"""Full batches across partitions, proved by the ledger: a deterministic job
SIGKILLed at random moments and resumed trains every record exactly once, every
batch it trains holds ``batch_size`` records but at most one per epoch per rank, and
it trains exactly the batches an uninterrupted run does (bitwise resume); with
``drop_last`` that one short batch is consumed unseen: its records are acknowledged
(the committed offsets reach each partition's end), never trained, never read again.

The data are uneven on purpose: 3003 records over 6 partitions (501 or 500 each), so
with batches of 8 every partition ends mid-batch (one-partition batches would leave
6 short ones) while the epoch as a whole leaves one short batch of 3 records."""

from __future__ import annotations

from pathlib import Path

import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from trainer_client import redis_client
from trainguard.core import streams

N = 3003
P = 6
BS = 8


def _args(url: str, store: str, run: str, trace: Path, *extra: str) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", run, "--store", store,
            "--n", str(N), "--batch-size", str(BS), "--ckpt-every", "8", "--sleep-ms", "2",
            "--deterministic", "--trace", str(trace), *extra]


def _batches(trace: Path) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in line.split()) for line in trace.read_text().splitlines()]


def _offsets_reach_the_ends(url: str, store: str, run: str) -> None:
    """The final checkpoint and Redis's committed offsets are each partition's last
    ID, and nothing is pending: every record was acknowledged."""
    _, extra = ledger.final_counts(store, N)
    client = redis_client.client(url)
    progress = client.hgetall(streams.progress_key("tok"))
    ends = {p: progress[streams.progress_end_field(p)].decode() for p in range(P)}
    assert streams.offsets_from_wire(extra["trainguard"]["offsets"]) == ends
    assert streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", run))) == ends
    for p in range(P):
        assert client.xpending(streams.partition_key("tok", p), run)["pending"] == 0


def test_full_batches_survive_kills_exactly_once_and_bitwise(redis_server, tmp_path: Path) -> None:
    """8 SIGKILLs of a deterministic job: 0 lost, 0 duplicated; every batch trained is
    full but one (3 records, the epoch's last); and the set of batches trained (a
    killed attempt's uncommitted batches are trained again, identically) is exactly
    an uninterrupted run's, each batch the same records in the same order."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    ref_store, store = f"file://{tmp_path}/ref", f"file://{tmp_path}/ckpt"
    ref_trace, trace = tmp_path / "ref.trace", tmp_path / "job.trace"
    ledger.run_until_done(_args(redis_server.url, ref_store, "ref", ref_trace), kills=0,
                          seed=0, log=tmp_path / "ref.log")
    kills = ledger.run_until_done(_args(redis_server.url, store, "exp", trace), kills=8,
                                  seed=11, log=tmp_path / "job.log")
    assert kills == 8
    counts, _ = ledger.final_counts(store, N)
    ledger.assert_each_once(counts)
    _offsets_reach_the_ends(redis_server.url, store, "exp")

    ref = _batches(ref_trace)
    assert len(ref) == -(-N // BS) and len(set(ref)) == len(ref)
    assert [len(b) for b in ref] == [BS] * (N // BS) + [N % BS]
    got = _batches(trace)
    assert set(got) == set(ref), "a resumed run trained batches an uninterrupted one does not"
    assert {b for b in got if len(b) != BS} == {ref[-1]}
    # Batches span partitions: the short one is the epoch's last, not a partition's.
    assert any(len({i % P for i in b}) > 1 for b in ref)


def test_drop_last_acknowledges_the_one_short_batch_and_trains_the_rest_once(
        redis_server, tmp_path: Path) -> None:
    """drop_last with 5 SIGKILLs: every batch trained is full; exactly the records of
    the epoch's one short batch (3 of them: N mod 8) are never trained, every other
    record is trained once, and the dropped records are acknowledged (committed
    offsets at the partitions' ends, nothing pending), so no resume reads them."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store, trace = f"file://{tmp_path}/ckpt", tmp_path / "job.trace"
    kills = ledger.run_until_done(_args(redis_server.url, store, "exp", trace, "--drop-last"),
                                  kills=5, seed=5, log=tmp_path / "job.log")
    assert kills == 5
    counts, _ = ledger.final_counts(store, N)
    got = _batches(trace)
    assert got and all(len(b) == BS for b in got)
    trained = {i for b in got for i in b}
    dropped = sorted(set(range(N)) - trained)
    assert len(dropped) == N % BS
    expect = torch.ones(N)
    expect[dropped] = 0
    assert torch.equal(counts, expect), "records other than the dropped batch's were lost or repeated"
    _offsets_reach_the_ends(redis_server.url, store, "exp")
