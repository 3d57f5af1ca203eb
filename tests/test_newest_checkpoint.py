"""Every reader resumes from the same checkpoint when a fenced zombie commits late.

A zombie trainer (fencing generation 1) commits step 30 after the newer generation 2
committed step 15: in commit order (what LATEST names) the zombie's manifest is the
newest, in restore order generation 2's step 15 is. The store, the tiered store, the
``trainguard ckpt show`` CLI, the admin API's "keep the newest" rule (through its real
HTTP API: the delete it refuses, and why) and FORMAT.md's documented reader procedure
(its code block, run verbatim) must all pick step 15.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from checkpoint_store import CheckpointStore, TieredCheckpointStore
from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot
from tests.admin_helpers import TOKEN, ThreadedServer, service_app
from tests.test_checkpoint_format_reader import _reader
from trainguard.ops.cli import main

# (step, generation, commit) in the order they are committed: the zombie's step 30 last.
SAVES = ((10, 1, 1), (20, 1, 2), (15, 2, 3), (30, 1, 3))
RESUME_STEP = 15
ZOMBIE_STEP = 30


def _save_all(store) -> None:
    state = {"w": torch.zeros(3)}
    for step, gen, commit in SAVES:
        tg = {"dataset": "toy", "run": "run1", "generation": gen, "commit": commit,
              "offsets": {"0": f"1-{step}"}}
        state["w"].fill_(step)
        store.save(state, step=step, extra={"trainguard": tg}, blocking=True)


def _loaded_step(store) -> int:
    state = {"w": torch.zeros(3)}
    manifest = store.load(state)
    assert manifest is not None
    assert torch.equal(state["w"], torch.full((3,), float(manifest.step)))
    return manifest.step


def _delete(base: str, step: int) -> tuple[int, dict]:
    """DELETE a checkpoint through the admin API over HTTP: (status, JSON body)."""
    request = urllib.request.Request(f"{base}/admin/checkpoints/ck/{step}", method="DELETE",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_every_reader_resumes_from_the_same_checkpoint_past_a_zombies_late_commit(
        tmp_path, capsys, redis_server):
    """The store, the tiered store, the CLI, the admin API and FORMAT.md's reader all
    pick the restore-order newest (step 15), never the zombie's late step 30."""
    root = tmp_path / "ck"
    store = CheckpointStore(str(root), keep_last=100)
    _save_all(store)
    assert store.latest().step == ZOMBIE_STEP  # the commit order's newest: the zombie
    assert _loaded_step(store) == RESUME_STEP
    store.close()

    tiered = TieredCheckpointStore(tmp_path / "local", (tmp_path / "remote").as_uri(),
                                   keep_last=100)
    _save_all(tiered)
    assert tiered.wait_uploads(timeout_s=120)
    assert _loaded_step(tiered) == RESUME_STEP
    tiered.close()
    remote_only = TieredCheckpointStore(tmp_path / "fresh", (tmp_path / "remote").as_uri(),
                                        keep_last=100)
    assert _loaded_step(remote_only) == RESUME_STEP  # every manifest read from the remote
    remote_only.close()

    assert main(["ckpt", "show", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == RESUME_STEP

    fs, path = _reader()["open_root"](str(root))
    doc = _reader()["newest_manifest"](fs, path)
    assert doc["step"] == RESUME_STEP

    # The admin API, served for real: it keeps step 15 as what a restart resumes from
    # (and the zombie's step 30 only as what LATEST names), and lets an older one go.
    config = AdminConfig(redis_server.url, TOKEN, {"ck": StoreRoot("ck", str(root))})
    server = ThreadedServer(service_app(config)).start()
    try:
        status, body = _delete(server.url, RESUME_STEP)
        assert status == 409 and body["error"]["code"] == "newest_checkpoint"
        assert "a restart resumes from it" in body["error"]["message"]
        status, body = _delete(server.url, ZOMBIE_STEP)
        assert status == 409 and body["error"]["code"] == "newest_checkpoint"
        assert f"a restart resumes from step {RESUME_STEP}" in body["error"]["message"]
        assert _delete(server.url, 20) == (200, {"store": "ck", "step": 20, "deleted": True})
    finally:
        server.stop()
    assert [m.step for m in CheckpointStore(str(root), keep_last=100).list()] == [10, 15, 30]
