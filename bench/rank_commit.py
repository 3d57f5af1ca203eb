"""One rank's commit work and a manifest's size at 1,024-16,384 ranks x 65,536
partitions: the per-rank layout (session record 3) against the gather of version 2.

Starts its own redis-server (``tests/servers.py``) holding the run's fence of every
partition, then per size, in interleaved rounds (old, new, old, new, ...):

- old: a rank's fence check of all P partitions (pipelined GETs) and its part of the
  all-gather: pickling its payload (offsets and batch counts of all P, its random
  states) and unpickling and merging the W payloads it receives. Merging all W
  payloads of a size does not fit one machine (16,384 x 1.4 MB); the merge is
  measured over 8 payloads and scaled by W / 8 (it is linear in W: one pass over each
  payload). Said so in the output.
- new: the fence check of the rank's own P/W partitions and the encoding of its state
  object (``RankRecord`` + canonical JSON + digest, as ``save(rank_state=)`` does).

Prints, per size, each side's median (range) and the median of the paired ratios
old/new with their range, and the manifest's session-related bytes of both layouts
(version 2: the record with every offset and every rank's random states; version 3:
the run-wide record plus 35 bytes of index per rank). The collective's transport (the
bytes on the wire) is not in either figure: it only adds to the old side.

    .venv/bin/python bench/rank_commit.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint_store.rank_state import digest, encode_rank_state
from tests.servers import RedisServer
from trainer_client import _rng, redis_client
from trainer_client import offsets as ofs
from trainguard.core import streams
from trainguard.core.rank_record import RankRecord
from trainguard.core.record import RankState, SessionRecord

DATASET, RUN = "bench", "scale"
MERGED = 8  # payloads actually merged per old round; scaled by W / MERGED


def _merge(payloads: list[bytes]) -> None:
    """What gather_offsets does with the payloads it received (without the wire)."""
    merged: dict[int, str] = {}
    counts: dict[int, int] = {}
    for raw in payloads:
        offs, bats, state = pickle.loads(raw)
        for p, i in offs.items():
            merged[p] = streams.max_id(merged.get(p), i) or i
        for p, n in bats.items():
            counts[p] = max(counts.get(p, 0), n)
        RankState.from_wire(state)


def old_commit(client, P: int, W: int, payload: bytes) -> float:
    t0 = time.perf_counter()
    ofs.current_generations(client, DATASET, RUN, P)
    pickle.dumps(pickle.loads(payload))  # its own payload, pickled
    t1 = time.perf_counter()
    _merge([payload] * MERGED)
    merge_s = time.perf_counter() - t1
    return (t1 - t0) + merge_s * W / MERGED


def new_commit(client, P: int, W: int, state: RankState) -> float:
    t0 = time.perf_counter()
    mine = streams.rank_partitions(P, world_size=W, num_workers=0, rank=W // 2)
    ofs.current_generations(client, DATASET, RUN, mine)
    own = RankRecord(rank=W // 2, world_size=W, num_workers=0,
                     offsets={p: "1-41" for p in mine}, batches={p: 5 for p in mine},
                     state=state)
    digest(encode_rank_state(own.to_wire(), uid="0" * 16 + "-" + "0" * 8, step=1,
                             rank=W // 2, world_size=W))
    return time.perf_counter() - t0


def manifest_bytes(P: int, W: int, state: RankState) -> tuple[int, int]:
    base = dict(dataset=DATASET, run=RUN, partitions=P, generation=1, commit=1,
                world_size=W, num_workers=0, seed=1)
    one_rank = len(json.dumps(state.to_wire(), separators=(",", ":"))) + 10
    v2_offsets = SessionRecord(**base, offsets={p: "1-41" for p in range(P)},
                               batches={p: 5 for p in range(P)}, version=2)
    v2 = len(json.dumps(v2_offsets.to_extra(), separators=(",", ":"))) + W * one_rank
    v3 = len(json.dumps(SessionRecord(**base, version=3).to_extra(),
                        separators=(",", ":"))) + W * 35 + 40
    return v2, v3


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, default=streams.MAX_PARTITIONS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    P = args.partitions
    state = RankState(rng=_rng.capture(), epoch=0, epoch_batches=5)
    payload = pickle.dumps(({p: "1-41" for p in range(P)}, {p: 5 for p in range(P)},
                            state.to_wire()))
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            client = redis_client.client(server.url)
            pipe = client.pipeline(transaction=False)
            for p in range(P):
                pipe.set(streams.fence_key(DATASET, p, RUN), 1)
            pipe.execute()
            print(f"single redis-server, {P} partitions, {args.rounds} interleaved rounds; "
                  f"the old merge is measured over {MERGED} payloads and scaled by W/{MERGED} "
                  "(composed: one machine cannot hold W payloads); seconds, median (range)")
            print(f"{'ranks':>6} {'old commit s':>24} {'new commit s':>26} "
                  f"{'old/new':>22} {'manifest v2 B':>14} {'v3 B':>9}")
            for W in args.ranks:
                olds, news, ratios = [], [], []
                for _ in range(args.rounds):
                    o = old_commit(client, P, W, payload)
                    n = new_commit(client, P, W, state)
                    olds.append(o)
                    news.append(n)
                    ratios.append(o / n)
                v2, v3 = manifest_bytes(P, W, state)
                print(f"{W:>6} {spread(olds):>24} {spread(news):>26} {spread(ratios):>22} "
                      f"{v2:>14} {v3:>9}")
            client.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
