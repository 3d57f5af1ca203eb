"""The dashboard in a real headless Chromium, against the real service with a real
TrainingSession run in progress (a trainer process killed with SIGKILL and resumed):

- the numbers on each page equal the admin API's (read while the trainer is stopped
  with SIGSTOP, so both sides see the same Redis and the same manifests);
- the lag shown changes while records are consumed, without a reload;
- a SIGKILL and resume of the trainer appears on the run's timeline, live;
- a node's GPU health (a real probe daemon over the allowed fake NVML) is shown;
- pin is refused without the admin token, in the page too;
- every page renders at 1280x800 and 390x844 without sideways overflow, with a
  screenshot of each under the test's tmp dir, and no console error anywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import redis
import requests

from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot
from tests import _client_fill as cf
from tests._client_ledger import Job, zygote
from tests._dashboard import DESKTOP, PHONE, Page, browser, same
from tests._fake_nvml import FakeGpu, FakeNvml
from tests.admin_helpers import TOKEN, ThreadedServer, service_app
from trainer_client.health import HealthMonitor, HealthProbe
from trainguard.core import streams
from trainguard.ops.probe import ProbeServer

N, P = 12000, 4


def _trainer_args(url: str, store: str) -> list[str]:
    # Slow enough (40 ms a step) to be still training when the browser looks.
    return ["--redis", url, "--dataset", "tok", "--run", "exp", "--store", store,
            "--n", str(N), "--batch-size", "8", "--ckpt-every", "10", "--sleep-ms", "40",
            "--keep-last", "100", "--log-loss"]


def _ready_step(job: Job) -> int:
    return int(next(s for s in reversed(job.seen) if s.startswith("0: READY")).split()[-1])


def _signal(job: Job, sig: int) -> None:
    os.kill(job.pids[0], sig)


def _api(base: str, path: str) -> dict:
    got = requests.get(f"{base}{path}", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


def _check_overview(page: Page, base: str) -> None:
    nodes = _api(base, "/admin/health")["nodes"]
    assert [(n["node"], n["status"]) for n in nodes] == [("node-a", "WARN")]
    assert page.value('tr[data-node="node-a"] [data-k="node_status"]') == "WARN"
    assert page.value('tr[data-node="node-a"] [data-k="gpu_status:0"]') == "WARN"
    datasets = {d["name"]: d for d in _api(base, "/admin/datasets")["datasets"]}
    shown = page.values('tr[data-dataset="tok"]:not([data-run])')
    for key in ("partitions", "length", "paused", "dead_letters"):
        assert same(shown[key], datasets["tok"][key]), (key, shown[key], datasets["tok"][key])
    runs = {r["run"]: r for r in _api(base, "/admin/runs")["runs"]}
    shown = page.values('tr[data-run="exp"]')
    for key in ("last_step", "last_commit_at", "generation", "restarts", "rollbacks", "lag",
                "current_s", "recommended_s"):
        assert same(shown[key], runs["exp"][key]), (key, shown[key], runs["exp"][key])


def _check_dataset(page: Page, base: str, client: redis.Redis) -> None:
    d = _api(base, "/admin/datasets/tok/detail")
    shown = page.values("main > section.stats")
    assert same(shown["length"], d["length"]) and same(shown["paused"], d["paused"])
    assert same(shown["dead_letters"], d["dead_letters"]["count"])
    assert same(shown["partitions"], len(d["partitions"]))
    (group,) = d["groups"]
    assert same(page.value('[data-k="group_lag"]'), group["lag"])
    by_part = {g["partition"]: g for g in group["partitions"]}
    for p in d["partitions"]:
        row = page.values(f'tr[data-partition="{p["partition"]}"]')
        for key in ("length", "last_id", "retention_floor", "paused"):
            assert same(row[key], p[key]), (p["partition"], key, row[key], p[key])
        assert same(row["produced"], p["producer_position"]["records"])
        assert same(row["committed:exp"], by_part[p["partition"]]["committed"])
        assert same(row["lag:exp"], by_part[p["partition"]]["lag"])
        # The lag is exact: the entries after the group's last delivered ID (Redis
        # forgets it after a restore's SETID; the service counts by the IDs then).
        delivered = by_part[p["partition"]]["last_delivered_id"]
        after = client.xrange(streams.partition_key("tok", p["partition"]), min=f"({delivered}")
        assert by_part[p["partition"]]["lag"] == len(after)


def _check_run(page: Page, base: str) -> dict:
    r = _api(base, "/admin/runs/exp?dataset=tok")
    shown = page.values("main > section.stats")
    last = r["checkpoints"][-1]
    expected = {"checkpoints": len(r["checkpoints"]), "last_step": last["step"],
                "generation": last["generation"], "restarts": r["totals"]["failures"],
                "rollbacks": len(r["rollbacks"]), "lag": r["group"]["lag"],
                "last_commit_at": last["created_at"]}
    for key, want in expected.items():
        assert same(shown[key], want), (key, shown[key], want)
    advice = page.values("main")  # the advice card comes before the checkpoint table
    for key in ("recommended_s", "current_s", "lost_recommended_s", "lost_current_s",
                "mtbf_s", "blocked_s", "durable_s"):
        assert same(advice[key], r["advice"][key]), (key, advice[key], r["advice"][key])
    for x in r["restarts"]:
        row = page.values(f'tr[data-restart="{x["generation"]}"]')
        assert same(row["resumed_step"], x["resumed_step"])
    for x in r["incidents"]:
        row = page.values(f'tr[data-incident="{x["attempt"]}"]')
        assert row["cause"] == x["cause"] and same(row["step"], x["step"]), (row, x)
    return r


def test_dashboard_in_chromium(redis_server, tmp_path: Path, monkeypatch) -> None:
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    client = redis.Redis.from_url(redis_server.url)
    client.xadd(streams.dlq_key("tok"),
                streams.encode_dead_letter("undecodable", "/data/secret/dir/x.jsonl:99", b"{"))
    ckpt = tmp_path / "ckpt"
    store = f"file://{ckpt}"
    # One node's GPU health daemon, its GPU warm (the fake NVML: no GPU here).
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([FakeGpu(temperature_c=90)])))
    monitor.probe_now()
    probe = ProbeServer(monitor, "127.0.0.1", 0).start()
    monkeypatch.setenv("TRAINGUARD_PROBES", f"node-a={probe.url}")
    server = ThreadedServer(service_app(
        AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", store)}))).start()
    base = server.url
    shots = tmp_path / "screenshots"
    errors: list[str] = []
    try:
        with zygote(tmp_path / "job.log") as z:
            first = z.spawn(_trainer_args(redis_server.url, store), 1)
            assert first.wait_line("COMMITTED", 120, nth=2)
            first.kill()
            job = z.spawn(_trainer_args(redis_server.url, store), 1)
            assert job.wait_line("COMMITTED", 120, nth=2)

            # The page may run only its own files (a violation would be a console error).
            csp = requests.get(f"{base}/ui", timeout=10).headers["Content-Security-Policy"]
            assert csp.startswith("default-src 'none'; script-src 'self'")
            with browser() as b:
                page = Page(b, base, DESKTOP, errors)
                page.open("/")
                _signal(job, signal.SIGSTOP)
                page.fresh_render()
                _check_overview(page, base)
                assert page.overflow_px() <= 0
                page.screenshot(shots / "overview-1280x800.png")

                page.open("/dataset/tok")
                _check_dataset(page, base, client)
                assert page.overflow_px() <= 0
                page.screenshot(shots / "dataset-1280x800.png")
                # The dead letter's position is shown without its directories.
                assert page.page.get_by_text("x.jsonl:99").count() == 1
                assert "secret" not in page.page.content()
                lag_before = int(page.value('[data-k="group_lag"]') or 0)
                _signal(job, signal.SIGCONT)
                page.wait_until(
                    f"Number(document.querySelector('[data-k=group_lag]').dataset.v) "
                    f"< {lag_before}")

                page.open("/run/exp?dataset=tok")
                _signal(job, signal.SIGSTOP)
                page.fresh_render()
                before = _check_run(page, base)
                assert [x["generation"] for x in before["restarts"]] == [2]
                # The killed first trainer is an incident (Redis), shown on the page.
                assert [x["cause"] for x in before["incidents"]] == ["killed"]
                _signal(job, signal.SIGCONT)

                # SIGKILL the trainer and resume it: the restart appears on the open
                # page (no reload), resumed where the new process says it resumed.
                job.kill()
                job = z.spawn(_trainer_args(redis_server.url, store), 1)
                assert job.wait_line("COMMITTED", 120, nth=2)
                page.page.wait_for_selector('tr[data-restart="3"]', timeout=30_000)
                page.wait_until(
                    "document.querySelectorAll('line[data-mark=restart]').length === 2")
                assert same(page.value('tr[data-restart="3"] [data-k="resumed_step"]'),
                            _ready_step(job))
                assert page.overflow_px() <= 0
                run_png = page.screenshot(shots / "run-1280x800.png")
                if os.environ.get("TRAINGUARD_SCREENSHOT_DIR"):
                    shutil.copy(run_png, Path(os.environ["TRAINGUARD_SCREENSHOT_DIR"])
                                / "dashboard-run.png")

                # Pin: without a token the page refuses to send; with it, it pins.
                step = int(page.value("tr[data-step] [data-k=step]") or -1)
                button = page.page.locator(f'tr[data-step="{step}"] button')
                page.page.on("dialog", lambda d: d.dismiss())
                button.click()
                assert requests.post(f"{base}/admin/checkpoints/main/{step}/pin",
                                     timeout=10).status_code == 401
                page.page.evaluate(f"sessionStorage.setItem('trainguard-token', '{TOKEN}')")
                page.page.locator(f'tr[data-step="{step}"] button').click()
                page.page.wait_for_selector(f'tr[data-step="{step}"] >> text=pinned',
                                            timeout=30_000)
                rows = {c["step"]: c for c in _api(base, "/admin/checkpoints/main")[
                    "checkpoints"]}
                assert "pinned" in rows[step]["status"]
                page.close()

                phone = Page(b, base, PHONE, errors)
                for name, fragment in (("overview", "/"), ("dataset", "/dataset/tok"),
                                       ("run", "/run/exp?dataset=tok")):
                    phone.open(fragment)
                    assert phone.overflow_px() <= 0, name
                    phone.screenshot(shots / f"{name}-390x844.png")
                phone.close()
            job.kill()
    finally:
        server.stop()
        probe.stop()
    assert errors == []
    assert sorted(p.name for p in shots.iterdir()) == sorted(
        f"{n}-{s}.png" for n in ("overview", "dataset", "run") for s in ("1280x800", "390x844"))
