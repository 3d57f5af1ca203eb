"""Warm worker starts (issue #24): ``torchrun -m trainguard.elastic.warm`` forks each
worker from its node's zygote instead of starting a fresh Python.

- a 2-node elastic job through the wrapper, a worker killed with kill -9: the group
  restarts, every worker (the restarted ones too) is a fork of its node's zygote with
  torch imported before the script's first line, the incident's phases are none
  negative, and the final checkpoint's ledger has every record trained once;
- a node killed (agent and workers, kill -9): its zygote and the worker it forked are
  gone soon after, the other node finishes alone, every record once;
- two local workers of one agent (``--nproc-per-node=2``) start one zygote (the lock)
  and are both its forks;
- signals: SIGTERM to the wrapper runs the child's handler; SIGKILL of the wrapper
  leaves no child alive (a SIGSTOPped one too); the child's exit code and death
  signal are the wrapper's;
- the child's random generators: torch's and numpy's are the zygote's, Python's reseeded;
- ``$TRAINGUARD_WARM=0`` runs the script in the wrapper's process, with the line why;
  the wrapper imports no torch.

The wrapper's agent is its parent: the torchrun agents in the job tests, this pytest
process in the others (one zygote for the module, started by the first test).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import _client_fill as cf
from tests._client_ledger import assert_each_once, final_counts
from tests._elastic_agents import Agent, agent_command, read_incidents, wait_for
from tests.servers import RedisServer
from trainguard.core.process import pid_alive, wait_until

ROOT = Path(__file__).resolve().parents[1]
P = 4


def _zygotes(folder: str) -> dict[int, int]:
    """The live zygotes serving from ``folder``: {agent pid: zygote pid} (from /proc;
    a forked worker has its zygote's command line too, and the zygote as its parent)."""
    found: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if b"trainguard.elastic._zygote" in argv and state != "Z":
            at = argv.index(b"trainguard.elastic._zygote")
            if os.path.dirname(argv[at + 1].decode()) == folder:
                found[int(entry)] = (int(argv[at + 2]), int(ppid))
    return {agent: pid for pid, (agent, ppid) in found.items() if ppid not in found}


@pytest.fixture
def warm_dir() -> Iterator[str]:
    """A short runtime folder (a socket path has at most 107 bytes); its zygotes are
    stopped afterwards."""
    folder = tempfile.mkdtemp(prefix="tgw-", dir="/tmp")
    yield folder
    for pid in _zygotes(folder).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def own_zygote() -> Iterator[dict[str, str]]:
    """The environment of wrappers started by this process (their agent): one runtime
    folder for the module, so its zygote imports torch once for every test."""
    folder = tempfile.mkdtemp(prefix="tgw-", dir="/tmp")
    yield {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_WARM_DIR": folder,
           "OMP_NUM_THREADS": "1"}
    for pid in _zygotes(folder).values():
        os.kill(pid, signal.SIGTERM)
        assert wait_until(lambda p=pid: not pid_alive(p) or _zombie(p), 30), "zygote lives on"
    shutil.rmtree(folder, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _gone(pid: int) -> bool:
    return not pid_alive(pid) or _zombie(pid)


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(body)
    return str(path)


def _wrapper(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "trainguard.elastic.warm", *argv],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


SAYS = """import os, signal, sys, time
print("PID", os.getpid(), "PPID", os.getppid(), "TORCH", int("torch" in sys.modules),
      flush=True)
"""


def test_sigterm_reaches_the_child_and_its_exit_code_is_the_wrappers(
        own_zygote: dict[str, str], tmp_path: Path) -> None:
    """SIGTERM to the wrapper: the child's handler runs (prints, exits 7); the wrapper
    exits 7. The child is a fork of the zygote (its parent is not the wrapper), torch
    imported before its first line; its output came through the wrapper's pipe."""
    script = _script(tmp_path, SAYS + """
def on_term(sig, frame):
    print("TERM", sig, flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, on_term)
time.sleep(120)
""")
    w = _wrapper(own_zygote, script)
    assert w.stdout is not None
    words = w.stdout.readline().split()
    assert words[0] == "PID", (words, w.stderr.read() if w.stderr else "")
    child, parent = int(words[1]), int(words[3])
    assert parent != w.pid and words[5] == "1"
    assert parent in _zygotes(own_zygote["TRAINGUARD_WARM_DIR"]).values()
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 7
    assert w.stdout.read().split() == ["TERM", str(int(signal.SIGTERM))]
    assert wait_until(lambda: _gone(child), 10)


@pytest.mark.parametrize("code", [0, 3, -signal.SIGKILL, -signal.SIGUSR1])
def test_the_childs_exit_code_and_death_signal_are_the_wrappers(
        own_zygote: dict[str, str], tmp_path: Path, code: int) -> None:
    """A child that exits with ``code`` (or kills itself with signal ``-code``): the
    wrapper's exit status is the same (subprocess's negative code: killed by it)."""
    ending = f"sys.exit({code})" if code >= 0 else f"os.kill(os.getpid(), {-code})"
    w = _wrapper(own_zygote, _script(tmp_path, SAYS + ending + "\n"))
    assert w.wait(120) == code, w.stderr.read() if w.stderr else ""


@pytest.mark.parametrize("stopped", [False, True])
def test_sigkill_of_the_wrapper_leaves_no_child_alive(
        own_zygote: dict[str, str], tmp_path: Path, stopped: bool) -> None:
    """kill -9 of the wrapper (torchrun's after its grace period): the zygote sees its
    connection close and SIGKILLs the child, a SIGSTOPped child too; the wrapper's
    status is -9."""
    w = _wrapper(own_zygote, _script(tmp_path, SAYS + "time.sleep(120)\n"))
    assert w.stdout is not None
    child = int(w.stdout.readline().split()[1])
    if stopped:
        os.kill(child, signal.SIGSTOP)
    w.kill()
    assert w.wait(30) == -signal.SIGKILL
    assert wait_until(lambda: _gone(child), 10), f"child {child} outlived its wrapper"


def test_a_forked_child_has_the_zygotes_torch_and_numpy_generators_and_pythons_fresh(
        own_zygote: dict[str, str], tmp_path: Path) -> None:
    """What a fork carries over: torch's default generator (whose seed a fresh process
    draws at random) and numpy's global one (seeded from the OS when numpy.random is
    first imported: in the zygote, by torch._dynamo) are the zygote's, the same in
    every child, where two cold processes differ; Python's ``random`` is reseeded at
    each fork (its own at-fork hook). A restored run is deterministic either way,
    because a trainguard restore sets all three (trainer_client/_rng.py); a fresh run
    that wants the cold behaviour seeds them itself."""
    script = _script(tmp_path, SAYS + """import random, numpy, torch
print(torch.initial_seed(), torch.rand(1).item(), numpy.random.rand(), random.random())
""")
    colds = [subprocess.run([sys.executable, script], env=own_zygote, capture_output=True,
                            text=True, check=True).stdout.splitlines()[1].split()
             for _ in range(2)]
    warms = []
    for _ in range(2):
        w = _wrapper(own_zygote, script)
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        lines = out.splitlines()
        assert lines[0].split()[5] == "1", lines  # forked: torch was there already
        warms.append(lines[1].split())
    assert warms[0][:3] == warms[1][:3]  # torch's seed and draw, numpy's: the zygote's
    assert warms[0][3] != warms[1][3]  # Python's random: reseeded
    assert all(colds[0][k] != colds[1][k] for k in range(4))
    assert warms[0][:3] != colds[0][:3]


def test_warm_off_runs_the_script_in_the_wrappers_process(
        own_zygote: dict[str, str], tmp_path: Path) -> None:
    """``$TRAINGUARD_WARM=0``: the script runs in the wrapper's own process (its pid),
    with the wrapper's arguments, torch not imported by the wrapper, and one line on
    stderr saying why; ``-m`` runs a module the same way."""
    env = {**own_zygote, "TRAINGUARD_WARM": "0"}
    script = _script(tmp_path, SAYS + "print('ARGV', *sys.argv[1:]); sys.exit(5)\n")
    w = _wrapper(env, script, "--x", "1")
    out, err = w.communicate(timeout=60)
    assert w.returncode == 5
    lines = out.splitlines()
    assert lines[0].split() == ["PID", str(w.pid), "PPID", str(os.getpid()), "TORCH", "0"]
    assert lines[1] == "ARGV --x 1"
    assert err.splitlines() == [
        "trainguard.elastic.warm: running cold, in this process: $TRAINGUARD_WARM=0"]
    w = _wrapper(env, "--", "-m", "json.tool", "--help")
    out, _ = w.communicate(timeout=60)
    assert w.returncode == 0 and "json.tool" in out


def test_a_preload_that_starts_a_thread_is_refused_and_the_worker_runs_cold(
        tmp_path: Path, warm_dir: str) -> None:
    """A module in ``$TRAINGUARD_WARM_PRELOAD`` that starts a thread at import: the
    zygote refuses to serve (a fork would copy one thread of two) and exits saying
    so; the wrapper runs the script in its own process, its one stderr line naming
    the threads and what to do."""
    (tmp_path / "threaded_preload.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
           "TRAINGUARD_WARM_DIR": warm_dir, "TRAINGUARD_WARM_PRELOAD": "threaded_preload"}
    w = _wrapper(env, _script(tmp_path, SAYS))
    out, err = w.communicate(timeout=300)
    assert w.returncode == 0, err
    assert out.split()[:2] == ["PID", str(w.pid)]  # ran in the wrapper's process
    (line,) = err.splitlines()
    assert line.startswith("trainguard.elastic.warm: running cold, in this process: no "
                           "usable zygote (the zygote exited 1 before serving"), line
    assert "runs 2 threads" in line and "expected exactly 1" in line, line
    assert "take it out of $TRAINGUARD_WARM_PRELOAD" in line, line
    assert not _zygotes(warm_dir)


def test_a_script_that_is_not_there_is_a_clear_error(own_zygote: dict[str, str]) -> None:
    """A missing script: exit 1 with what was expected, before any zygote is asked."""
    w = _wrapper(own_zygote, "no/such/train.py")
    _, err = w.communicate(timeout=60)
    assert w.returncode == 1
    assert "no training script at 'no/such/train.py'" in err and "expected a file" in err


def _job_args(url: str, store: str, n: int) -> list[str]:
    return ["--redis", url, "--dataset", "el", "--run", "exp", "--store", store,
            "--n", str(n), "--batch-size", "4", "--ckpt-every", "2", "--sleep-ms", "100"]


def _agents(url: str, store: str, run_id: str, n: int, tmp: Path, folder: str
            ) -> list[Agent]:
    command = agent_command("trainguard", url, run_id, "1:2", _job_args(url, store, n),
                            entry=("-m", "tests._warm_job"), warm=True)
    return [Agent(name, command, tmp / f"agent-{name}.log",
                  env={"TRAINGUARD_WARM_DIR": folder}) for name in ("a", "b")]


def _starts(agent: Agent) -> list[tuple[int, int, int]]:
    """Each worker start of ``agent``: (torch imported first, pid, parent pid)."""
    return [(int(w[2]), int(w[4]), int(w[6])) for w in (x.split() for _, x in agent.seen(": WARM "))]


def test_a_killed_worker_restarts_as_a_fork_of_the_zygote_and_trains_each_record_once(
        redis_server: RedisServer, tmp_path: Path, warm_dir: str) -> None:
    """2 nodes through the wrapper; after a commit, one worker is killed with kill -9.
    Both agents restart their workers; every start (the first and the restarted) is a
    fork of its node's zygote, torch imported before the script's first line. The
    incident's recovery phases are none negative (the fork ends spawn and imports).
    The final checkpoint's ledger: every record trained exactly once."""
    n = 160
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "el", partitions=P), n)
    agents = _agents(url, store, "warm-kill", n, tmp_path, warm_dir)
    try:
        wait_for(agents, "COMMITTED", timeout_s=240)
        victim = next(a for a in agents if a.seen("1: WARM"))
        os.kill(_starts(victim)[-1][1], signal.SIGKILL)
        for a in agents:
            assert a.wait(240) == 0, a.tail(60)
        zygotes = {}
        for a in agents:
            starts = _starts(a)
            assert len(starts) == 2, starts  # the first world, and one restart
            assert {s[0] for s in starts} == {1}
            (parent,) = {s[2] for s in starts}  # one zygote forked both
            assert parent != a.proc.pid
            zygotes[a.name] = parent
        assert len(set(zygotes.values())) == 2  # one zygote per node
        counts, _ = final_counts(store, n)
        assert_each_once(counts)
        (incident,) = read_incidents(url, "el", "exp")
        phases = incident["recovery"]["phases_s"]
        assert phases["spawn"] is not None and phases["imports"] is not None, phases
        assert all(v is None or v >= 0 for v in phases.values()), phases
        # The agents exited: their zygotes follow.
        assert wait_until(lambda: not _zygotes(warm_dir), 30), _zygotes(warm_dir)
    finally:
        for a in agents:
            a.close()


def test_a_killed_node_leaves_no_process_behind_and_the_other_finishes_alone(
        redis_server: RedisServer, tmp_path: Path, warm_dir: str) -> None:
    """2 nodes through the wrapper; after a commit, the node whose worker is not rank 0
    is killed (agent and wrapper, kill -9; its worker is the zygote's child, not the
    agent's). The zygote SIGKILLs its worker and exits: nothing of that node runs
    soon after. The other node restarts warm, alone, and finishes: every record once."""
    n = 160
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "el", partitions=P), n)
    agents = _agents(url, store, "warm-node", n, tmp_path, warm_dir)
    try:
        wait_for(agents, "COMMITTED", timeout_s=240)
        victim = next(a for a in agents if a.seen("1: WARM"))
        (rest,) = (a for a in agents if a is not victim)
        zygote = _zygotes(warm_dir)[victim.proc.pid]
        worker = _starts(victim)[-1][1]
        victim.kill()
        assert wait_until(lambda: _gone(worker) and _gone(zygote), 30), (worker, zygote)
        assert rest.wait(240) == 0, rest.tail(60)
        starts = _starts(rest)
        assert len(starts) == 2 and {s[0] for s in starts} == {1}, starts
        counts, extra = final_counts(store, n)
        assert int(extra["trainguard"]["world_size"]) == 1
        assert_each_once(counts)
    finally:
        for a in agents:
            a.close()


def test_the_local_workers_of_one_agent_share_one_zygote(
        redis_server: RedisServer, tmp_path: Path, warm_dir: str) -> None:
    """``torchrun --standalone --nproc-per-node=2`` through the wrapper: both local
    workers start at once, one starts the zygote under the agent's lock and the other
    waits for it, so both are forks of the same zygote (torch imported before their
    first line); the job trains every record once."""
    n = 64
    url, store = redis_server.url, f"file://{tmp_path}/ckpt"
    cf.fill(url, cf.create(url, "el", partitions=P), n)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1",
           "-m", "trainguard.elastic.warm", "--", "-m", "tests._warm_job",
           *_job_args(url, store, n)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TRAINGUARD_WARM_DIR": warm_dir}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    starts = sorted(line.split() for line in proc.stdout.splitlines() if ": WARM " in line)
    assert [s[0] for s in starts] == ["0:", "1:"], proc.stdout[-2000:]
    assert {s[2] for s in starts} == {"1"}
    assert len({s[6] for s in starts}) == 1  # one parent: the agent's zygote
    counts, _ = final_counts(store, n)
    assert_each_once(counts)


AGENT = """import sys
from trainguard.elastic import warm
print("WARMED", warm.prewarm(sys.argv[1:]), flush=True)
sys.stdin.readline()  # live until the test closes our stdin: the zygote's agent
"""


@pytest.mark.parametrize("argv, env, warmed", [
    (["--nnodes=1:3", "-m", "trainguard.elastic.warm", "--", "train.py"], {}, True),
    (["--nnodes=1:3", "train.py"], {}, False),
    (["-m", "trainguard.elastic.warm", "train.py"], {"TRAINGUARD_WARM": "0"}, False),
])
def test_an_agent_whose_workers_start_warm_has_its_zygote_serving_before_its_first_join(
        warm_dir: str, tmp_path: Path, argv: list[str], env: dict[str, str],
        warmed: bool) -> None:
    """What the rendezvous handler does before an agent's first join: its zygote is
    serving when ``prewarm`` returns (a rejoining node imports torch before it asks in,
    while the others train), only for an agent whose command line starts its workers
    through ``trainguard.elastic.warm``, and not when warm starts are off; the zygote
    ends with its agent."""
    agent = subprocess.Popen([sys.executable, _script(tmp_path, AGENT), *argv], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "TRAINGUARD_WARM_DIR": warm_dir, **env},
                             text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert agent.stdout is not None and agent.stdin is not None
    try:
        assert agent.stdout.readline().split() == ["WARMED", str(warmed)]
        zygotes = _zygotes(warm_dir)
        assert list(zygotes) == ([agent.pid] if warmed else [])
        sock = socket.socket(socket.AF_UNIX)
        serving = sock.connect_ex(os.path.join(warm_dir, f"agent-{agent.pid}.sock")) == 0
        sock.close()
        assert serving is warmed
    finally:
        agent.stdin.close()
        agent.wait(60)
    if warmed:
        assert wait_until(lambda: _gone(zygotes[agent.pid]), 60), "the zygote outlived its agent"
