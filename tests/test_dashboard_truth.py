"""The run page tells the truth, in a real headless Chromium against the real service,
Redis and a real trainer (tests/_client_train.py with ``--log-loss``: a TrainingSession
calling ``session.log(step, loss=<tensor>)``), SIGKILLed once and resumed, with a
retention of two checkpoints:

- the run header's restarts and the Restarts card agree after retention pruned the
  manifest that showed the restart (the card's row comes from the recorded attempts);
- the loss shown is the trainer's own (a value it logged, at the step it logged it),
  with steps/s and an ETA equal to the API's (the ETA: steps left / steps per second);
- the heartbeat is green while the trainer trains, turns red ("stalled") on the open
  page when the trainer is stopped (SIGSTOP: a hung process), and green again when it
  goes on;
- charts have time axes (clock times), no number is shown with an exponent, the
  interval advice is words (no formula), and stream IDs are shown in words.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import requests

from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot
from tests import _client_fill as cf
from tests._client_ledger import Job, zygote
from tests._dashboard import DESKTOP, Page, browser, same
from tests.admin_helpers import TOKEN, ThreadedServer, service_app

N, P, BATCH = 12000, 4, 8


def _args(url: str, store: str) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "exp", "--store", store,
            "--n", str(N), "--batch-size", str(BATCH), "--ckpt-every", "5", "--sleep-ms", "40",
            "--keep-last", "2", "--log-loss"]


def _api(base: str, path: str) -> dict:
    got = requests.get(f"{base}{path}", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


def _logged(job: Job) -> dict[int, float]:
    """Every (step, loss) the trainer logged so far (its lines read to the last one)."""
    while job.next_line(0.5) is not None:
        pass
    out = {}
    for line in job.seen:
        rank, _, rest = line.partition(": ")
        if rank == "0" and rest.startswith("LOG "):
            _, step, loss = rest.split()
            out[int(step)] = float(loss)
    return out


def _heartbeat(page: Page) -> tuple[str | None, str]:
    el = page.page.locator('[data-k="heartbeat"]').first
    return el.get_attribute("data-v"), el.get_attribute("class") or ""


def test_the_run_page_tells_the_truth(redis_server, tmp_path: Path) -> None:
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path / 'ckpt'}"
    server = ThreadedServer(service_app(
        AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", store)}))).start()
    base = server.url
    errors: list[str] = []
    try:
        with zygote(tmp_path / "job.log") as z:
            first = z.spawn(_args(redis_server.url, store), 1)
            assert first.wait_line("COMMITTED", 120, nth=2)
            first.kill()
            job = z.spawn(_args(redis_server.url, store), 1)
            assert job.wait_line("READY", 120)
            resumed = int(job.seen[-1].split()[-1])
            # Retention (keep 2) prunes every checkpoint of the first generation.
            deadline = time.monotonic() + 120
            while True:
                assert job.wait_line("COMMITTED", 120)
                r = _api(base, "/admin/runs/exp?dataset=tok")
                if r["checkpoints"] and {c["generation"] for c in r["checkpoints"]} == {2}:
                    break
                assert time.monotonic() < deadline, r["checkpoints"]
            assert r["totals"]["failures"] == 1
            assert [(x["generation"], x["seen_in"], x["resumed_step"], x["cause"])
                    for x in r["restarts"]] == [(2, "attempts", resumed, "killed")]

            with browser() as b:
                page = Page(b, base, DESKTOP, errors)
                page.open("/run/exp?dataset=tok")
                page.wait_until("document.querySelector('[data-k=heartbeat]') && "
                                "document.querySelector('[data-k=heartbeat]').dataset.v "
                                "=== 'training'")
                os.kill(job.pids[0], signal.SIGSTOP)  # a hung trainer, from here on
                page.fresh_render()
                r = _api(base, "/admin/runs/exp?dataset=tok")
                shown = page.values("main > section.stats")
                assert same(shown["restarts"], r["totals"]["failures"])
                rows = page.page.locator("tr[data-restart]")
                assert rows.count() == r["totals"]["failures"] == 1
                assert same(page.value('tr[data-restart="2"] [data-k="resumed_step"]'), resumed)

                t = r["training"]
                train = page.values("main")
                assert same(train["loss"], t["values"]["loss"])
                assert _logged(job)[t["step"]] == t["values"]["loss"]
                assert same(train["train_step"], t["step"])
                assert t["steps_per_s"] > 0 and same(train["steps_per_s"], t["steps_per_s"])
                # One epoch of 12,000 records in batches of 8 on one rank: 1,500 steps.
                assert t["steps_left"] == N // BATCH - t["step"]
                assert t["eta_s"] == t["steps_left"] / t["steps_per_s"]
                assert same(train["eta_s"], t["eta_s"])

                # Stopped: the open page turns the heartbeat red, with advice in words.
                page.wait_until("document.querySelector('[data-k=heartbeat]').dataset.v "
                                "=== 'stalled'", timeout_ms=60_000)
                status, cls = _heartbeat(page)
                assert status == "stalled" and "bad" in cls.split()
                assert _api(base, "/admin/runs/exp?dataset=tok")["training"]["heartbeat"][
                    "status"] == "stalled"
                advice = page.page.locator('[data-k="heartbeat_advice"]').first.inner_text()
                assert "stopped or hung" in advice
                os.kill(job.pids[0], signal.SIGCONT)
                page.wait_until("document.querySelector('[data-k=heartbeat]').dataset.v "
                                "=== 'training'", timeout_ms=60_000)
                assert "ok" in _heartbeat(page)[1].split()

                # Time axes, readable numbers, advice in words.
                ticks = page.page.eval_on_selector_all(
                    "svg text[data-axis=time]", "els => els.map(e => e.textContent)")
                assert ticks and all(re.fullmatch(r"\d\d:\d\d:\d\d", x) for x in ticks), ticks
                text = page.page.locator("main").inner_text()
                assert not re.search(r"\de[-+]?\d", text), re.findall(r"\S*\de[-+]?\d\S*", text)
                assert "sqrt" not in text and r["advice"]["formula"] not in text
                assert page.page.locator('[data-k="advice_text"]').count() == 1

                page.open("/dataset/tok")
                for p in range(P):
                    cell = page.page.locator(f'tr[data-partition="{p}"] [data-k="last_id"]')
                    raw, words = cell.get_attribute("data-v"), cell.inner_text()
                    assert raw and re.fullmatch(r"\d+-\d+", raw) and words.startswith("epoch 1, record ")
                    assert int(words.rsplit(" ", 1)[-1].replace(",", "")) == int(raw.split("-")[1]) + 1
                    done = page.page.locator(f'tr[data-partition="{p}"] [data-k="committed:exp"]')
                    raw = done.get_attribute("data-v")
                    assert raw and re.fullmatch(r"\d+-\d+", raw)
                    assert done.inner_text() == (f"epoch {raw.split('-')[0]}, record "
                                                 f"{int(raw.split('-')[1]) + 1:,}")
                text = page.page.locator("main").inner_text()
                assert not re.search(r"\de[-+]?\d", text), text
                page.close()
            job.kill()
    finally:
        server.stop()
    assert errors == []
