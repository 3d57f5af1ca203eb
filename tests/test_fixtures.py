"""The fixtures themselves are real: a redis-server that acknowledges, dies and
comes back the way a real one does."""

from __future__ import annotations

import socket

import redis

from tests.servers import RedisServer


def test_stream_round_trip(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    entry = r.xadd("s", {"x": b"1"})
    r.xgroup_create("s", "g", id="0")
    got = r.xreadgroup("g", "c", {"s": ">"})
    assert got == [[b"s", [(entry, {b"x": b"1"})]]]
    assert r.xack("s", "g", entry) == 1
    assert r.xpending("s", "g")["pending"] == 0


def test_aof_always_survives_kill_9(redis_factory) -> None:
    """With appendfsync always every acknowledged XADD and the group state survive."""
    server = redis_factory(persistence="always")
    r = redis.Redis.from_url(server.url)
    ids = [r.xadd("s", {"i": str(i)}) for i in range(100)]
    r.xgroup_create("s", "g", id="0")
    r.xreadgroup("g", "c", {"s": ">"}, count=40)
    r.xack("s", "g", *ids[:30])
    r.close()

    server.kill()
    server.restart()

    r = redis.Redis.from_url(server.url)
    assert [e[0] for e in r.xrange("s")] == ids
    group = r.xinfo_groups("s")[0]
    assert group["last-delivered-id"] == ids[39]
    assert r.xpending("s", "g")["pending"] == 10


def test_no_persistence_comes_back_empty(redis_factory) -> None:
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    r.xadd("s", {"x": "1"})
    port = server.port
    server.kill()
    server.restart()
    assert server.port == port
    assert redis.Redis.from_url(server.url).exists("s") == 0


def test_servers_are_isolated_from_the_machine_redis(redis_server: RedisServer) -> None:
    assert redis_server.port != 6379


def test_a_picked_port_taken_before_the_start_moves_and_a_restart_keeps_it(tmp_path) -> None:
    """A free port picked for a server can be taken before it starts (an outgoing
    connection's local port comes from the same range): the first start moves to
    another port; a restart never moves (clients know the port by then)."""
    server = RedisServer(tmp_path / "r")
    taken = server.port
    with socket.socket() as squatter:  # bound, not listening: like a connection's local port
        squatter.bind(("127.0.0.1", taken))
        server.start()
        try:
            assert server.port != taken
            assert redis.Redis(port=server.port).ping()
            moved = server.port
            server.restart()
            assert server.port == moved
        finally:
            server.kill()


def test_a_picked_port_served_by_another_redis_is_not_taken_for_ours(tmp_path) -> None:
    """Our redis-server failing to bind a port that another redis-server serves must not
    pass for started (the other one answers PING): the start checks the pid and moves."""
    other = RedisServer(tmp_path / "other").start()
    try:
        server = RedisServer(tmp_path / "r")
        server.port = other.port  # as if the kernel had handed out the same port twice
        server.start()
        try:
            assert server.port != other.port
            info = redis.Redis(port=server.port).info("server")
            assert info["process_id"] == server.pid
        finally:
            server.kill()
    finally:
        other.kill()
