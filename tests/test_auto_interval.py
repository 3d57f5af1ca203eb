"""``TrainingSession(checkpoint_every="auto")``: a real run (real Redis, real tier
servers in /dev/shm, real files) checkpoints each tier of its store on the plan the
multi-level advisor gave at each save; the plan itself against its formula; bad
values of ``checkpoint_every`` refused before anything is opened."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from checkpoint_store.layout import parse_manifest_name
from checkpoint_store.node_tiers import NodeTierStore, TierIntervals
from checkpoint_store.partner import node_root
from checkpoint_store.ram_tier import RamTierStore
from checkpoint_store.store import CheckpointStore
from checkpoint_store.tiered import TieredCheckpointStore
from tests import _client_fill as cf
from tests._tier_servers import tier_servers
from trainer_client import TrainingSession
from trainguard.core.multilevel import Level, level_periods
from trainguard.core.tier_plan import (
    TierInfo,
    TierPolicy,
    failure_kind_of,
    failure_rates,
    plan_tiers,
)

MB = 1 << 20
# Failures far more often than any real run sees, so that a run of a few seconds
# takes several saves per tier: a crash every 2 s, a node every 40 s, ...
POLICY = TierPolicy(prior_mtbf_s={"crash": 2.0, "node": 40.0, "nodes": 400.0, "job": 4000.0})


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "sometimes", "AUTO", [10]])
def test_bad_checkpoint_every_is_refused_before_anything_opens(tmp_path: Path, bad: Any) -> None:
    """A checkpoint_every that is not an int >= 1, "auto" or None is a ValueError that
    names the value and the valid ones; nothing is created (no store directory) and
    no server is needed (the Redis URL is never dialled)."""
    store = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"checkpoint_every must be a whole number of steps "
                       r">= 1, 'auto' or None, got " + _re(repr(bad))):
        TrainingSession("redis://127.0.0.1:1", dataset="tok", run="r", store=f"file://{store}",
                        checkpoint_every=bad)
    assert not store.exists()


def _re(text: str) -> str:
    import re

    return re.escape(text)


def _train(session: TrainingSession, store: Any, *, step_s: float) -> list[tuple[int, Any]]:
    """Train through the data, saving when ``should_checkpoint`` says; returns each
    save's step and the intervals the store held as it saved."""
    state = {"w": torch.zeros(4096)}
    step = session.restore(state)
    saves: list[tuple[int, Any]] = []
    loader = DataLoader(session.dataset(batch_size=4), batch_size=None)
    for _batch in session.batches(loader):
        step += 1
        state["w"] += 1
        time.sleep(step_s)
        if session.should_checkpoint(step):
            saves.append((step, _intervals(store)))
            session.checkpoint(state, step)
    session.wait()
    return saves


def _intervals(store: Any) -> Any:
    if isinstance(store, NodeTierStore):
        return store.intervals
    return store.upload_every


def _steps(names: Any) -> set[int]:
    return {p.step for p in map(parse_manifest_name, names) if p is not None}


def test_auto_copies_each_tier_of_a_node_store_on_the_advised_schedule(
        redis_server, shm: Path, tmp_path: Path) -> None:
    """A one-node run over a NodeTierStore (RAM, a partner's tier server, local disk)
    with checkpoint_every="auto": the k-th save is on the partner exactly when k is a
    multiple of the plan's partner interval at that save, and on disk exactly when a
    multiple of its disk interval; the first save goes everywhere (nothing measured),
    and the plan is multi-level: saves every few steps, partner copies of fewer of
    them, disk copies of some of those (the final plan's disk interval above the
    partner's)."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 2400)
    with tier_servers(shm, 2, keep_copies=10_000) as servers:
        ram = RamTierStore(node_root(servers.node_shm(0), 0), budget_bytes=64 * MB, keep_last=2)
        store = NodeTierStore(ram, node=0, peers=servers.urls, disk_root=tmp_path / "disk",
                              disk_keep_last=10_000, intervals=TierIntervals(partner_every=7),
                              hold_until_copied=True)  # a slow copy must not lose its save
        session = TrainingSession(redis_server.url, dataset="tok", run="auto", store=store,
                                  checkpoint_every="auto", tier_policy=POLICY)
        saves = _train(session, store, step_s=0.004)
        plan = session.checkpoint_plan()
        store.wait_copies()
        partner = _steps(e["name"] for e in (store.link.index(1, 0) or {}).get("ram", []))
        disk = {m.step for m in CheckpointStore(tmp_path / "disk").list()}
        session.close()
        store.close()
    want_partner = {s for k, (s, iv) in enumerate(saves, 1)
                    if iv.partner_every and k % iv.partner_every == 0}
    want_disk = {s for k, (s, iv) in enumerate(saves, 1) if iv.disk_every and k % iv.disk_every == 0}
    assert saves[0][1] == TierIntervals(partner_every=1, disk_every=1, remote_every=0)
    assert partner == want_partner, (sorted(partner), sorted(want_partner))
    assert disk == want_disk, (sorted(disk), sorted(want_disk))
    steps = 2400 // 4 // 1  # two partitions of 1200 records, batches of 4
    assert plan is not None, "the run never planned"
    assert 2 <= len(saves) < steps // 2, (len(saves), plan.to_json())
    # Nested at every save (each disk interval a multiple of the partner one), so disk
    # copies are partner copies too; how many of each depends on the measured costs,
    # which the plan may revise mid-run, so only the final plan's order is pinned.
    assert disk and disk <= partner and len(partner) < len(saves), (
        sorted(disk), sorted(partner), len(saves), plan.to_json())
    assert plan.every["partner"] > 1 and plan.every["disk"] > plan.every["partner"], plan.to_json()


def test_auto_uploads_every_nth_save_of_a_tiered_store(redis_server, tmp_path: Path) -> None:
    """A TieredCheckpointStore (local disk, a remote root) with "auto": the remote root
    holds exactly the saves whose index is a multiple of the upload interval in force
    at that save, and fewer than all of them (the first one included: nothing was
    measured)."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 2400)
    store = TieredCheckpointStore(tmp_path / "local", f"file://{tmp_path}/remote", keep_last=2)
    policy = TierPolicy(prior_mtbf_s={"crash": 2.0, "node": 1e6, "nodes": 1e6, "job": 60.0})
    session = TrainingSession(redis_server.url, dataset="tok", run="auto", store=store,
                              checkpoint_every="auto", tier_policy=policy)
    saves = _train(session, store, step_s=0.004)
    plan = session.checkpoint_plan()
    store.wait_uploads(60)
    remote = {m.step for m in CheckpointStore(f"file://{tmp_path}/remote").list()}
    session.close()
    store.close()
    want = {s for k, (s, every) in enumerate(saves, 1) if every and k % every == 0}
    assert saves[0][1] == 1
    assert remote == want, (sorted(remote), sorted(want))
    assert plan is not None and plan.every["remote"] > 1, plan
    assert 1 <= len(remote) < len(saves)


def test_plan_is_youngs_per_tier_from_costs_and_rates() -> None:
    """The plan's periods are level_periods of (measured cost, the rate of the failures
    each tier is the cheapest to survive), with the observed run in the rates'
    posterior; a tier not measured yet is copied every save; a restore names the
    failure kind by the tier that served it."""
    tiers = [TierInfo("ram", "crash"), TierInfo("partner", "node", 0.2),
             TierInfo("disk", "nodes", 1.0), TierInfo("remote", "job", 10.0)]
    failures = {"crash": 3, "node": 1}
    rates = failure_rates(failures, 3600.0, POLICY)
    assert rates["crash"] == (1 + 3) / (2.0 + 3600.0)
    plan = plan_tiers(tiers, save_cost_s=0.01, failures=failures, observed_s=3600.0,
                      policy=POLICY)
    want = level_periods([Level("ram", 0.01, rates["crash"]),
                          Level("partner", 0.2, rates["node"]),
                          Level("disk", 1.0, rates["nodes"]), Level("remote", 10.0, rates["job"])])
    assert [plan.periods_s[t.name] for t in tiers] == pytest.approx(want)
    assert plan.period_s == pytest.approx(math.sqrt(2 * 0.01 / rates["crash"]))
    m1 = round(want[1] / want[0])
    assert plan.every["partner"] == m1
    assert plan.every["disk"] == m1 * round(want[2] / (want[0] * m1))
    # A two-tier store: node and nodes failures need the remote tier, the cheapest
    # that survives them.
    two = plan_tiers([TierInfo("disk", "crash"), TierInfo("remote", "job", None)],
                     save_cost_s=0.01, failures={}, observed_s=0.0, policy=POLICY)
    assert two.every == {"remote": 1}
    assert two.rates_per_s["remote"] == pytest.approx(sum(
        failure_rates({}, 0.0, POLICY)[k] for k in ("node", "nodes", "job")))
    assert failure_kind_of(tiers, "partner:n2") == "node"
    assert failure_kind_of(tiers, "ram") == "crash"
    assert failure_kind_of(tiers, "remote") == "job"
    assert failure_kind_of(tiers, None) == "crash"


def test_auto_plan_is_within_20_percent_of_the_swept_optimum() -> None:
    """plan_tiers from failures of each kind at known rates (crash, node loss, job
    loss; the run's counts on top of the priors) and known tier costs: the simulated
    waste (tests/test_multilevel.simulate, failures of each kind rolling back to the
    cheapest tier that survives it) at the plan's intervals is within 20 % of the best
    of a sweep of every tier's interval x0.5..x2, with the same failures."""
    import itertools

    from tests.test_multilevel import STEP_S, simulate
    from trainguard.core.multilevel import nested_multiples

    tiers = [TierInfo("ram", "crash"), TierInfo("partner", "node", 3.0),
             TierInfo("remote", "job", 30.0)]
    policy = TierPolicy(prior_mtbf_s={"crash": 600.0, "node": 3600.0, "nodes": 1e12,
                                      "job": 20000.0}, prior_weight=1000.0)
    plan = plan_tiers(tiers, save_cost_s=0.5, failures={}, observed_s=0.0, policy=policy)
    levels = [Level(t.name, float(plan.costs_s[t.name] or 0.0), plan.rates_per_s[t.name])
              for t in tiers]
    every = [max(1, round(plan.period_s / STEP_S)), plan.every["partner"],
             plan.every["remote"] // plan.every["partner"]]
    work_s, seed = 200_000.0, 11
    mine = simulate(every, levels, work_s, seed)
    chosen = [plan.periods_s[t.name] for t in tiers]
    best = math.inf
    for factors in itertools.product([0.5, 0.7, 1.0, 1.4, 2.0], repeat=len(tiers)):
        periods = sorted(t * k for t, k in zip(chosen, factors, strict=True))
        best = min(best, simulate(nested_multiples(periods, STEP_S), levels, work_s, seed))
    assert mine <= 1.2 * best, (mine, best, every, plan.to_json())


def test_auto_counts_each_restore_by_the_tier_that_served_it(redis_server,
                                                               tmp_path: Path) -> None:
    """With "auto" over a TieredCheckpointStore, a restore from local disk counts a
    crash and one from remote storage (local disk wiped) a node loss (the mildest
    failure local disk does not survive): the counts ride in the next manifest's
    extra["trainguard_tiers"] and add up over restarts."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 64)
    remote = f"file://{tmp_path}/remote"

    def attempt() -> dict[str, int]:
        store = TieredCheckpointStore(tmp_path / "local", remote, keep_last=2)
        session = TrainingSession(redis_server.url, dataset="tok", run="r", store=store,
                                  checkpoint_every="auto", tier_policy=POLICY)
        state = {"w": torch.zeros(8)}
        step = session.restore(state)
        it = iter(session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None)))
        next(it)
        session.checkpoint(state, step + 1, blocking=True)
        session.wait()
        store.wait_uploads(60)
        got = CheckpointStore(f"file://{tmp_path}/remote").list()[-1].extra["trainguard_tiers"]
        session.close()
        store.close(wait_upload=60)
        return dict(got["failures"])

    zero = {"crash": 0, "node": 0, "nodes": 0, "job": 0}
    assert attempt() == zero
    assert attempt() == {**zero, "crash": 1}
    shutil.rmtree(tmp_path / "local")
    assert attempt() == {**zero, "crash": 1, "node": 1}
