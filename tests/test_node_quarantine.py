"""Quarantine keeps bad nodes out: the gate before a launch, the failure count, expiry,
and the operator's `nodes ls|clear` and admin routes, against a real redis-server (and
a real Redis Cluster under ``-m chaos``) and a real service. The one fake is the NVML
of a node whose GPU is made CRITICAL (tests/_fake_nvml.py)."""

from __future__ import annotations

import json
import time

import pytest
import redis
import requests

from ingest_service.service.admin import AdminConfig
from tests._fake_nvml import FakeGpu, FakeNvml
from tests.admin_helpers import AUTH, ThreadedServer, service_app
from trainer_client import redis_client
from trainer_client.health import EXIT_GPU_CRITICAL, HealthProbe
from trainguard.core import quarantine as qr
from trainguard.core.streams import ContractError
from trainguard.ops.cli import main
from trainguard.ops.exits import EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED
from trainguard.ops.nodes_cli import gate

POLICY = qr.QuarantinePolicy(quarantine_s=3600, max_failures=3, window_s=600)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def _wait_past(r: redis.Redis, t: float) -> None:
    """Until the Redis server's clock (the one the records use) is past ``t``."""
    while qr.server_time(r) <= t:
        time.sleep(0.05)


def test_critical_gate_quarantines_and_the_node_stays_out_until_cleared(redis_target, capsys):
    """A gate whose probe is CRITICAL (uncorrected ECC) writes the node's record and
    exits 75; from then on `trainguard node gate` refuses (exit 4) saying which record,
    why, until when and how to clear it, and so does the admission callable;
    `nodes ls` shows the record with its reason and report; `nodes clear` lets the
    node back (its gate admits it, exit 0); a second clear finds nothing (exit 3)."""
    url = redis_target.url
    r = redis_client.client(url)
    gpu = FakeGpu(ecc_uncorrected=1)
    with HealthProbe(nvml=FakeNvml([gpu])) as probe:
        assert gate(r, "gpu-07", probe=probe, policy=POLICY) == EXIT_GPU_CRITICAL
    capsys.readouterr()

    code, _, err = cli(capsys, "node", "gate", "--node", "gpu-07", "--redis-url", url)
    assert code == EXIT_REFUSED
    assert "gpu-07" in err and "uncorrected ECC" in err and "until" in err
    assert "trainguard nodes clear gpu-07" in err
    with pytest.raises(qr.NodeQuarantinedError) as refused:
        qr.check_admission(r, "gpu-07")
    assert refused.value.record.source == "probe"
    qr.check_admission(r, "gpu-08")  # another node is not affected

    code, out, _ = cli(capsys, "nodes", "ls", "--json", "--redis-url", url)
    rows = json.loads(out)
    assert code == EXIT_OK and [x["node"] for x in rows] == ["gpu-07"]
    assert rows[0]["source"] == "probe" and "uncorrected ECC" in rows[0]["reason"]
    assert rows[0]["report"]["status"] == "CRITICAL"
    assert rows[0]["expires_at"] == pytest.approx(rows[0]["created_at"] + 3600)
    code, out, _ = cli(capsys, "nodes", "ls", "--redis-url", url)
    assert "gpu-07" in out and "probe" in out

    code, out, _ = cli(capsys, "nodes", "clear", "gpu-07", "--redis-url", url)
    assert code == EXIT_OK and "cleared" in out
    code, _, err = cli(capsys, "node", "gate", "--node", "gpu-07", "--redis-url", url)
    assert code == EXIT_OK and "admitted" in err
    assert cli(capsys, "nodes", "clear", "gpu-07", "--redis-url", url)[0] == EXIT_NOT_FOUND
    r.close()


def test_probe_daemon_callback_quarantines_on_the_first_critical_report(redis_server) -> None:
    """The `trainguard probe --quarantine` callback on a monitor: OK and WARN reports
    write nothing; the first CRITICAL one (a hardware XID) writes the node's record
    with the probe report, and the node is refused."""
    from trainer_client.health import HealthMonitor
    from trainer_client.health.leave import quarantine_on_critical

    r = redis_client.client(redis_server.url)
    nvml = FakeNvml([FakeGpu(temperature_c=90)])
    monitor = HealthMonitor(HealthProbe(nvml=nvml),
                            on_critical=quarantine_on_critical(redis_server.url, node="n9"))
    monitor.probe_now()
    qr.check_admission(r, "n9")  # WARN (warm) is no reason
    nvml.emit_xid(0, 79)
    monitor.probe_now()
    with pytest.raises(qr.NodeQuarantinedError) as refused:
        qr.check_admission(r, "n9")
    rec = refused.value.record
    assert rec.source == "probe" and "79" in rec.reason
    assert rec.report is not None and rec.report["status"] == "CRITICAL"
    monitor.probe.close()
    r.close()


def test_an_expired_record_admits_the_node_and_is_removed(redis_server, capsys):
    """A record holds until its expiry on the Redis server's clock, then it is no
    record: admission passes, `nodes ls` is empty and the hash field is gone."""
    r = redis_client.client(redis_server.url)
    rec = qr.quarantine(r, "n1", "test", source="probe",
                        policy=qr.QuarantinePolicy(quarantine_s=0.5))
    assert rec is not None
    with pytest.raises(qr.NodeQuarantinedError):
        qr.check_admission(r, "n1")
    _wait_past(r, rec.expires_at)
    qr.check_admission(r, "n1")
    assert cli(capsys, "nodes", "ls", "--json", "--redis-url", redis_server.url)[1].strip() == "[]"
    assert r.hlen(qr.quarantine_key()) == 0
    r.close()


def test_n_failures_within_the_window_quarantine_and_older_ones_do_not_count(
    redis_server, capsys, monkeypatch
):
    """With 3 failures per window: failures that left the window are not counted; the
    3rd within it quarantines the node (`node fail` exits 4, the record's source is
    `failures`); a healthy rank's exit 76 (another node's GPU) is never counted."""
    from trainer_client.health import EXIT_PEER_CRITICAL
    from trainguard.ops import exits

    assert exits.EXIT_PEER_CRITICAL == EXIT_PEER_CRITICAL == 76  # the CLI knows the trainer's
    url = redis_server.url
    r = redis_client.client(url)
    short = qr.QuarantinePolicy(max_failures=3, window_s=0.5)
    assert qr.record_failure(r, "n2", "a", policy=short) == (1, None)
    count, _ = qr.record_failure(r, "n2", "b", policy=short)
    assert count == 2
    _wait_past(r, qr.server_time(r) + 0.5)
    assert qr.record_failure(r, "n2", "c", policy=short) == (1, None)  # a, b left the window

    monkeypatch.setenv("TRAINGUARD_QUARANTINE_FAILURES", "3")
    monkeypatch.setenv("TRAINGUARD_QUARANTINE_WINDOW_S", "600")
    fail = ("node", "fail", "--node", "n3", "--redis-url", url)
    assert cli(capsys, *fail, "--exit-code", "1")[0] == EXIT_OK
    assert cli(capsys, *fail, "--exit-code", "76")[0] == EXIT_OK  # not counted
    assert cli(capsys, *fail, "--exit-code", "76")[0] == EXIT_OK
    assert cli(capsys, *fail, "--exit-code", "1")[0] == EXIT_OK
    qr.check_admission(r, "n3")
    code, _, err = cli(capsys, *fail, "--reason", "torchrun exited 1")
    assert code == EXIT_REFUSED and "3 failures within 600 s" in err
    with pytest.raises(qr.NodeQuarantinedError) as refused:
        qr.check_admission(r, "n3")
    assert refused.value.record.source == "failures"
    assert "torchrun exited 1" in refused.value.record.reason
    assert r.exists(qr.failures_key("n3")) == 0  # the count starts over
    assert qr.clear(r, "n3") is True and qr.clear(r, "n3") is False
    qr.check_admission(r, "n3")
    r.close()


def test_disabled_quarantine_writes_nothing(redis_server, monkeypatch):
    """TRAINGUARD_QUARANTINE_S=0: a CRITICAL report or a full failure count writes no
    record, and the node is admitted."""
    monkeypatch.setenv("TRAINGUARD_QUARANTINE_S", "0")
    monkeypatch.setenv("TRAINGUARD_QUARANTINE_FAILURES", "1")
    r = redis_client.client(redis_server.url)
    assert qr.quarantine(r, "n4", "x", source="trainer") is None
    assert qr.record_failure(r, "n4", "x") == (1, None)
    qr.check_admission(r, "n4")
    assert r.hlen(qr.quarantine_key()) == 0
    monkeypatch.setenv("TRAINGUARD_QUARANTINE_S", "an hour")
    with pytest.raises(ValueError, match="TRAINGUARD_QUARANTINE_S='an hour'"):
        qr.QuarantinePolicy.from_env()
    r.close()


def test_a_corrupt_record_refuses_admission_and_can_be_cleared(redis_server, capsys):
    """A record that does not parse (written over for real) refuses the node (fail
    closed) with a message naming how to clear it; `nodes ls` lists it as unreadable;
    `nodes clear` removes it."""
    r = redis_client.client(redis_server.url)
    r.hset(qr.quarantine_key(), "n5", b"{not json")
    with pytest.raises(ContractError, match="trainguard nodes clear"):
        qr.check_admission(r, "n5")
    rows = json.loads(cli(capsys, "nodes", "ls", "--json", "--redis-url", redis_server.url)[1])
    assert [(x["node"], x["source"]) for x in rows] == [("n5", "unreadable")]
    assert cli(capsys, "nodes", "clear", "n5", "--redis-url", redis_server.url)[0] == EXIT_OK
    qr.check_admission(r, "n5")
    r.close()


def test_admin_routes_list_and_clear_with_the_token(redis_server):
    """GET /admin/nodes lists the records that hold (no token needed); POST
    /admin/nodes/{node}/clear needs the admin token (401 without, 403 wrong), then
    clears (200 with the record) and finds nothing the second time (404); a bad node
    id is 400."""
    r = redis_client.client(redis_server.url)
    qr.quarantine(r, "gpu-01", "GPU health CRITICAL: xid 79", source="trainer",
                  report={"status": "CRITICAL"}, policy=POLICY)
    from tests.admin_helpers import TOKEN

    server = ThreadedServer(service_app(AdminConfig(redis_server.url, TOKEN, {}))).start()
    try:
        got = requests.get(f"{server.url}/admin/nodes", timeout=10)
        assert got.status_code == 200
        nodes = got.json()["nodes"]
        assert [(n["node"], n["source"], n["reason"]) for n in nodes] == [
            ("gpu-01", "trainer", "GPU health CRITICAL: xid 79")]
        assert 0 < nodes[0]["remaining_s"] <= 3600
        clear = f"{server.url}/admin/nodes/gpu-01/clear"
        assert requests.post(clear, timeout=10).status_code == 401
        assert requests.post(clear, headers={"Authorization": "Bearer wrong-token-xxxxxxx"},
                             timeout=10).status_code == 403
        qr.check_admission(r, "gpu-02")
        with pytest.raises(qr.NodeQuarantinedError):
            qr.check_admission(r, "gpu-01")
        got = requests.post(clear, headers=AUTH, timeout=10)
        assert got.status_code == 200 and got.json()["record"]["reason"].endswith("xid 79")
        qr.check_admission(r, "gpu-01")
        again = requests.post(clear, headers=AUTH, timeout=10)
        assert again.status_code == 404 and again.json()["error"]["code"] == "node_not_quarantined"
        bad = requests.post(f"{server.url}/admin/nodes/a%20b/clear", headers=AUTH, timeout=10)
        assert bad.status_code == 400
        assert requests.get(f"{server.url}/admin/nodes", timeout=10).json() == {"nodes": []}
    finally:
        server.stop()
        r.close()


def test_dashboard_shows_a_quarantined_node_and_clears_it(redis_server) -> None:
    """The overview (Debian's chromium) lists the quarantined node with its source
    and reason; its clear button, with the admin token set in the tab, clears the
    record: the row disappears and the node is admitted again."""
    from tests._dashboard import DESKTOP, Page, browser
    from tests.admin_helpers import TOKEN

    r = redis_client.client(redis_server.url)
    qr.quarantine(r, "gpu-03", "GPU health CRITICAL: gpu 0: XID events [79]",
                  source="trainer", policy=POLICY)
    server = ThreadedServer(service_app(AdminConfig(redis_server.url, TOKEN, {}))).start()
    errors: list[str] = []
    try:
        with browser() as b:
            page = Page(b, server.url, DESKTOP, errors)
            page.open("/")
            row = 'tr[data-quarantined="gpu-03"]'
            page.page.wait_for_selector(row, timeout=30_000)
            assert page.values(row) == {
                "source": "trainer", "reason": "GPU health CRITICAL: gpu 0: XID events [79]",
                "created_at": page.value(f"{row} [data-k=created_at]"),
                "remaining_s": page.value(f"{row} [data-k=remaining_s]")}
            page.page.evaluate(f"sessionStorage.setItem('trainguard-token', '{TOKEN}')")
            page.page.locator(f"{row} button").click()
            page.page.wait_for_selector("text=no quarantined nodes", timeout=30_000)
            qr.check_admission(r, "gpu-03")
            page.close()
    finally:
        server.stop()
        r.close()
    assert errors == []


@pytest.mark.parametrize("argv", [("node",), ("node", "gate"), ("node", "fail"), ("nodes",),
                                  ("nodes", "ls"), ("nodes", "clear")])
def test_node_commands_have_help(argv, capsys) -> None:
    """`trainguard node|nodes ... --help` exits 0 with its usage line."""
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage: trainguard " + " ".join(argv) in capsys.readouterr().out
