"""Commit, loop stall and restore at W simulated ranks x P partitions: per-rank costs
measured with the calls a rank makes, on sampled ranks, and composed (``bench/scale.py``'s
default; the per-operation figures of the older bench are ``--per-op``).

For each P (``--partitions``) the Redis under test holds a real dataset of P
partitions (the file ``Producer``, ``--entries`` records of ``--record-bytes`` each),
a run's consumer group, fence and seek on every partition (a ``TrainingSession``'s
first restore). For each W (``--ranks``) a checkpoint of W ranks is laid down with the
store's own code: a real one-rank save, then the objects of all W ranks (offsets of
its P/W partitions, batch counts, random states) and a manifest indexing the W of
them (``checkpoint_store.rank_state``). Then, in interleaved rounds (new, baseline in a
Latin square, ``bench/rounds.py``), on ``--sample`` ranks spread over 0..W-1:

- new (session record 4, main as it is): a rank's ``checkpoint()`` call (the loop's
  stall) is the capture of its random states; in the background it writes its state
  object (fsync'd, as ``saving._write_rank_state``) and checks the fences of its own
  partitions (the save's precommit; before this change that check was on the loop's
  path: ``stall_with_fence_s``), rank 0 writes the manifest of W index entries, and
  each rank's ``OffsetCommitter.publish`` acknowledges and publishes its own
  partitions; only rank 0 lists the store for the retention floor and publishes the
  kept checkpoints (``streams.kept_key``), every other rank GETs that key
  (``OffsetCommitter(lists=rank == 0)``, as ``_session_base`` makes it).
- baseline (record 2, reproduced: the calls the old commit made, with the real
  functions): the fence check of all P partitions on every rank, the all-gather
  through ``gather_offsets`` itself (a rank unpickles and merges W payloads of all P
  offsets; measured over ``--merged`` payloads on a one-rank gloo group and scaled by
  W / merged: the merge is one pass per payload), then rank 0 publishes all P; the
  manifest holds every offset and every rank's random states (its bytes computed
  exactly from the record's JSON, its encode and parse measured up to
  ``--v2-max-ranks`` ranks and scaled by bytes beyond; said so in the output).
- restore (new, as ``_restore._take_and_place``): rank 0 takes the generation from
  the run's counter (``take_generation``, one key); each sampled rank loads the newest
  checkpoint (``CheckpointStore.load``), reads its own object (same W) or the objects
  of the ranks that owned its partitions (W x 0.75 and W x 1.25, through
  ``rank_record.positions``), and places its partitions (``place_partitions``: one
  script call per rank that raises their fences, seeks and acknowledges); the one
  int64 MAX all-reduce after is not measured; rank 0 closes the older readers
  (``evict_readers``). Beside it in every round, main's restore before that
  (``two_pass``: every rank's fences raised by a pass of their own,
  ``fence_partitions``, before rank 0 closes the readers and the ranks place), with
  the servers' command CPU per partition of both. The baseline (record 2): rank 0
  bumps the fence of all P (``bump_generation``) and each rank parses the whole
  version 2 manifest instead.

Composition (ranks run in parallel on their own hosts; all their Redis work lands on
the same servers, so its CPU is summed and spread over the masters)::

    across(x)  = max(max over sampled ranks of x's wall,
                     mean over sampled ranks of x's server CPU x W / masters)
    stall      = across(random states)        [baseline: + fence check, + W/merged x merge]
    commit     = stall + across(object write + fence check) + rank 0's manifest write
                 + across(publish)
    restore    = rank 0's take + across(load + objects + fence + seek + ack)
                 + rank 0's eviction                         [over the W' restoring ranks]
                 [two_pass: + across(own fences) before the placement]
    restore    = rank 0's bump of all P + across(load + manifest + seek + ack)  [baseline]
    Redis CPU per checkpoint = mean server CPU per sampled rank x W (+ rank 0's publish)
    per-rank commit work = the slowest sampled rank but 0 (states + object + fence check
                 + publish); rank 0's apart (the same + the manifest and the listing:
                 its index holds W entries, O(W) by design)

Not in either side: the transport of the collectives (the baseline's W payloads of
~21.5 B x P to every rank; the new side's report of a digest to rank 0), and the
tensors themselves (a tiny model on both sides).
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
from _scale_ops import Target, ingest

from checkpoint_store.backends import open_backend
from checkpoint_store.layout import LATEST, data_dir, manifest_path, new_uid
from checkpoint_store.manifest import encode_manifest
from checkpoint_store.rank_state import digest, encode_rank_state, make_index, rank_state_path
from checkpoint_store.saving import latest_pointer
from trainer_client import TrainingSession, _rng, redis_client
from trainer_client import offsets as ofs
from trainer_client._commit import OffsetCommitter, PositionReader, gather_offsets
from trainguard.core import streams
from trainguard.core.checkpoints import open_store, rank_state_store
from trainguard.core.rank_record import RankRecord, positions
from trainguard.core.record import RECORD_VERSION, RankState, SessionRecord

RUN = "scale"
CHANGES = {"same": 1.0, "minus25": 0.75, "plus25": 1.25}


# Commands a script or a MULTI/EXEC runs inside Redis 7 are counted twice by ``INFO
# commandstats``: in the EVALSHA's (or EXEC's) own usec and again as calls of their own
# (measured 1.6x on a restore's seek-and-ack). So a block counts each command name's
# usec in the share of its calls that this process sent on their own; a script's call
# and an EXEC count whole, the commands inside them not at all. Every redis-py
# connection packs a command through one of two serializers, a transaction's queued
# commands between its MULTI and EXEC.
WHOLE = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro", "exec"})
SENT: collections.Counter[str] = collections.Counter()
_queued = threading.local()


def _count_sent() -> None:
    from redis.connection import HiredisRespSerializer, PythonRespSerializer

    for cls in (HiredisRespSerializer, PythonRespSerializer):
        if getattr(cls.pack, "_counted", False):
            continue
        inner = cls.pack

        def pack(self: Any, *args: Any, _inner: Any = inner) -> Any:
            name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
            name = name.split(" ", 1)[0].lower()
            if name == "multi":
                _queued.on = True
            elif name in ("exec", "discard"):
                _queued.on = False
            if not getattr(_queued, "on", False) or name == "multi":
                SENT[name] += 1
            return _inner(self, *args)

        pack._counted = True  # type: ignore[attr-defined]
        cls.pack = pack  # type: ignore[method-assign]


class Servers:
    """The masters' own account of the CPU their commands took (``INFO commandstats``
    usec: microseconds, where /proc counts 10 ms ticks, too coarse for one rank's few
    commands; it leaves out reading and writing the sockets). The INFO commands that
    read it are not counted: they are this bench's, no rank sends them, and their
    usec (16-36 us a reading, varying with the reply) was a floor under every block,
    x W: 0.27 s at 16,384 ranks for a block that sends no command. A script's inner
    commands are counted once, inside the script (``WHOLE``)."""

    def __init__(self, t: Target):
        _count_sent()
        self.clients = [redis.Redis(port=n.port) for n in t._nodes("master")]
        # What is left of a reading's own cost (none with INFO left out): taken off.
        self.own = statistics.median(self.between(self.stats(), self.stats(), SENT.copy())
                                     for _ in range(9))

    def stats(self) -> dict[str, tuple[int, int]]:
        """Calls and usec by command name (subcommands with their command), all masters."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.clients:
            for k, v in c.info("commandstats").items():
                name = k.removeprefix("cmdstat_").split("|", 1)[0]
                calls, usec = out.get(name, (0, 0))
                out[name] = (calls + int(v["calls"]), usec + int(v["usec"]))
        return out

    @staticmethod
    def between(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]],
                sent0: collections.Counter[str]) -> float:
        """The command CPU from ``a`` to ``b`` in seconds, each command counted once."""
        cpu = 0.0
        for name, (calls, usec) in b.items():
            calls0, usec0 = a.get(name, (0, 0))
            n, us = calls - calls0, usec - usec0
            if name == "info" or n <= 0:
                continue
            share = 1.0 if name in WHOLE else min(1.0, (SENT[name] - sent0[name]) / n)
            cpu += us * share
        return cpu / 1e6

    def close(self) -> None:
        for c in self.clients:
            c.close()


class Clock:
    """Wall seconds and the masters' command CPU around a block."""

    def __init__(self, d: Data):
        self.servers = d.servers

    def __enter__(self) -> Clock:
        self.sent0 = SENT.copy()
        self.stats0 = self.servers.stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        cpu = self.servers.between(self.stats0, self.servers.stats(), self.sent0)
        self.server_cpu_s = max(0.0, cpu - self.servers.own)


def _direct(fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
    return fn(*a, **k)


class _Listings:
    """Counts a store's listings (the output says how many ranks listed per commit)."""

    def __init__(self, store: Any):
        self.count = 0
        inner = store.list

        def counted() -> Any:
            self.count += 1
            return inner()

        store.list = counted


def mean_w(server_cpu: list[float], world: int, masters: int) -> float:
    return statistics.mean(server_cpu) * world / masters


def across(walls: list[float], server_cpu: list[float], world: int, masters: int) -> float:
    """The parallel ranks' time: the slowest sampled rank, or the servers' CPU of all W
    ranks spread over the masters when that is longer (they queue on the servers)."""
    return max(max(walls), statistics.mean(server_cpu) * world / masters)


def sample_ranks(world: int, n: int) -> list[int]:
    return sorted({round(i * (world - 1) / max(1, n - 1)) for i in range(n)})


class Data:
    """P partitions of real records in Redis, the run's group on them, their IDs."""

    def __init__(self, t: Target, work: Path, P: int, args: argparse.Namespace):
        self.t, self.P, self.work, self.workers = t, P, work, args.workers
        self.name = f"scale{P}"
        self.ingest = ingest(t, work, self.name, P, args.entries, args.record_bytes)
        session = TrainingSession(t.url, dataset=self.name, run=RUN,
                                  store=(work / f"first-{P}").as_uri(), deterministic=False)
        session.restore({"model": torch.nn.Linear(2, 2)})  # group, fence, seek of all P
        assert session.generation is not None
        self.gen = session.generation
        session.close()
        self.client = redis_client.client(t.url)
        pipe = self.client.pipeline(transaction=False)
        for p in range(P):
            pipe.xrevrange(streams.partition_key(self.name, p), count=1)
        # Each partition's last entry: what a checkpoint after one pass commits.
        self.offsets = {p: (e[0][0].decode() if isinstance(e[0][0], bytes) else e[0][0])
                        for p, e in enumerate(pipe.execute())}
        self.state = RankState(rng=_rng.capture(), epoch=0, epoch_batches=1)
        self.servers = Servers(t)
        self.masters = len(self.servers.clients)

    def mine(self, rank: int, world: int) -> list[int]:
        return streams.rank_partitions(self.P, world_size=world, num_workers=self.workers,
                                       rank=rank)

    def own(self, rank: int, world: int) -> RankRecord:
        mine = self.mine(rank, world)
        return RankRecord(rank=rank, world_size=world, num_workers=self.workers,
                          offsets={p: self.offsets[p] for p in mine},
                          batches=dict.fromkeys(mine, 1), state=self.state)

    def record(self, world: int, version: int, commit: int = 1) -> SessionRecord:
        v2 = version == 2
        return SessionRecord(
            dataset=self.name, run=RUN, partitions=self.P, generation=self.gen, commit=commit,
            world_size=world, num_workers=self.workers, seed=1,
            offsets=self.offsets if v2 else {}, batches=dict.fromkeys(self.offsets, 1) if v2 else {},
            ranks=dict.fromkeys(range(world), self.state) if v2 else {}, version=version)

    def close(self) -> None:
        self.client.close()
        self.servers.close()


class Checkpoint:
    """A committed checkpoint of W ranks in a store of its own: a real one-rank save
    (its tensors, its manifest), then every rank's object and the manifest's index of
    all W, written with the store's encoders."""

    def __init__(self, d: Data, world: int):
        self.d, self.world = d, world
        self.url = (d.work / f"ckpt-{d.P}-{world}").as_uri()
        store = open_store(self.url, keep_last=1000)
        store.save({"model": torch.nn.Linear(2, 2)}, step=1, blocking=True,
                   extra=d.record(world, RECORD_VERSION).to_extra(), rank_state=d.own(0, world).to_wire())
        m = store.latest()
        store.close()
        assert m is not None
        self.backend = open_backend(self.url)
        self.root = Path(self.url.removeprefix("file://"))
        self.body = json.loads(self.backend.read(manifest_path(m.name)))
        self.uid, self.name = m.uid, m.name
        self.digests = [self._object(self.uid, r, 1, sync=False) for r in range(world)]
        raw = self.manifest(self.uid, 1, self.digests)
        (self.root / manifest_path(self.name)).write_bytes(raw)
        self.manifest_bytes = len(raw)
        self.object_bytes = {r: (self.root / rank_state_path(self.uid, r)).stat().st_size
                             for r in range(world)}

    def _object(self, uid: str, rank: int, step: int, *, sync: bool) -> str:
        raw = encode_rank_state(self.d.own(rank, self.world).to_wire(), uid=uid, step=step,
                                rank=rank, world_size=self.world)
        path = rank_state_path(uid, rank)
        if sync:  # what _write_rank_state does
            self.backend.write_file(path, [raw])
            self.backend.sync_dirs([path.rsplit("/", 1)[0], data_dir(uid)])
        else:  # laying down the other ranks' objects (not measured)
            full = self.root / path
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(raw)
        return digest(raw)

    def write_object(self, uid: str, rank: int, step: int) -> str:
        return self._object(uid, rank, step, sync=True)

    def manifest(self, uid: str, step: int, digests: list[str]) -> bytes:
        b = self.body
        return encode_manifest(step=step, uid=uid, created_at=time.time(), parent=b["parent"],
                               world_size=self.world, extra=b["extra"], arrays=b["arrays"],
                               tensors=b["tensors"], state=base64.b64decode(b["state"]["base64"]),
                               ranks=make_index(digests))

    def commit_manifest(self, uid: str, step: int, digests: list[str]) -> int:
        """Rank 0's commit of a save: the manifest (exclusive create) and LATEST."""
        raw = self.manifest(uid, step, digests)
        name = f"{step:012d}-{uid}.json"
        self.backend.exclusive_create(manifest_path(name), raw)
        self.backend.replace(LATEST, latest_pointer(name, step, uid))
        return len(raw)

    def drop(self, uid: str, step: int) -> None:
        """Undo a measured commit: the checkpoint of the W ranks is the newest again."""
        self.backend.remove(manifest_path(f"{step:012d}-{uid}.json"))
        self.backend.remove_tree(data_dir(uid))
        self.backend.replace(LATEST, latest_pointer(self.name, 1, self.uid))


# ------------------------------------------------------------------ one round
def _new_round(d: Data, ck: Checkpoint, ranks: list[int], step: int) -> dict[str, Any]:
    W, c = ck.world, d.client
    uid = new_uid(time.time_ns())
    stall, stall_cpu, write, write_cpu, pub, pub_cpu = [], [], [], [], [], []
    fence, fence_cpu = [], []
    digests = list(ck.digests)
    owns = {}
    for r in ranks:
        with Clock(d) as s:  # the loop's stall: the in-memory capture only
            RankState(rng=_rng.capture(), epoch=0, epoch_batches=1)
        stall.append(s.wall_s)
        stall_cpu.append(s.server_cpu_s)
        with Clock(d) as w:  # the writer: the object, then the precommit fence check
            digests[r] = ck.write_object(uid, r, step)
            json.dumps({"ok": True, "arrays": {}, "tensors": {}, "rank_state": digests[r]})
        write.append(w.wall_s)
        write_cpu.append(w.server_cpu_s)
        with Clock(d) as f:
            ofs.current_generations(c, d.name, RUN, d.mine(r, W))
        fence.append(f.wall_s)
        fence_cpu.append(f.server_cpu_s)
        owns[r] = d.own(r, W)
    t0 = time.perf_counter()
    ck.commit_manifest(uid, step, digests)
    manifest_s = time.perf_counter() - t0
    lists = 0
    for r in ranks:
        store = open_store(ck.url)
        reader = PositionReader(rank_state_store(store))
        # A rank knows its own objects of its own commits (OffsetCommitter.after).
        reader.remember(ck.name, owns[r])
        reader.remember(f"{step:012d}-{uid}.json", owns[r])
        # As the session makes it (_session_base): only rank 0 lists the store and
        # publishes the kept checkpoints; the others GET that key. Rank 0 is the first
        # sampled rank, so the others find its list of this very commit.
        committer = OffsetCommitter(c, _direct, store, dataset=d.name, run=RUN, reader=reader,
                                    lists=r == 0)
        listed = _Listings(store)
        with Clock(d) as p:
            committer.publish(owns[r].offsets, d.gen, whole=False)
        lists += listed.count
        pub.append(p.wall_s)
        pub_cpu.append(p.server_cpu_s)
        store.close()
    ck.drop(uid, step)
    m = len(d.servers.clients)
    both = [a + b for a, b in zip(stall, fence)]
    both_cpu = [a + b for a, b in zip(stall_cpu, fence_cpu)]
    st, pb = across(stall, stall_cpu, W, m), across(pub, pub_cpu, W, m)
    wr = across([a + b for a, b in zip(write, fence)], [a + b for a, b in zip(write_cpu, fence_cpu)],
                W, m)
    return {
        "stall_s": st, "parts": {"rng_s": max(stall), "fence_check_s": max(fence),
                                 "object_write_s": max(write), "publish_s": max(pub),
                                 "stall_queue_s": mean_w(stall_cpu, W, m),
                                 "fence_queue_s": mean_w(fence_cpu, W, m),
                                 "write_queue_s": mean_w(write_cpu, W, m),
                                 "publish_queue_s": mean_w(pub_cpu, W, m),
                                 # main before this change: the fence check on the loop's path
                                 "stall_with_fence_s": across(both, both_cpu, W, m)},
        "commit_s": st + wr + manifest_s + pb,
        # A rank's own work, every rank but 0; rank 0's apart: it alone writes the
        # manifest and lists the store, whose index is W entries (O(W) by design).
        "rank_work_s": max(a + b + e + g for r, a, b, e, g in
                           zip(ranks, stall, write, pub, fence) if r != 0),
        "rank0_work_s": stall[0] + write[0] + pub[0] + fence[0] + manifest_s,
        "manifest_write_s": manifest_s, "store_listings": lists,
        "redis_cpu_s": statistics.mean([a + b + e + g for a, b, e, g in
                                        zip(stall_cpu, write_cpu, pub_cpu, fence_cpu)]) * W,
    }


def _old_round(d: Data, ck: Checkpoint, W: int, args: argparse.Namespace,
               v2: dict[str, Any]) -> dict[str, Any]:
    c, P = d.client, d.P
    batches = dict.fromkeys(range(P), 1)
    with Clock(d) as s:
        ofs.current_generations(c, d.name, RUN, P)
        mine = RankState(rng=_rng.capture(), epoch=0, epoch_batches=1)
    t0 = time.perf_counter()
    for _ in range(args.merged):
        gather_offsets(d.offsets, batches, mine, 1, None)
    merge = (time.perf_counter() - t0) * W / args.merged
    stall = max(s.wall_s, s.server_cpu_s * W / d.masters) + merge
    parts = {"fence_and_rng_s": s.wall_s, "stall_queue_s": s.server_cpu_s * W / d.masters,
             "merge_s": merge, "merge_one_payload_s": merge / W}
    store = open_store(ck.url)
    committer = OffsetCommitter(c, _direct, store, dataset=d.name, run=RUN)
    with Clock(d) as p:
        committer.publish(d.offsets, d.gen, whole=True)
    store.close()
    scale = v2["bytes"] / v2["measured_bytes"]
    t0 = time.perf_counter()
    raw = json.dumps(v2["extra"], separators=(",", ":")).encode()
    path = d.work / "v2-manifest.json"
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    write_s = (time.perf_counter() - t0) * scale
    del raw
    parts["publish_s"] = p.wall_s
    return {
        "stall_s": stall, "commit_s": stall + write_s + p.wall_s, "parts": parts,
        "rank_work_s": s.wall_s + merge, "rank0_work_s": s.wall_s + merge + write_s + p.wall_s,
        "manifest_write_s": write_s,
        "redis_cpu_s": s.server_cpu_s * W + p.server_cpu_s,
    }


def _evict(d: Data, gen: int, fence: dict[str, float]) -> None:
    t0 = time.perf_counter()
    ofs.evict_readers(d.client, d.name, RUN, gen)
    fence["evict_s"] = time.perf_counter() - t0


def _restores(d: Data, ck: Checkpoint, ranks_by_change: dict[str, list[int]],
              v2: dict[str, Any] | None, *, two_pass: bool = False) -> dict[str, Any]:
    """Each sampled rank's restore. New layout (as ``_restore._take_and_place`` and
    ``_session_base._place`` do it): rank 0 takes the generation from the run's
    counter; each rank loads, reads its own object or its partitions' owners', and
    places its partitions (``place_partitions``: one script call per rank, raising
    their fences, seeking and acknowledging); (one int64 MAX all-reduce: not
    measured) rank 0 closes the older readers. ``two_pass``: main before this, the
    fences raised by a pass of their own (``fence_partitions``, every rank) between
    the take and the placement. With ``v2``, the baseline's: rank 0 bumps all P
    (``bump_generation``) and every rank parses the whole version 2 manifest."""
    c, W = d.client, ck.world
    out: dict[str, Any] = {}
    bumps = []
    for change, ranks in ranks_by_change.items():
        W2 = max(1, round(W * CHANGES[change]))
        fence: dict[str, float] = {}
        if v2 is None:
            t0 = time.perf_counter()
            c.sadd(streams.groups_key(d.name), RUN)
            gen = ofs.take_generation(c, d.name, RUN, d.gen)
            fence["take_s"] = time.perf_counter() - t0
            if two_pass:
                fw, fc = [], []
                for r in ranks:
                    with Clock(d) as f:
                        top = ofs.fence_partitions(c, d.name, RUN, gen, d.mine(r, W2))
                    assert top == gen, (top, gen)
                    fw.append(f.wall_s)
                    fc.append(f.server_cpu_s)
                fence["fence_s"] = across(fw, fc, W2, d.masters)
                fence["fence_us_per_partition"] = sum(fc) * 1e6 / sum(
                    len(d.mine(r, W2)) for r in ranks)
                _evict(d, gen, fence)
            d.gen = gen
            bump = fence["take_s"] + fence.get("fence_s", 0.0)
        else:
            t0 = time.perf_counter()
            d.gen = ofs.bump_generation(c, d.name, RUN, d.P, d.gen)
            bump = time.perf_counter() - t0
        walls, cpus, read, objs, place_cpu = [], [], [], [], []
        for r in ranks:
            mine = d.mine(r, W2)
            with Clock(d) as k:
                store = open_store(ck.url)
                m = store.load({"model": torch.nn.Linear(2, 2)})
                assert m is not None
                rec = SessionRecord.of(m)
                assert rec is not None
                if v2 is None:
                    store_r = rank_state_store(store)
                    assert store_r is not None
                    got: list[int] = []

                    def one(o: int, m: Any = m, store_r: Any = store_r, got: list[int] = got) -> RankRecord:
                        got.append(o)
                        return RankRecord.from_wire(store_r.read_rank_state(m, o), rank=o)

                    pos = positions(rec, mine, one).offsets
                else:  # the baseline: every rank parses the whole version 2 record
                    old = SessionRecord.from_extra(json.loads(v2["raw"]))
                    assert old is not None
                    pos = positions(old, mine, lambda o: RankRecord(o, W, d.workers)).offsets
                    got = []
                store.close()
            with Clock(d) as s:  # the placement on its own: CPU per partition
                ofs.place_partitions(c, d.name, RUN, d.gen, pos, dict.fromkeys(pos, 1))
            place_cpu.append(s.server_cpu_s)
            wall = k.wall_s + s.wall_s
            if v2 is not None:  # the parse of a manifest past --v2-max-ranks, scaled by bytes
                wall += v2["parse_s"] * (v2["bytes"] / v2["measured_bytes"] - 1)
            walls.append(wall)
            cpus.append(k.server_cpu_s + s.server_cpu_s)
            objs.append(len(got))
            read.append(ck.manifest_bytes + sum(ck.object_bytes[o] for o in got)
                        if v2 is None else v2["bytes"])
        if v2 is None:
            if not two_pass:  # once every rank's placement holds the fences
                _evict(d, d.gen, fence)
            bump += fence["evict_s"]
        bumps.append(bump)
        out[change] = {"restore_s": bump + across(walls, cpus, W2, d.masters),
                       "rank_s": max(walls), "queue_s": mean_w(cpus, W2, d.masters),
                       "bytes_read_per_rank": max(read), "objects_read_max": max(objs),
                       "world_size": W2, "fencing": fence,
                       "place_us_per_partition": sum(place_cpu) * 1e6 / sum(
                           len(d.mine(r, W2)) for r in ranks)}
    out["bump_s"] = bumps[0]
    return out


def v2_manifest(d: Data, W: int, max_ranks: int) -> dict[str, Any]:
    """The baseline's session record for W ranks: its exact bytes, and the JSON built
    for min(W, max_ranks) ranks (encode, write and parse measured on it, scaled by
    bytes beyond)."""
    measured = min(W, max_ranks)
    extra = d.record(measured, 2).to_extra()
    raw = json.dumps(extra, separators=(",", ":")).encode()
    one = len(json.dumps({"0": d.state.to_wire()}, separators=(",", ":"))) - 1
    total = len(raw) + (W - measured) * one
    t0 = time.perf_counter()
    SessionRecord.from_extra(json.loads(raw))
    return {"extra": extra, "raw": raw, "measured_bytes": len(raw), "bytes": total,
            "parse_s": time.perf_counter() - t0, "measured_ranks": measured}


# ------------------------------------------------------------------ one size
def measure_size(d: Data, W: int, args: argparse.Namespace) -> dict[str, Any]:
    ck = Checkpoint(d, W)
    v2 = v2_manifest(d, W, args.v2_max_ranks)
    sampled = sample_ranks(W, args.sample)
    by_change = {ch: sample_ranks(max(1, round(W * f)), args.sample) for ch, f in CHANGES.items()}
    rows: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    restores: dict[str, list[dict[str, Any]]] = {"new": [], "old": [], "two_pass": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for side in ("new", "old") if r % 2 == 0 else ("old", "new"):
            if side == "new":
                row = _new_round(d, ck, sampled, step=100 + r)
                # Beside it in the same round, in turns: main's restore before the
                # placement raised the fences (a pass of fences of its own first).
                same = {"same": by_change["same"]}
                if r % 2:
                    two = _restores(d, ck, same, None, two_pass=True)
                back = _restores(d, ck, by_change, None)
                if not r % 2:
                    two = _restores(d, ck, same, None, two_pass=True)
                if r:
                    restores["two_pass"].append(two)
            else:
                row = _old_round(d, ck, W, args, v2)
                back = _restores(d, ck, {"same": by_change["same"]}, v2)
            if r:
                rows[side].append(row)
                restores[side].append(back)
    fig: dict[str, Any] = {"world_size": W, "partitions": d.P, "sampled_ranks": sampled,
                           "manifest_bytes": {"new": ck.manifest_bytes,
                                              "old": v2["bytes"] + ck.manifest_bytes},
                           "object_bytes_median": statistics.median(ck.object_bytes.values()),
                           "v2_measured_ranks": v2["measured_ranks"],
                           "store_listings_per_commit": max(x["store_listings"] for x in rows["new"])}
    for side in ("new", "old", "two_pass"):
        if side != "two_pass":
            for key in ("stall_s", "commit_s", "rank_work_s", "rank0_work_s", "manifest_write_s",
                        "redis_cpu_s"):
                fig.setdefault(key, {})[side] = spread([x[key] for x in rows[side]])
            fig.setdefault("parts", {})[side] = {
                k: spread([x["parts"][k] for x in rows[side]]) for k in rows[side][0]["parts"]}
        fig.setdefault("bump_s", {})[side] = spread([x["bump_s"] for x in restores[side]])
        for ch in restores[side][0]:
            if ch == "bump_s":
                continue
            fig.setdefault(f"restore_{ch}", {})[side] = {
                "restore_s": spread([x[ch]["restore_s"] for x in restores[side]]),
                "bytes_read_per_rank": restores[side][0][ch]["bytes_read_per_rank"],
                "objects_read_max": restores[side][0][ch]["objects_read_max"],
                "rank_s": spread([x[ch]["rank_s"] for x in restores[side]]),
                "queue_s": spread([x[ch]["queue_s"] for x in restores[side]]),
                "world_size": restores[side][0][ch]["world_size"],
                "place_us_per_partition": spread([x[ch]["place_us_per_partition"]
                                                  for x in restores[side]]),
                "fencing": {k: spread([x[ch]["fencing"][k] for x in restores[side]])
                            for k in restores[side][0][ch]["fencing"]}}
    for key in ("stall_s", "commit_s", "rank_work_s", "redis_cpu_s"):
        fig[key]["ratio"] = spread([o[key] / n[key] for o, n in zip(rows["old"], rows["new"])])
    fig["restore_same"]["ratio"] = spread([
        o["same"]["restore_s"] / n["same"]["restore_s"]
        for o, n in zip(restores["old"], restores["new"])])
    # main before the placement raised the fences / now, paired within a round
    fig["restore_same"]["ratio_two_pass"] = spread([
        o["same"]["restore_s"] / n["same"]["restore_s"]
        for o, n in zip(restores["two_pass"], restores["new"])])
    return fig


def spread(values: Iterable[float]) -> dict[str, float]:
    v = list(values)
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def measure(t: Target, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    sizes, ingests = [], {}
    for P in args.partitions:
        d = Data(t, work, P, args)
        ingests[str(P)] = d.ingest
        try:
            for W in args.ranks:
                sizes.append(measure_size(d, W, args))
                print(f"  {t.name}: {W} ranks x {P} partitions measured", flush=True)
        finally:
            d.close()
    return {"ingest": ingests, "sizes": sizes, "masters": len(t.info("server"))}


def init_gloo() -> None:
    """A one-rank gloo group: ``gather_offsets`` runs its real collective on it."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


__all__ = ["init_gloo", "measure"]
