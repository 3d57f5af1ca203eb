"""Tiered checkpoints: last K on local disk, every checkpoint uploaded to S3 (a real
moto server over HTTP) in the background; restore falls back to the remote copy."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs
import torch

from checkpoint_store import CheckpointStore, TierState
from tests._ckpt_helpers import empty_state, same_bits, state_for
from tests._tier_helpers import fast_options, open_tiered
from tests.servers import MotoServer

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_tier_worker.py"


def _assert_state(target: dict[str, object], step: int, width: int = 8) -> None:
    expected = state_for(step, width=width)
    assert same_bits(target["w"], expected["w"])  # type: ignore[arg-type]
    assert same_bits(target["b"], expected["b"])  # type: ignore[arg-type]
    assert target["step"] == step and target["name"] == f"run-{step}"


def _local_steps(root: Path) -> list[int]:
    return sorted(m.step for m in CheckpointStore(root).list())


def _remote_store(url: str, options: dict) -> CheckpointStore:
    return CheckpointStore(url, storage_options=fast_options(options))


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_uploads_every_checkpoint_and_keeps_last_k_locally(tmp_path, moto_server, s3_bucket):
    """Five saves with keep_last=2: all five become remote-committed (manifest, LATEST
    naming the newest, no in-flight marker left), local disk keeps exactly the newest
    two, list() shows all five, and an evicted one loads bit-exact from the remote."""
    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    store = open_tiered(str(tmp_path / "local"), remote_url, options)
    for step in range(1, 6):
        store.save(state_for(step), step=step, blocking=False).wait()
    assert store.wait_uploads(60.0)
    remote = _remote_store(remote_url, options)
    assert [m.step for m in remote.list()] == [1, 2, 3, 4, 5]
    latest = json.loads(remote._backend.read("LATEST"))
    assert latest["step"] == 5 and latest["manifest"] == remote.list()[-1].name
    assert remote._backend.listdir("inflight") == []
    assert _local_steps(tmp_path / "local") == [4, 5]
    assert [m.step for m in store.list()] == [1, 2, 3, 4, 5]
    status = {t.step: t for t in store.tiers()}
    assert all(t.state is TierState.REMOTE and t.remote for t in status.values())
    assert [s for s, t in status.items() if t.local] == [4, 5]
    assert status[1].labels() == ["committed", "remote"]
    target = empty_state()
    manifest = store.load(target, step=1)
    assert manifest is not None and manifest.step == 1
    _assert_state(target, 1)
    assert store.close()


def _process_state(pid: int) -> str:
    # /proc/<pid>/stat: "pid (comm) S ..."; the comm may hold spaces, the state follows ")".
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_outage_in_the_middle_of_an_upload(tmp_path):
    """A worker process is frozen after uploading the first data file of step 1; S3
    goes down; the worker resumes and saves steps 2..5: each commits locally (saving
    never waits on S3), uploads fail, the breaker opens, no checkpoint is remote, and
    local retention keeps all five (keep_last=2). S3 comes back on the same port
    (empty: moto keeps data in memory): every checkpoint is uploaded, step 1 included
    and bit-exact, the breaker closes, and only then local disk keeps two."""
    server = MotoServer().start()
    worker = None
    try:
        bucket = server.create_bucket("tier-mid-upload")
        remote_url = f"s3://{bucket}/run"
        options = server.storage_options()
        local, go_file = tmp_path / "local", tmp_path / "go"
        env = {**os.environ, "PYTHONPATH": str(REPO),
               "TRAINGUARD_CKPT_STOP_AT": "upload-mid-data"}
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), "outage", str(local), remote_url,
             json.dumps(options), str(go_file)],
            env=env, stdout=subprocess.PIPE, text=True)
        _wait_for(lambda: _process_state(worker.pid) == "T", "the worker to freeze mid-upload",
                  timeout_s=60.0)
        fs = s3fs.S3FileSystem(**options)
        assert len(fs.find(f"{bucket}/run/data")) == 1  # one data file, no manifest yet
        assert not fs.exists(f"{bucket}/run/manifests")
        server.stop()
        go_file.touch()
        os.kill(worker.pid, signal.SIGCONT)

        saved = worker.stdout.readline().split()
        assert saved[:2] == ["SAVED", "[1,2,3,4,5]"]
        assert "remote" not in json.loads(saved[2]) and saved[3] in ("open", "half_open")
        server = MotoServer(port=server.port).start()
        server.create_bucket(bucket)  # moto keeps data in memory: recreate the bucket
        uploaded = worker.stdout.readline().split()
        assert uploaded == ["UPLOADED", "true", "[4,5]", json.dumps(["remote"] * 5,
                                                                    separators=(",", ":")),
                            "closed"]
        assert worker.wait(60) == 0
        remote = _remote_store(remote_url, options)
        assert [m.step for m in remote.list()] == [1, 2, 3, 4, 5]
        target = empty_state(width=64)
        assert remote.load(target, step=1, strict=True).step == 1
        _assert_state(target, 1, width=64)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop()


def test_wiped_local_disk_restores_from_remote_bit_exact(tmp_path, moto_server, s3_bucket,
                                                          caplog):
    """After the local directory is deleted, a new tiered store on the same roots
    lists the remote checkpoints and restores the newest one bit-exact (logged as a
    remote load); the next save goes on locally and is uploaded too."""
    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"
    with open_tiered(str(local), remote_url, options) as store:
        for step in range(1, 4):
            store.save(state_for(step), step=step)
        assert store.close(wait_upload=60.0)
    shutil.rmtree(local)

    store = open_tiered(str(local), remote_url, options)
    assert [m.step for m in store.list()] == [1, 2, 3]
    target = empty_state()
    with caplog.at_level(logging.WARNING, logger="checkpoint_store.tiered"):
        manifest = store.load(target)
    assert manifest is not None and manifest.step == 3
    _assert_state(target, 3)
    assert "from the remote tier" in caplog.text
    assert store.verify(3).step == 3
    store.save(state_for(4), step=4)
    assert store.close(wait_upload=60.0)
    assert [m.step for m in _remote_store(remote_url, options).list()] == [1, 2, 3, 4]


def _flip_byte_in_chunk(root: Path, uid: str) -> Path:
    chunks = sorted(p for p in (root / "data" / uid).rglob("*")
                    if p.is_file() and p.name != "zarr.json")
    assert chunks, f"no chunk files under data/{uid}"
    raw = bytearray(chunks[0].read_bytes())
    raw[0] ^= 0xFF
    chunks[0].write_bytes(bytes(raw))
    return chunks[0]


def test_damaged_local_chunk_falls_back_to_remote_copy(tmp_path, moto_server, s3_bucket,
                                                       caplog):
    """A flipped byte in a local chunk of the newest checkpoint: a plain local load
    would fall back to the older step 1, the tiered load instead loads step 2 from
    the remote copy, bit-exact, and logs the fallback."""
    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"
    store = open_tiered(str(local), remote_url, options)
    store.save(state_for(1), step=1)
    newest = store.save(state_for(2), step=2).wait()
    assert store.wait_uploads(60.0)
    _flip_byte_in_chunk(local, newest.uid)

    plain = empty_state()
    assert CheckpointStore(local).load(plain).step == 1  # local alone loses step 2

    target = empty_state()
    with caplog.at_level(logging.WARNING, logger="checkpoint_store.tiered"):
        manifest = store.load(target)
    assert manifest is not None and manifest.name == newest.name
    _assert_state(target, 2)
    assert "falling back to the remote copy" in caplog.text
    store.close()


@pytest.mark.parametrize("phase", ["upload-mid-data", "upload-after-manifest"])
def test_kill_9_mid_upload_is_finished_by_next_store(tmp_path, moto_server, s3_bucket, phase):
    """A process SIGKILLs itself in the middle of uploading step 1 (after the first
    data file / after the manifest): before the manifest the remote
    root has no checkpoint, after it no LATEST yet; the local checkpoint is intact.
    The next tiered store on the same roots finishes the job (upload, LATEST, marker
    removed), and step 1 then loads bit-exact from the remote root alone."""
    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_CKPT_CRASH_AT": phase}
    proc = subprocess.run([sys.executable, str(WORKER), "crash", str(local), remote_url,
                           json.dumps(options)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    fs = s3fs.S3FileSystem(**options)
    manifests = fs.find(f"{s3_bucket}/run/manifests")
    assert len(manifests) == (1 if phase == "upload-after-manifest" else 0)
    assert not fs.exists(f"{s3_bucket}/run/LATEST")
    assert fs.find(f"{s3_bucket}/run/data"), "the crash came after some data was uploaded"
    assert len(fs.ls(f"{s3_bucket}/run/inflight")) == 1  # the dead upload's marker
    assert _local_steps(local) == [1]

    store = open_tiered(str(local), remote_url, options)
    assert store.wait_uploads(60.0)
    assert store.tier_status(1).state is TierState.REMOTE
    store.close()
    remote = _remote_store(remote_url, options)
    assert remote._backend.listdir("inflight") == []
    assert json.loads(remote._backend.read("LATEST"))["step"] == 1
    target = empty_state(width=64)
    manifest = remote.load(target, strict=True)
    assert manifest is not None and manifest.step == 1
    _assert_state(target, 1, width=64)


def _train(redis_url: str, store, n: int, *, stop_after: int | None) -> tuple[int, int, torch.Tensor]:
    """Train on the ``tok`` dataset, adding 1 to each consumed record's count and
    checkpointing every 5 steps; ``stop_after`` abandons the run at that step (the
    steps since the last checkpoint are lost with the process state, as in a crash).
    Returns (restored step, last step, counts)."""
    from torch.utils.data import DataLoader

    from trainer_client import TrainingSession

    state = {"counts": torch.zeros(n)}
    session = TrainingSession(redis_url, dataset="tok", run="exp", store=store, block_ms=200)
    start = session.restore(state)
    loader = DataLoader(session.dataset(batch_size=8), batch_size=None, num_workers=0)
    step = start
    for batch in session.batches(loader):
        idx = batch.data[:, 0].long()
        state["counts"].index_add_(0, idx, torch.ones(len(idx)))
        step += 1
        if step % 5 == 0:
            session.checkpoint(state, step)
        if step == stop_after:
            break
    if stop_after is None:
        session.checkpoint(state, step, blocking=True)
    session.close()
    return start, step, state["counts"]


def test_ledger_exactly_once_after_local_disk_wiped(tmp_path, redis_server, moto_server,
                                                    s3_bucket):
    """A TrainingSession on a tiered store trains 23 steps (checkpoints at 5..20,
    uploaded; local disk keeps 2) and is abandoned; the local directory is wiped; a
    new session on a new tiered store restores step 20 from S3 and finishes the finite
    dataset: every record is counted exactly once, and Redis' committed offsets are
    each partition's end."""
    import redis

    from tests import _client_fill as cf
    from trainguard.core import streams

    n, partitions = 400, 4
    spec = cf.create(redis_server.url, "tok", partitions=partitions)
    cf.fill(redis_server.url, spec, n)
    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"

    store = open_tiered(str(local), remote_url, options)
    start, stopped, _ = _train(redis_server.url, store, n, stop_after=23)
    assert (start, stopped) == (0, 23)
    assert store.close(wait_upload=60.0)
    assert _local_steps(local) == [15, 20]
    assert [m.step for m in _remote_store(remote_url, options).list()] == [5, 10, 15, 20]
    shutil.rmtree(local)

    store = open_tiered(str(local), remote_url, options)
    start, last, counts = _train(redis_server.url, store, n, stop_after=None)
    # Deterministic (the default): batches span partitions, so one worker's 400 records
    # make 50 full batches of 8 (only a worker's last batch of an epoch may be short).
    assert start == 20 and last == -(-n // 8)
    assert torch.equal(counts, torch.ones(n)), (
        f"{int((counts == 0).sum())} records lost, {int((counts > 1).sum())} counted twice")
    assert store.close(wait_upload=60.0)

    reloaded = {"counts": torch.zeros(n)}
    fresh = open_tiered(str(tmp_path / "elsewhere"), remote_url, options)
    assert fresh.load(reloaded).step == last
    fresh.close()
    assert torch.equal(reloaded["counts"], torch.ones(n))
    client = redis.Redis.from_url(redis_server.url)
    ends = {p: streams.make_id(0, len(range(p, n, partitions)) - 1) for p in range(partitions)}
    assert streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", "exp"))) == ends
    client.close()


def test_local_retention_keeps_unuploaded_and_newest_remote(tmp_path, moto_server, s3_bucket,
                                                            monkeypatch):
    """keep_last=1: step 1 is uploaded; then every upload fails (an injected I/O error
    before the data) while steps 2 and 3 are saved. Retention (run by gc) keeps step
    1, the newest remote-committed checkpoint, and steps 2 and 3, not yet remote.
    Once uploads succeed again, local disk holds step 3 only and S3 all three."""
    from checkpoint_store._faults import FAIL_ENV

    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"
    store = open_tiered(str(local), remote_url, options, keep_last=1)
    store.save(state_for(1), step=1)
    assert store.wait_uploads(60.0)
    monkeypatch.setenv(FAIL_ENV, "upload-before-data")
    store.save(state_for(2), step=2)
    store.save(state_for(3), step=3)
    _wait_for(lambda: store.upload_failures > 0, "a failed upload attempt")
    store.gc()
    assert _local_steps(local) == [1, 2, 3]
    states = [t.state for t in store.tiers()]
    assert states[0] is TierState.REMOTE and states[2] is TierState.LOCAL
    monkeypatch.delenv(FAIL_ENV)
    assert store.wait_uploads(60.0)
    assert _local_steps(local) == [3]
    assert [m.step for m in _remote_store(remote_url, options).list()] == [1, 2, 3]
    store.close()


def test_pins_remote_retention_and_delete_span_both_tiers(tmp_path, moto_server, s3_bucket):
    """keep_last=1, remote_keep_last=2, step 1 pinned before its upload: the upload
    copies the pin, so both tiers keep step 1 besides their newest 1 / 2 checkpoints.
    A pinned step cannot be deleted; unpinned, delete removes it from both tiers."""
    from checkpoint_store import PinnedCheckpointError

    remote_url = f"s3://{s3_bucket}/run"
    options = moto_server.storage_options()
    local = tmp_path / "local"
    store = open_tiered(str(local), remote_url, options, keep_last=1, remote_keep_last=2)
    store.save(state_for(1), step=1)
    assert store.pin(1).pinned
    for step in (2, 3, 4):
        store.save(state_for(step), step=step)
    assert store.wait_uploads(60.0)
    remote = _remote_store(remote_url, options)
    assert [(m.step, m.pinned) for m in remote.list()] == [(1, True), (3, False), (4, False)]
    assert _local_steps(local) == [1, 4]
    assert store.tier_status(1).labels() == ["committed", "pinned", "remote"]
    assert [m.step for m in store.list()] == [1, 3, 4]
    with pytest.raises(PinnedCheckpointError):
        store.delete(1)
    store.unpin(1)
    assert len(store.delete(1)) == 1
    assert [m.step for m in remote.list()] == [3, 4]
    assert _local_steps(local) == [4]
    assert [m.step for m in store.list()] == [3, 4]
    store.close()


def test_tier_statuses_match_the_admin_status_words():
    """tier_statuses over two manifest listings (as the admin API has them): a
    checkpoint only local is "local_only" (or "uploading" while being copied), one
    with a remote manifest is "remote" whether or not it is still local, pins from
    either tier count, and the order is commit order (uid), not step."""
    from checkpoint_store import Manifest
    from checkpoint_store.tiers import tier_statuses

    def manifest(step: int, uid: str, pinned: bool = False) -> Manifest:
        return Manifest(name=f"{step:012d}-{uid}.json", step=step, uid=uid, created_at=0.0,
                        parent=None, world_size=1, nbytes=0, extra={}, pinned=pinned)

    old = manifest(9, "0000000000000001-aaaaaaaa")  # step 9 committed first (rolled back)
    mid = manifest(5, "0000000000000002-bbbbbbbb")
    new = manifest(6, "0000000000000003-cccccccc")
    up = manifest(7, "0000000000000004-dddddddd")
    rows = tier_statuses([mid, new, up], [old, manifest(5, mid.uid, pinned=True)],
                         uploading=up.name)
    assert [r.step for r in rows] == [9, 5, 6, 7]
    assert [(r.state.value, r.local, r.remote) for r in rows] == [
        ("remote", False, True), ("remote", True, True), ("local", True, False),
        ("uploading", True, False)]
    assert [r.labels() for r in rows] == [
        ["committed", "remote"], ["committed", "pinned", "remote"],
        ["committed", "local_only"], ["committed", "local_only"]]


def _tiered_on_dir(local: Path, remote: Path, **kwargs):
    """A tiered store whose remote tier is a local directory (no S3 needed), with a
    short uploader backoff."""
    from checkpoint_store import TieredCheckpointStore
    from trainguard.core.resilience import RetryPolicy, object_store_breaker

    return TieredCheckpointStore(
        local, str(remote), remote_breaker=object_store_breaker(f"test-tier-dir-{local}"),
        upload_backoff=RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.05,
                                   wait_max_s=0.2, wait_jitter_s=0.0), **kwargs)


def test_refused_upload_does_not_hold_back_newer_ones(tmp_path, monkeypatch):
    """The remote refuses step 1's data for good (a file stands where its data
    directory must go): step 2, saved after it, is still uploaded and becomes
    remote-committed, while step 1 stays local, queued and not remote."""
    from checkpoint_store._faults import FAIL_ENV

    local, remote = tmp_path / "local", tmp_path / "remote"
    monkeypatch.setenv(FAIL_ENV, "upload-before-data")
    store = _tiered_on_dir(local, remote, keep_last=1)
    first = store.save(state_for(1), step=1).wait()
    _wait_for(lambda: store.upload_failures > 0, "a failed upload attempt of step 1")
    (remote / "data").mkdir()
    (remote / "data" / first.uid).write_bytes(b"")  # data/<uid>/... cannot be created
    monkeypatch.delenv(FAIL_ENV)
    store.save(state_for(2), step=2)
    _wait_for(lambda: store.tier_status(2).state is TierState.REMOTE,
              "step 2 to be uploaded past the refused step 1")
    assert store.tier_status(1).state in (TierState.LOCAL, TierState.UPLOADING)  # retried
    assert [m.step for m in CheckpointStore(remote).list()] == [2]
    assert _local_steps(local) == [1, 2]  # step 1 has no remote copy: kept
    assert not store.close()  # step 1's upload is left pending


def test_damaged_local_checkpoint_is_dropped_by_retention(tmp_path, monkeypatch):
    """Step 1's upload fails once (leaving its remote in-flight marker), then its
    local chunk is damaged: the next store never publishes it remotely, removes that
    marker, and once steps 2 and 3 are uploaded, local retention (keep_last=1) drops
    it like any checkpoint beyond retention instead of keeping it forever."""
    from checkpoint_store._faults import FAIL_ENV

    local, remote = tmp_path / "local", tmp_path / "remote"
    monkeypatch.setenv(FAIL_ENV, "upload-before-data")
    store = _tiered_on_dir(local, remote, keep_last=1)
    first = store.save(state_for(1), step=1).wait()
    _wait_for(lambda: store.upload_failures > 0, "a failed upload attempt of step 1")
    assert not store.close()  # step 1 still pending
    assert len(list((remote / "inflight").iterdir())) == 1
    _flip_byte_in_chunk(local, first.uid)
    monkeypatch.delenv(FAIL_ENV)
    store = _tiered_on_dir(local, remote, keep_last=1)
    assert store.wait_uploads(30.0)  # step 1 found damaged: not pending any more
    store.save(state_for(2), step=2)
    store.save(state_for(3), step=3)
    assert store.wait_uploads(30.0)
    assert [m.step for m in CheckpointStore(remote).list()] == [2, 3]
    assert list((remote / "inflight").iterdir()) == []
    assert _local_steps(local) == [3]
    assert store.close()


def test_both_stores_implement_the_shared_api(tmp_path):
    """CheckpointStore, TieredCheckpointStore, RamTierStore, NodeTierStore and
    DcpCheckpointStore have every member of CheckpointStoreAPI, each method with exactly
    the protocol's parameters (names, kinds, defaults; close may add optional ones), so
    each serves as a ``store``; and all the per-rank state objects' wider one."""
    import inspect

    from checkpoint_store import CheckpointStoreAPI, RamTierStore, TieredCheckpointStore
    from checkpoint_store.dcp_store import DcpCheckpointStore
    from checkpoint_store.node_tiers import NodeTierStore

    members = sorted(n for n in vars(CheckpointStoreAPI) if not n.startswith("_"))
    assert members == ["close", "delete", "gc", "latest", "list", "load", "pin", "rank",
                       "save", "unpin", "verify", "world_size"]
    assert CheckpointStoreAPI.__annotations__ == {"url": "str"}

    def params(fn) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    from trainguard.core.checkpoints import RankStateStoreAPI

    ranked = (CheckpointStore, TieredCheckpointStore, RamTierStore, NodeTierStore,
              DcpCheckpointStore)
    for cls in ranked:
        # Stores with per-rank state objects match the wider protocol (save takes
        # rank_state; read_rank_state); the others the base one, without the flag.
        api = RankStateStoreAPI if cls in ranked else CheckpointStoreAPI
        assert getattr(cls, "supports_rank_state", False) is (cls in ranked)
        for name in [*members, *(["read_rank_state"] if cls in ranked else [])]:
            want, have = getattr(api, name), getattr(cls, name)
            if isinstance(want, property):
                assert isinstance(have, property), (cls.__name__, name)
            elif name == "close":
                extra = params(have)[len(params(want)):]
                assert params(have)[:len(params(want))] == params(want)
                assert all(default is not inspect.Parameter.empty for *_, default in extra)
            else:
                assert params(have) == params(want), (cls.__name__, name)
    for store in (CheckpointStore(tmp_path / "plain"),
                  _tiered_on_dir(tmp_path / "local", tmp_path / "remote")):
        assert isinstance(store.url, str)
        store.close()
