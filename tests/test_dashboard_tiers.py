"""Where each checkpoint lives, in the admin API and on the dashboard: a real
TrainingSession over a NodeTierStore (RAM tier, a partner's tier server, local disk)
saves four checkpoints; the service (real HTTP, ``TRAINGUARD_TIER_SERVERS`` naming
the real tier servers) lists each with the tiers that hold it, the run page's tier
column in a real headless Chromium shows the same, and a lost partner drops out of
the column."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch
from torch.utils.data import DataLoader

from checkpoint_store.node_tiers import NodeTierStore, TierIntervals
from checkpoint_store.partner import node_root
from checkpoint_store.ram_tier import RamTierStore
from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot, parse_store_roots
from tests import _client_fill as cf
from tests._dashboard import DESKTOP, Page, browser
from tests._tier_servers import tier_servers
from tests.admin_helpers import TOKEN, ThreadedServer, service_app
from trainer_client import TrainingSession

MB = 1 << 20


def _tiers(base: str, path: str, key: str) -> dict[int, list[str]]:
    got = requests.get(f"{base}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert got.status_code == 200, got.text
    return {row["step"]: row["tiers"] for row in got.json()[key]}


def test_tier_column_shows_where_each_checkpoint_lives(redis_server, shm: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves 1..4 with partner copies of every 2nd and disk copies of every 3rd: the
    API's rows (checkpoint list and run history) say step 1 ram, 2 ram+partner:n1,
    3 ram+disk, 4 ram+partner:n1 (steps 1, 2 and 4 are on no disk: the rows come from
    the tier servers' index); the page's tier cells say the same; with node 1's
    server gone, no row names partner:n1."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 64)
    disk = tmp_path / "disk"
    with tier_servers(shm, 2) as servers:
        ram = RamTierStore(node_root(servers.node_shm(0), 0), budget_bytes=64 * MB, keep_last=10)
        store = NodeTierStore(ram, node=0, peers=servers.urls, disk_root=disk,
                              disk_keep_last=10,
                              intervals=TierIntervals(partner_every=2, disk_every=3))
        session = TrainingSession(redis_server.url, dataset="tok", run="exp", store=store,
                                  keep_last=10)
        state = {"w": torch.zeros(64)}
        step = session.restore(state)
        for _batch in session.batches(DataLoader(session.dataset(batch_size=8), batch_size=None)):
            step += 1
            state["w"] += 1
            session.checkpoint(state, step, blocking=True)
            if step == 4:
                break
        session.wait()
        store.wait_copies()
        session.close()
        store.close()

        monkeypatch.setenv("TRAINGUARD_TIER_SERVERS", f"n0=0:{' '.join(servers.urls)}")
        config = AdminConfig(redis_server.url, TOKEN, {"n0": StoreRoot("n0", str(disk))})
        server = ThreadedServer(service_app(config)).start()
        try:
            want = {1: ["ram"], 2: ["ram", "partner:n1"], 3: ["ram", "disk"],
                    4: ["ram", "partner:n1"]}
            assert _tiers(server.url, "/admin/checkpoints/n0", "checkpoints") == want
            assert _tiers(server.url, "/admin/runs/exp?dataset=tok", "checkpoints") == want
            with browser() as b:
                errors: list[str] = []
                page = Page(b, server.url, DESKTOP, errors)
                page.open("/run/exp?dataset=tok")
                shown = page.page.eval_on_selector_all(
                    "tr[data-step] [data-k=tiers]",
                    "els => els.map(e => [e.closest('tr').dataset.step, e.dataset.v])")
                assert {int(s): v.split() for s, v in shown} == want, shown
                servers.lose(1)
                page.open("/run/exp?dataset=tok")
                page.fresh_render()
                after = page.page.eval_on_selector_all(
                    "tr[data-step] [data-k=tiers]",
                    "els => els.map(e => [e.closest('tr').dataset.step, e.dataset.v])")
                assert {int(s): v.split() for s, v in after} == {
                    1: ["ram"], 2: ["ram"], 3: ["ram", "disk"], 4: ["ram"]}, after
                page.close()
                assert not errors, errors
        finally:
            server.stop()


def test_tier_servers_of_an_unknown_store_or_bad_node_are_refused() -> None:
    """TRAINGUARD_TIER_SERVERS naming no configured store, or a node beyond its URLs,
    is a ValueError that says what was expected."""
    with pytest.raises(ValueError, match="not among the checkpoint stores"):
        parse_store_roots("a=file:///x", "b=0:http://h:1")
    with pytest.raises(ValueError, match="the node a number below the count of URLs"):
        parse_store_roots("a=file:///x", "a=2:http://h:1 http://h:2")
    roots = parse_store_roots("a=file:///x", "a=1:http://h:1 http://h:2")
    assert roots["a"].tier_servers is not None and roots["a"].tier_servers.node == 1
