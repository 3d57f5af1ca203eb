"""The trainguard rendezvous' parts against real Redis: the backend's compare-and-set
under concurrent writers and across a Redis Cluster failover that loses a write, the
Redis ``dist.Store`` as torch uses it, and rendezvous rounds of in-process handlers
(torch's own ``DynamicRendezvousHandler`` on the trainguard backend): a round that
survives a master failover, a re-rendezvous that closes when every live node joined,
the admission check, the workers' store of each round and the job stop."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from tests.servers import RedisCluster, RedisServer, free_port
from trainer_client import redis_client
from trainguard.core import quarantine
from trainguard.core.settings import RDZV_WORKER_ENV
from trainguard.elastic import keys
from trainguard.elastic._redis import Connection
from trainguard.elastic.backend import RedisRendezvousBackend
from trainguard.elastic.errors import (
    ElasticConfigError,
    JobStoppedError,
    NodeRefusedError,
    StoreTimeoutError,
)
from trainguard.elastic.rendezvous import JoinRequest, create_handler
from trainguard.elastic.store import RedisStore
from trainguard.elastic.worker import WorkerRendezvous, process_group_store, record_stop


def test_compare_and_set_loses_no_update_under_concurrent_writers(
        redis_server: RedisServer) -> None:
    """Four writers, each with its own connection, add 1 to a counter in the state
    25 times by read / compare-and-set / retry on conflict: the counter ends at
    exactly 100 (no write based on a stale read ever succeeded), and every writer saw
    conflicts rejected (the race was real)."""
    writers, each = 4, 25
    conflicts = [0] * writers

    def write(i: int) -> None:
        conn = Connection(redis_server.url)
        backend = RedisRendezvousBackend(conn, "cas")
        try:
            done = 0
            got = backend.get_state()
            while done < each:
                value, token = (0, None) if got is None else (pickle.loads(got[0]), got[1])
                reply = backend.set_state(pickle.dumps(value + 1), token)
                assert reply is not None
                state, new_token, ok = reply
                if ok:
                    done += 1
                else:
                    conflicts[i] += 1
                got = (state, new_token)
        finally:
            conn.close()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn = Connection(redis_server.url)
    got = RedisRendezvousBackend(conn, "cas").get_state()
    conn.close()
    assert got is not None and pickle.loads(got[0]) == writers * each
    assert sum(conflicts) > 0


def test_a_stale_token_never_writes_and_no_token_writes_only_a_new_state(
        redis_server: RedisServer) -> None:
    """torch's contract: without a token only a missing state is written; with the
    token of an older write nothing is written and the stored state comes back."""
    conn = Connection(redis_server.url)
    backend = RedisRendezvousBackend(conn, "stale")
    try:
        assert backend.get_state() is None
        first = backend.set_state(b"one")
        assert first is not None and first[0] == b"one" and first[2]
        again = backend.set_state(b"other")  # no token, but a state exists
        assert again is not None and (again[0], again[1], again[2]) == (b"one", first[1], False)
        second = backend.set_state(b"two", first[1])
        assert second is not None and second[2] and second[1] != first[1]
        stale = backend.set_state(b"three", first[1])
        assert stale is not None and (stale[0], stale[1], stale[2]) == (b"two", second[1], False)
    finally:
        conn.close()


def test_store_does_what_torch_asks_of_a_store(redis_server: RedisServer) -> None:
    """set/get, add (a decimal counter), compare_set (TCPStore's answers), check,
    wait, delete_key, num_keys, multi_get/multi_set and a PrefixStore over it; a get of
    a key nobody sets fails with a DistStoreError naming the key."""
    conn = Connection(redis_server.url)
    store = RedisStore(conn, "st", timeout=timedelta(seconds=1))
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert (store.add("n", 2), store.add("n", 3), store.get("n")) == (2, 5, b"5")
        assert store.compare_set("c", b"", b"x") == b"x"  # missing, expected empty: set
        assert store.compare_set("d", b"y", b"z") == b"y"  # missing, expected other
        assert store.compare_set("c", b"no", b"w") == b"x"  # present, no match
        assert store.compare_set("c", b"x", b"w") == b"w"
        assert store.check(["a", "n"]) and not store.check(["a", "absent"])
        store.wait(["a", "c"])
        assert store.num_keys() == 3
        assert store.delete_key("a") and not store.delete_key("a")
        prefixed = dist.PrefixStore("round.1", store)
        prefixed.multi_set(["k1", "k2"], [b"v1", b"v2"])
        assert prefixed.multi_get(["k1", "k2"]) == [b"v1", b"v2"]
        assert store.get("round.1/k1") == b"v1"
        prefixed.set_timeout(timedelta(seconds=1))
        with pytest.raises(dist.DistStoreError, match="'absent'") as err:
            store.get("absent")
        assert isinstance(err.value, StoreTimeoutError)
        with pytest.raises(StoreTimeoutError):
            store.wait(["absent"], timedelta(milliseconds=50))
    finally:
        conn.close()


def _params(url: str, run_id: str, min_nodes: int, max_nodes: int,
            **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("trainguard", url, run_id, min_nodes, max_nodes, **conf)


def _join_all(handlers: list[Any], timeout_s: float = 90.0) -> list[Any]:
    """next_rendezvous on every handler at once (as every node's agent would)."""
    out: list[Any] = [None] * len(handlers)

    def join(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except BaseException as e:  # handed to the test thread
            out[i] = e

    threads = [threading.Thread(target=join, args=(i,), daemon=True)
               for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rendezvous did not complete"
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _state(url: str, run_id: str) -> Any:
    """The rendezvous state as torch's handler wrote it (read with a client of ours)."""
    client = redis_client.client(url)
    try:
        raw = client.hget(keys.state_key(run_id), "s")
        return None if raw is None else pickle.loads(raw)
    finally:
        client.close()


def _shutdown(handlers: list[Any]) -> None:
    for h in handlers:
        h._stop_heartbeats()
        h._conn.close()


def test_on_a_cluster_rounds_survive_failovers_and_lost_writes_fence_their_writer(
        redis_cluster_factory: Callable[[], RedisCluster]) -> None:
    """One cluster, two master kills (one cluster start: they cost seconds).

    A round: node A joins a 2-node round and waits; the master holding the state
    (and the store) is killed; node B joins after the failover: both complete the
    round, as ranks 0 and 1 of a world of 2, and read the same MASTER_ADDR/PORT from
    the Redis store (written by rank 0 after the failover).

    A lost write: writer C's newest write is lost when its master is killed
    (replication cut first, so it surely is). D, who read the surviving state, writes
    on it; C, still holding the token of its lost write, must then be refused: a
    counter would have handed D the same token C holds, and C would overwrite D's
    state unseen."""
    cluster = redis_cluster_factory()
    a = create_handler(_params(cluster.url, "fo", 2, 2))
    b = create_handler(_params(cluster.url, "fo", 2, 2))
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(_join_all([a])[0]), daemon=True)
    try:
        thread.start()
        while True:
            state = _state(cluster.url, "fo")
            if state is not None and len(state.participants) == 1:
                break
            thread.join(0.05)
            assert thread.is_alive(), result
        cluster.kill_master(keys.state_key("fo"))
        (info_b,) = _join_all([b])
        thread.join(90)
        assert not thread.is_alive() and result
        infos = [result[0], info_b]
        assert sorted(i.rank for i in infos) == [0, 1]
        assert {i.world_size for i in infos} == {2}
        stores = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                  for i in infos}
        assert len(stores) == 1
    finally:
        _shutdown([a, b])

    # A run whose master still has a replica (not the one promoted above).
    promoted = cluster.master_of(keys.state_key("fo")).port
    run = next(r for r in (f"lost{i}" for i in range(64))
               if cluster.master_of(keys.state_key(r)).port != promoted)
    c_conn, d_conn = Connection(cluster.url), Connection(cluster.url)
    c, d = RedisRendezvousBackend(c_conn, run), RedisRendezvousBackend(d_conn, run)
    try:
        first = c.set_state(b"s1")
        assert first is not None and first[2]
        cluster.wait_replicated()
        cluster.cut_replication(keys.state_key(run))
        lost = c.set_state(b"s2-lost", first[1])
        assert lost is not None and lost[2]
        cluster.kill_master(keys.state_key(run))
        seen = d.get_state()
        assert seen is not None and seen[0] == b"s1"  # the write was lost
        d_write = d.set_state(b"s3-from-d", seen[1])
        assert d_write is not None and d_write[2]
        c_write = c.set_state(b"s4-from-c", lost[1])
        assert c_write is not None and not c_write[2] and c_write[0] == b"s3-from-d"
    finally:
        c_conn.close()
        d_conn.close()


def test_a_re_rendezvous_closes_once_every_live_node_joined(redis_server: RedisServer) -> None:
    """Round 1 of three nodes (max 3, so it closes full); node C dies (its keep-alives
    stop); A and B rendezvous again with a last call of 600 s: the round closes as
    soon as C's keep-alive expired and A and B both joined (world 2), not after the
    last call; C is in neither the round nor the wait list."""
    conf = {"last_call_timeout": "600", "join_timeout": "600"}
    a, b, c = (create_handler(_params(redis_server.url, "fast", 1, 3, **conf))
               for _ in range(3))
    try:
        first = _join_all([a, b, c])
        assert sorted(i.world_size for i in first) == [3, 3, 3]
        c._stop_heartbeats()  # node C is gone
        second = _join_all([a, b], timeout_s=120)
        assert sorted(i.rank for i in second) == [0, 1]
        assert {i.world_size for i in second} == {2}
        state = _state(redis_server.url, "fast")
        assert c._this_node not in state.participants and not state.wait_list
    finally:
        _shutdown([a, b, c])


def test_a_refused_node_leaves_and_the_others_go_on(redis_server: RedisServer) -> None:
    """The admission check is asked before each join with the node and the round; a
    refusal makes that node's next_rendezvous raise NodeRefusedError (torch's graceful
    exit) and withdraws it from the round it was in, so the other node's next round
    forms without waiting for the refused node's keep-alive to expire."""
    asked: list[JoinRequest] = []
    refuse = threading.Event()

    def admit(request: JoinRequest) -> str | None:
        asked.append(request)
        return "quarantined by test" if refuse.is_set() else None

    conf = {"last_call_timeout": "600", "join_timeout": "600", "keep_alive_interval": "600"}
    a = create_handler(_params(redis_server.url, "adm", 1, 2, **conf))
    b = create_handler(_params(redis_server.url, "adm", 1, 2, **conf), admit=admit)
    try:
        assert sorted(i.world_size for i in _join_all([a, b])) == [2, 2]
        assert [r.round for r in asked] == [0] and asked[0].run_id == "adm"
        refuse.set()
        with pytest.raises(NodeRefusedError, match="quarantined by test"):
            b.next_rendezvous()
        # B's keep-alive would hold for 30 minutes: A's round forms because B withdrew.
        (alone,) = _join_all([a], timeout_s=120)
        assert (alone.rank, alone.world_size) == (0, 1)
    finally:
        _shutdown([a, b])


def test_a_refused_node_shutting_down_leaves_the_rendezvous_open(
        redis_server: RedisServer) -> None:
    """What torch's launcher does after a refusal: the refused agent's run returns
    nothing (a graceful exit), the launcher fails on that and calls its handler's
    ``shutdown()``. That must not close the rendezvous: the node left in it forms its
    next round alone (world size 1). (It used to close it: every other node's next
    round raised RendezvousClosedError, so one quarantined node restarting ended the
    job; the chaos campaign's gpu_critical class found it.)"""
    conf = {"last_call_timeout": "1", "join_timeout": "60", "keep_alive_interval": "600"}
    a = create_handler(_params(redis_server.url, "open", 1, 2, **conf))
    b = create_handler(_params(redis_server.url, "open", 1, 2, **conf),
                       admit=lambda request: "quarantined by test")
    try:
        assert [i.world_size for i in _join_all([a])] == [1]
        with pytest.raises(NodeRefusedError, match="quarantined by test"):
            b.next_rendezvous()
        assert b.shutdown() is True
        assert not a.is_closed()
        assert [i.world_size for i in _join_all([a])] == [1]
    finally:
        _shutdown([a, b])


def test_a_quarantined_node_is_refused_by_default_and_quarantine_false_admits_it(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an ``admit`` option the rendezvous checks this node's quarantine record
    in its own Redis before every join: a node a record holds is refused with the
    record's reason (and how to clear it), whatever restarted its agent; cleared, it
    joins again; ``quarantine=false`` turns the check off."""
    monkeypatch.setenv("TRAINGUARD_NODE_ID", "node-bad")
    r = redis_client.client(redis_server.url)
    conf = {"last_call_timeout": "1", "join_timeout": "60"}
    handlers: list[Any] = []
    try:
        quarantine.quarantine(r, "node-bad", "GPU health CRITICAL: ECC", source="probe",
                              policy=quarantine.QuarantinePolicy(quarantine_s=600))
        handlers.append(create_handler(_params(redis_server.url, "q", 1, 1, **conf)))
        with pytest.raises(NodeRefusedError, match=r"GPU health CRITICAL: ECC.*nodes clear"):
            handlers[-1].next_rendezvous()
        handlers.append(create_handler(_params(redis_server.url, "q-off", 1, 1,
                                               quarantine="false", **conf)))
        (info,) = _join_all(handlers[-1:])
        assert info.world_size == 1
        assert quarantine.clear(r, "node-bad")
        handlers.append(create_handler(_params(redis_server.url, "q", 1, 1, **conf)))
        (info,) = _join_all(handlers[-1:])
        assert info.world_size == 1
    finally:
        _shutdown(handlers)
        r.close()


def test_each_round_gives_its_workers_a_store_of_its_own_and_a_job_stop_closes_it(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each round both nodes tell their workers the same store (the run's
    Redis, under a prefix of the round), a new one each round: a key a worker of
    round 1 sets is in the fixture's Redis under round 1's prefix and invisible to
    round 2's store. A worker's job stop keeps its first writer's word; every node's
    next join then raises JobStoppedError with its reason, the rendezvous closed.
    A malformed ``$TRAINGUARD_RDZV_WORKER`` is refused saying what was expected."""
    monkeypatch.delenv(RDZV_WORKER_ENV, raising=False)  # restored after the test
    conf = {"last_call_timeout": "600", "join_timeout": "600"}
    a, b = (create_handler(_params(redis_server.url, "pg", 1, 2, **conf)) for _ in range(2))
    client = redis_client.client(redis_server.url)
    try:
        _join_all([a, b])
        first = WorkerRendezvous.from_env()
        assert first is not None and a.worker == b.worker == first
        assert (first.url, first.run_id) == (redis_server.url, "pg")
        old = process_group_store(first, timeout=timedelta(seconds=1))
        old.set("rank_0", b"addr-of-round-1")
        assert client.get(f"tg:rdzv:{{pg}}:k:{first.prefix}/rank_0") == b"addr-of-round-1"
        _join_all([a, b])
        second = WorkerRendezvous.from_env()
        assert second is not None and a.worker == b.worker == second
        assert second.prefix != first.prefix
        assert not process_group_store(second, timeout=timedelta(seconds=1)).check(["rank_0"])
        assert record_stop(second, reason="breaker: same crash 4 times", exit_code=87, rank=1)
        assert not record_stop(second, reason="a later word", exit_code=87, rank=0)
        for h in (a, b):
            with pytest.raises(JobStoppedError, match="breaker: same crash 4 times"):
                h.next_rendezvous()
        assert a.is_closed() and b.is_closed()
        with pytest.raises(ElasticConfigError, match="expected the JSON"):
            WorkerRendezvous.from_env('{"url": "redis://x"}')
    finally:
        client.close()
        _shutdown([a, b])


def test_an_inherited_worker_variable_of_another_rendezvous_is_ignored(tmp_path: Path) -> None:
    """A process that torchrun did not start for the rendezvous named in
    ``$TRAINGUARD_RDZV_WORKER`` (no matching ``$TORCHELASTIC_RUN_ID``: the variable was
    inherited, and its Redis is gone) starts its process group on torch's default store
    instead of waiting a minute for that Redis and failing."""
    dead = WorkerRendezvous(url=f"redis://127.0.0.1:{free_port()}/0", run_id="gone",
                            prefix="worker/1/x", store_ttl_s=60.0, stop_ttl_s=60.0)
    code = ("import torch.distributed as dist\n"
            "from trainer_client import init_process_group\n"
            "init_process_group('gloo')\n"
            "print('WORLD', dist.get_world_size())\n"
            "dist.destroy_process_group()\n")
    env = {**os.environ, RDZV_WORKER_ENV: dead.to_env(), "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("TORCHELASTIC_RUN_ID", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "WORLD 1" in out.stdout, out.stderr[-2000:]
    assert "ignored" in out.stderr, out.stderr[-2000:]
