"""Elastic jobs under ``torchrun --rdzv-backend=trainguard``: each node a real torchrun
agent (``--nproc-per-node=1``, gloo on CPU) training the ledger job with the
TrainingSession and the streaming dataset against a real redis-server; the verdict
is the per-record ledger of the final checkpoint.

- The first node (rank 0 of the first round: the node c10d's rendezvous would be
  hosted on) is killed with kill -9 of its agent's process group: the others
  re-form, restore and finish, every record trained exactly once.
- A node killed and started again mid-run is admitted at the next round, the job
  finishes with it (world 3 again), every record exactly once.

A kill is noticed by the survivors' workers at their next collective, so kills land
while the job trains (after its first commit, with most of the data still to train);
where the test then waits for something slower (a node starting again), the dataset
is finished only after it happened, so the job cannot end first."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests import _client_fill as cf
from tests._client_ledger import assert_each_once, final_counts
from tests._elastic_agents import Agent, agent_command, rank0_agent, read_incidents, wait_for
from tests.servers import RedisServer

P = 6


def _job_args(url: str, store: str, n: int) -> list[str]:
    return ["--redis", url, "--dataset", "el", "--run", "exp", "--store", store,
            "--n", str(n), "--batch-size", "4", "--ckpt-every", "2", "--sleep-ms", "100"]


def _start(url: str, store: str, run_id: str, names: list[str], tmp: Path, n: int,
           nnodes: str = "1:3") -> list[Agent]:
    command = agent_command("trainguard", url, run_id, nnodes, _job_args(url, store, n))
    return [Agent(name, command, tmp / f"agent-{name}.log") for name in names]


def _finish(agents: list[Agent], timeout_s: float = 240.0) -> None:
    for a in agents:
        code = a.wait(timeout_s)
        assert code == 0, f"agent {a.name} exited {code}:\n{a.tail(60)}"


def _world(store: str, n: int) -> tuple[int, object]:
    counts, extra = final_counts(store, n)
    return int(extra["trainguard"]["world_size"]), counts


def test_killing_the_first_node_leaves_the_others_to_finish_exactly_once(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """3 nodes; after a checkpoint is committed, the node whose worker is rank 0 is
    killed (agent and worker, kill -9). The two others rendezvous again without it
    (nothing of the rendezvous lived there), restore the checkpoint and finish the
    dataset: the final checkpoint is written by a world of 2, every record in it
    counted exactly once."""
    n = 240  # 20 steps a rank on 3 nodes; the kill lands after 2 to 4
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "el", partitions=P), n)
    agents = _start(url, store, "kill-first", ["a", "b", "c"], tmp_path, n)
    try:
        wait_for(agents, "COMMITTED")
        first = rank0_agent(agents)
        first.kill()
        rest = [a for a in agents if a is not first]
        _finish(rest)
        assert all(len(a.seen("READY")) == 2 for a in rest)  # restarted once, together
        world, counts = _world(store, n)
        assert world == 2
        assert_each_once(counts)  # type: ignore[arg-type]
        # The incident splits the restart where the round closed (the handler's mark,
        # inherited by the workers): rendezvous, then spawn, both measured.
        incident = read_incidents(url, "el", "exp")[0]
        phases = incident["recovery"]["phases_s"]
        assert "restart" not in phases and phases["rendezvous"] is not None, phases
        assert phases["spawn"] is not None and phases["spawn"] >= 0, phases
    finally:
        for a in agents:
            a.close()


def test_a_node_that_comes_back_is_admitted_at_the_next_round(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """2 nodes; the node that is not rank 0 is killed after a commit; once the other
    trains again (alone), the node is started again: it waits for the next round,
    the other makes room for it (a membership change, not a failure), and the job
    finishes on 2 nodes, every record exactly once."""
    n, first_part = 240, 160
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    spec = cf.create(url, "el", partitions=P)
    cf.fill(url, spec, first_part, finish=False)
    agents = _start(url, store, "rejoin", ["a", "b"], tmp_path, n)
    back: list[Agent] = []
    try:
        wait_for(agents, "COMMITTED")
        first = rank0_agent(agents)
        (victim,) = (a for a in agents if a is not first)
        victim.kill()
        rest = [first]
        wait_for(rest, "READY", count=2)
        back = _start(url, store, "rejoin", [f"{victim.name}-again"], tmp_path, n)
        # Admitted: its worker restored and trains (the others restarted with it).
        wait_for(back, "READY")
        cf.fill(url, spec, n, start=first_part)
        _finish(rest + back)
        world, counts = _world(store, n)
        assert world == 2
        assert_each_once(counts)  # type: ignore[arg-type]
    finally:
        for a in agents + back:
            a.close()


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(3))
def test_random_node_kills_and_returns_train_every_record_once(
        redis_server: RedisServer, tmp_path: Path, seed: int) -> None:
    """Randomized: 3 nodes; four times, a random node (rank 0 or not) is killed
    after a random number of commits and, with probability 1/2, started again once
    the others train; the dataset is finished at the end: every record exactly once."""
    rng = random.Random(seed)
    n, first_part = 960, 720
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    spec = cf.create(url, "el", partitions=P)
    cf.fill(url, spec, first_part, finish=False)
    live = _start(url, store, f"chaos-{seed}", ["n0", "n1", "n2"], tmp_path, n)
    every = list(live)
    try:
        for round_ in range(4):
            commits = sum(len(a.seen("COMMITTED")) for a in live)
            wait_for(live, "COMMITTED", count=commits + rng.randint(1, 2))
            if len(live) == 1:
                break
            victim = rng.choice(live)
            victim.kill()
            live.remove(victim)
            readies = sum(len(a.seen("READY")) for a in live)
            wait_for(live, "READY", count=readies + len(live))
            if rng.random() < 0.5:
                (again,) = _start(url, store, f"chaos-{seed}", [f"r{round_}"], tmp_path, n)
                every.append(again)
                wait_for([again], "READY")
                live.append(again)
        cf.fill(url, spec, n, start=first_part)
        _finish(live, timeout_s=300)
        _, counts = _world(store, n)
        assert_each_once(counts)  # type: ignore[arg-type]
    finally:
        for a in every:
            a.close()
