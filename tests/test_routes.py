"""RouteClient against two real local aiohttp servers (primary and backup) that fail,
hang and recover; breaker time is a ManualClock."""

from __future__ import annotations

import asyncio
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests._http_servers import ControlledServer, ManualClock
from trainer_client.errors import (
    AllRoutesFailedError,
    RouteRejectedError,
    TrainerClientError,
)
from trainer_client.routes import HttpRoute, LocalRoute, RouteClient
from trainguard.core.resilience import CircuitOpenError
from trainguard.core.resilience.breaker import BreakerState

RESET_S = 60.0


@pytest.fixture
def primary() -> Iterator[ControlledServer]:
    srv = ControlledServer("primary").start()
    yield srv
    srv.stop()


@pytest.fixture
def backup() -> Iterator[ControlledServer]:
    srv = ControlledServer("backup").start()
    yield srv
    srv.stop()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def make_client(primary: ControlledServer, backup: ControlledServer, clock: ManualClock,
                *extra: LocalRoute) -> RouteClient:
    return RouteClient(
        "reward",
        [HttpRoute("primary", primary.url, timeout_s=0.5),
         HttpRoute("backup", backup.url, timeout_s=0.5), *extra],
        failure_threshold=2, reset_timeout_s=RESET_S, clock=clock, registry=CollectorRegistry(),
    )


def served_by(client: RouteClient, payload: Any) -> str:
    resp = client.call("/score", payload)
    assert resp.value == {"server": resp.route, "path": "/score", "echo": payload}
    return resp.route


@pytest.mark.parametrize("outage", ["fail", "hang"])
def test_calls_move_to_backup_and_back(
    primary: ControlledServer, backup: ControlledServer, clock: ManualClock, outage: str
) -> None:
    """While the primary fails (500) or hangs past the timeout, calls are answered by
    the backup; after 2 failures the primary's breaker opens and it is no longer
    tried; once it recovers and the reset timeout passes, one probe closes its
    breaker and calls are back on the primary."""
    client = make_client(primary, backup, clock)
    assert served_by(client, {"i": 0}) == "primary"
    primary.set_mode(outage)
    assert [served_by(client, {"i": i}) for i in range(1, 6)] == ["backup"] * 5
    assert primary.hits == 3  # 1 good call + 2 failures, then the breaker is open
    assert client.breakers["primary"].state is BreakerState.OPEN
    primary.set_mode("ok")
    assert served_by(client, {"i": 6}) == "backup"  # still resting: not tried yet
    assert primary.hits == 3
    clock.advance(RESET_S)
    assert [served_by(client, {"i": i}) for i in range(7, 10)] == ["primary"] * 3
    assert client.breakers["primary"].state is BreakerState.CLOSED
    assert primary.hits == 6 and backup.hits == 6


def test_failed_probe_keeps_calls_on_the_backup(
    primary: ControlledServer, backup: ControlledServer, clock: ManualClock
) -> None:
    """If the primary is still down when probed, that one call falls through to the
    backup and the primary rests for another full reset timeout."""
    client = make_client(primary, backup, clock)
    primary.set_mode("fail")
    for i in range(2):
        served_by(client, {"i": i})
    clock.advance(RESET_S)
    assert served_by(client, {"i": 2}) == "backup"
    assert primary.hits == 3
    assert client.breakers["primary"].retry_after_s() == pytest.approx(RESET_S)


def test_local_fallback_and_all_routes_failed(
    primary: ControlledServer, backup: ControlledServer, clock: ManualClock
) -> None:
    """With both servers failing the local route answers; when the local route fails
    too, AllRoutesFailedError lists every route with its own error, in order."""
    healthy = {"local": True}

    def local(path: str, payload: Any) -> Any:
        if not healthy["local"]:
            raise RuntimeError("local model not loaded")
        return {"server": "local", "path": path, "echo": payload}

    client = make_client(primary, backup, clock, LocalRoute("local", local))
    primary.set_mode("fail")
    backup.set_mode("fail")
    assert served_by(client, {"i": 0}) == "local"
    healthy["local"] = False
    with pytest.raises(AllRoutesFailedError) as info:
        client.call("/score", {"i": 1})
    err = info.value
    assert list(err.failures) == ["primary", "backup", "local"]
    assert isinstance(err.failures["primary"], urllib.error.HTTPError)
    assert isinstance(err.failures["backup"], urllib.error.HTTPError)
    assert str(err.failures["local"]) == "local model not loaded"
    assert "all 3 routes of 'reward' failed" in str(err)
    assert isinstance(err, TrainerClientError) and isinstance(err, ConnectionError)
    # Both servers' breakers are open now: the next failure names them as open.
    with pytest.raises(AllRoutesFailedError) as info:
        client.call("/score", {"i": 2})
    assert isinstance(info.value.failures["primary"], CircuitOpenError)
    assert isinstance(info.value.failures["backup"], CircuitOpenError)
    assert primary.hits == 2 and backup.hits == 2


def test_rejected_request_is_not_a_route_failure(
    primary: ControlledServer, backup: ControlledServer, clock: ManualClock
) -> None:
    """A 400 from the primary raises RouteRejectedError at once: the backup is never
    asked and the primary's breaker stays closed."""
    client = make_client(primary, backup, clock)
    primary.set_mode("reject")
    for _ in range(3):
        with pytest.raises(RouteRejectedError) as info:
            client.call("/score", {"bad": True})
    assert info.value.status == 400 and "primary: bad request" in info.value.body
    assert backup.hits == 0
    assert client.breakers["primary"].state is BreakerState.CLOSED


async def test_async_callers_fall_back_and_return(
    primary: ControlledServer, backup: ControlledServer, clock: ManualClock
) -> None:
    """acall from concurrent tasks: with the primary failing, all 8 are answered by
    the backup with their own payloads and the primary's breaker opens; after
    recovery and the reset timeout, tasks are answered by the primary again."""
    client = make_client(primary, backup, clock)
    primary.set_mode("fail")
    first = await asyncio.gather(*(client.acall("/score", {"i": i}) for i in range(8)))
    assert {r.route for r in first} == {"backup"}
    assert [r.value["echo"] for r in first] == [{"i": i} for i in range(8)]
    assert client.breakers["primary"].state is BreakerState.OPEN
    primary.set_mode("ok")
    clock.advance(RESET_S)
    assert (await client.acall("/score", {"i": 8})).route == "primary"
    again = await asyncio.gather(*(client.acall("/score", {"i": i}) for i in range(4)))
    assert {r.route for r in again} == {"primary"}


def test_route_names_must_be_unique() -> None:
    """Two routes with one name would share a breaker label: refused."""
    with pytest.raises(ValueError, match="unique"):
        RouteClient("x", [LocalRoute("a", lambda p, d: d), LocalRoute("a", lambda p, d: d)])
    with pytest.raises(ValueError, match="at least one route"):
        RouteClient("x", [])
