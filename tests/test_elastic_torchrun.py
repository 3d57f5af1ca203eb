"""Elastic jobs under ``torchrun --rdzv-backend=trainguard``: each node a real torchrun
agent (``--nproc-per-node=1``, gloo on CPU) training the ledger job with the
TrainingSession and the streaming dataset against a real redis-server; the verdict
is the per-record ledger of the final checkpoint.

- The first node (rank 0 of the first round: the node c10d's rendezvous would be
  hosted on, and whose worker would serve the workers' TCPStore) is killed with
  kill -9 of its agent's process group: the others re-form, restore and finish,
  every record trained exactly once; the workers' process-group store was in the
  rendezvous' Redis, one prefix per round.
- A node killed and started again mid-run is admitted at the next round, the job
  finishes with it (world 3 again), every record exactly once.
- A bug at one step in every attempt: the restart-loop breaker stops the job (exit
  87) and every agent exits at once, no worker started after that decision.

A kill is noticed by the survivors' workers at their next collective, so kills land
while the job trains (after its first commit, with most of the data still to train);
where the test then waits for something slower (a node starting again), the dataset
is finished only after it happened, so the job cannot end first."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests import _client_fill as cf
from tests._client_ledger import assert_each_once, final_counts
from tests._elastic_agents import (
    Agent,
    agent_command,
    rank0_agent,
    read_incidents,
    wait_for,
    worker_store_rounds,
)
from tests.servers import RedisServer
from trainer_client import redis_client
from trainguard.core import incidents as inc
from trainguard.elastic import keys

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
    counted exactly once. The workers' process group kept its store in the fixture's
    Redis, not in a TCPStore of the killed node's worker: while the first world trains
    its keys are there under one round's prefix, and the re-formed world's under a
    later round's."""
    n = 240  # 20 steps a rank on 3 nodes; the kill lands after 2 to 4
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "el", partitions=P), n)
    agents = _start(url, store, "kill-first", ["a", "b", "c"], tmp_path, n)
    try:
        wait_for(agents, "COMMITTED")
        (first_round,) = worker_store_rounds(url, "kill-first")
        first = rank0_agent(agents)
        first.kill()
        rest = [a for a in agents if a is not first]
        _finish(rest)
        rounds = worker_store_rounds(url, "kill-first")
        assert first_round in rounds and len(rounds) == 2, rounds
        (later,) = (r for r in rounds if r != first_round)
        assert later[0] > first_round[0] and rounds[later] > 0, rounds
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


def test_the_restart_loop_breaker_stops_every_agent_after_one_decision(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """2 nodes train the heal job, which raises at step 7 in every attempt (a bug at
    step N); checkpoints every 5 steps; the breaker tries one remedy
    (``max_tries=1``), so attempt 1 crashes, attempt 2 restores step 5 and crashes,
    attempt 3 stops the job with exit 87. torchrun would restart the workers 5 times
    (``--max-restarts=5``); instead every agent exits non-zero with the stop's reason
    once its worker exited 87: the run holds exactly 3 attempts (no worker started
    after the breaker's decision), the last incident is the breaker's, telling the
    agents to stop, and the newest checkpoint counts each record of its 5 steps of
    2 ranks exactly once and no other."""
    batch, n, nodes = 4, 80, 2
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "heal", partitions=nodes), n)
    command = agent_command(
        "trainguard", url, "loop", "1:2",
        ["--redis", url, "--store", store, "--records", str(n), "--batch-size", str(batch),
         "--crash-at", "7", "--sleep-ms", "0"],
        max_restarts=5, entry=("-m", "tests._heal_job"))
    env = {"TRAINGUARD_LOOP_BREAKER": "max_tries=1"}
    agents = [Agent(name, command, tmp_path / f"agent-{name}.log", env=env)
              for name in ("a", "b")]
    try:
        for a in agents:
            code = a.wait(300)
            assert code != 0, f"agent {a.name} exited 0:\n{a.tail(60)}"
            assert a.seen("exitcode: 87") and a.seen("JobStoppedError"), a.tail(60)
            assert a.seen("came back 2 times in a row"), a.tail(60)  # the stop's reason
        r = redis_client.client(url)
        try:
            attempts = [inc.loads(v) for k, v in
                        r.hgetall(inc.attempts_key("heal", "job")).items() if k != b"seq"]
            stop = json.loads(r.get(keys.stop_key("loop")) or "null")
        finally:
            r.close()
        assert sorted((d["attempt"], d["outcome"]) for d in attempts) == [
            (1, "failed"), (2, "failed"), (3, "stopped")]
        assert stop is not None and stop["exit_code"] == 87, stop
        last = read_incidents(url, "heal", "job")[-1]
        assert last["cause"] == "restart_loop" and last["job_stop"] is True, last
        assert last["tried"] == ["restore"], last
        counts, _ = final_counts(store, n)
        # No record twice, and every record of the newest checkpoint's 5 steps once.
        assert int(counts.max()) == 1 and int(counts.sum()) == nodes * batch * 5, counts
    finally:
        for a in agents:
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
