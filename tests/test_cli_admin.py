"""`trainguard datasets|offsets|ckpt` against a real redis-server and real stores:
JSON output, human tables, exit codes and --help on every command."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_store import CheckpointStore
from ingest_service import redis_client as ingest_redis
from tests.admin_helpers import make_dataset, make_group, save_checkpoints
from trainer_client import redis_client as trainer_redis
from trainguard.core import streams
from trainguard.ops.cli import build_parser, main


def run(capsys, *argv: str) -> tuple[int, object]:
    """Run the CLI in-process; returns (exit code, parsed JSON stdout or text)."""
    code = main(list(argv))
    out = capsys.readouterr().out
    try:
        return code, json.loads(out)
    except ValueError:
        return code, out


def _seed(url: str, *, group_floor: dict[int, str] | None = None) -> None:
    async def go() -> None:
        r = ingest_redis.client(url)
        await make_dataset(r, partitions=2, per_partition=4)
        await make_group(r, "toy", "run1", 2, floor=group_floor)
        await r.aclose()

    asyncio.run(go())


def test_datasets_commands(any_redis, capsys):
    """create -> ls/show report it; creating it again with other settings is refused
    (exit 4); show of an unknown one is exit 3; delete needs --yes, then removes it."""
    url = any_redis.url
    code, out = run(capsys, "datasets", "create", "tok", "--source", "memory://t.jsonl",
                    "--partitions", "3", "--redis-url", url, "--json")
    assert (code, out) == (0, {"created": "tok", "partitions": 3})
    code, out = run(capsys, "datasets", "create", "tok", "--source", "memory://t.jsonl",
                    "--partitions", "4", "--redis-url", url)
    assert code == 4
    code, out = run(capsys, "datasets", "ls", "--redis-url", url, "--json")
    assert code == 0 and [(d["name"], d["partitions"], d["length"]) for d in out] == [
        ("tok", 3, 0)]
    code, out = run(capsys, "datasets", "ls", "--redis-url", url)
    assert code == 0 and out.splitlines()[0].split()[:4] == ["NAME", "FORMAT", "PARTS",
                                                             "RECORDS"]
    code, out = run(capsys, "datasets", "show", "tok", "--redis-url", url, "--json")
    assert code == 0 and len(out["partitions"]) == 3
    code, _ = run(capsys, "datasets", "show", "nope", "--redis-url", url)
    assert code == 3
    code, _ = run(capsys, "datasets", "show", "bad name", "--redis-url", url)
    assert code == 2
    code, _ = run(capsys, "datasets", "delete", "tok", "--redis-url", url)
    assert code == 2
    code, _ = run(capsys, "datasets", "delete", "tok", "--yes", "--redis-url", url)
    assert code == 0
    assert not trainer_redis.client(url).exists(streams.meta_key("tok"))


def test_offsets_show_and_seek(any_redis, capsys):
    """offsets show reports delivered/lag per partition; seek --to/--ids moves the
    group; a seek below the floor is exit 4 and changes nothing."""
    url = any_redis.url
    _seed(url, group_floor={0: "1-1"})
    code, out = run(capsys, "offsets", "show", "toy", "--redis-url", url, "--json")
    assert code == 0
    (group,) = out
    assert [(p["last_delivered_id"], p["lag"]) for p in group["partitions"]] == [
        ("0-0", 4), ("0-0", 4)]
    code, out = run(capsys, "offsets", "seek", "toy", "run1", "--to", "latest",
                    "--redis-url", url, "--json")
    assert code == 0 and out["offsets"] == {"0": "1-3", "1": "1-3"}
    code, out = run(capsys, "offsets", "seek", "toy", "run1", "--ids", "1=1-1",
                    "--redis-url", url, "--json")
    assert code == 0 and out["offsets"] == {"1": "1-1"}
    code, _ = run(capsys, "offsets", "seek", "toy", "run1", "--ids", "0=1-0",
                  "--redis-url", url)
    assert code == 4
    code, _ = run(capsys, "offsets", "seek", "toy", "run1", "--ids", "0=oops",
                  "--redis-url", url)
    assert code == 2
    code, out = run(capsys, "offsets", "show", "toy", "--group", "run1", "--redis-url", url)
    assert code == 0 and "1-3" in out and "1-1" in out
    r = trainer_redis.client(url)
    assert r.xinfo_groups(streams.partition_key("toy", 0))[0]["last-delivered-id"] == b"1-3"


def test_offsets_show_of_an_unknown_group_names_the_groups(any_redis, capsys):
    """offsets show --group of a group the dataset lacks is exit 3 (not found), and its
    message names what was asked, the groups there are, and what to do."""
    url = any_redis.url
    _seed(url)
    code = main(["offsets", "show", "toy", "--group", "nope", "--redis-url", url])
    err = capsys.readouterr().err
    assert code == 3
    assert "'nope' has no state on 'toy'" in err
    assert "['run1']" in err and "leave --group out" in err


def test_offsets_seek_to_checkpoint(redis_target, capsys, tmp_path):
    """seek --checkpoint URL --step N moves the group to that manifest's offsets."""
    url = redis_target.url
    _seed(url)
    save_checkpoints(str(tmp_path / "ck"), [7], {0: "1-2", 1: "1-0"})
    code, out = run(capsys, "offsets", "seek", "toy", "run1", "--checkpoint",
                    str(tmp_path / "ck"), "--step", "7", "--redis-url", url, "--json")
    assert code == 0 and out["offsets"] == {"0": "1-2", "1": "1-0"}
    code, _ = run(capsys, "offsets", "seek", "toy", "run1", "--checkpoint",
                  str(tmp_path / "ck"), "--step", "8", "--redis-url", url)
    assert code == 3


def test_ckpt_ls_show_verify_pin_gc(tmp_path, capsys):
    """ls lists steps oldest first; show prints the manifest; gc without --keep-last
    deletes no checkpoint; pin shows in ls and survives gc while unpinned older
    steps go; verify is 0 when intact and 1 after a
    chunk is damaged (export of it too: a failure, not a usage error); an unknown step
    is exit 3."""
    root = str(tmp_path / "ck")
    save_checkpoints(root, [1, 2, 3, 4, 5], {0: "1-1"})
    code, out = run(capsys, "ckpt", "ls", root, "--json")
    assert code == 0 and [r["step"] for r in out] == [1, 2, 3, 4, 5]
    code, out = run(capsys, "ckpt", "show", root, "3")
    assert code == 0 and out["step"] == 3 and out["extra"]["trainguard"]["offsets"]
    assert run(capsys, "ckpt", "pin", root, "1")[0] == 0
    code, out = run(capsys, "ckpt", "gc", root, "--json")
    assert code == 0 and out["deleted_steps"] == [] and out["kept_steps"] == [1, 2, 3, 4, 5]
    code, out = run(capsys, "ckpt", "gc", root, "--keep-last", "2", "--json")
    assert code == 0 and out["deleted_steps"] == [2, 3] and out["kept_steps"] == [1, 4, 5]
    code, out = run(capsys, "ckpt", "ls", root)
    assert code == 0 and "pinned" in out.splitlines()[1]
    assert run(capsys, "ckpt", "unpin", root, "1")[0] == 0
    code, out = run(capsys, "ckpt", "verify", root, "--json")
    assert code == 0 and [r["valid"] for r in out] == [True, True, True]
    newest = CheckpointStore(root).latest()
    chunk = next(p for p in (Path(root) / newest.data_dir).rglob("*")
                 if p.is_file() and p.name[0].isdigit())
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 0xFF]))
    code, out = run(capsys, "ckpt", "verify", root, "5", "--json")
    assert code == 1 and out[0]["valid"] is False
    assert run(capsys, "ckpt", "export", root, "5", "-o", str(tmp_path / "x.st"))[0] == 1
    assert run(capsys, "ckpt", "show", root, "99")[0] == 3
    assert run(capsys, "ckpt", "pin", root, "99")[0] == 3


def test_ckpt_export_safetensors_roundtrip(tmp_path, capsys):
    """export writes every tensor of the checkpoint, bfloat16 included, bit-exact,
    named by its key path."""
    root = str(tmp_path / "ck")
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    state = {"model": model, "counts": torch.arange(5, dtype=torch.int32),
             "nested": {"a/b": torch.randn(2, 2)}}
    store = CheckpointStore(root)
    store.save(state, step=3, blocking=True)
    store.close()
    out_file = tmp_path / "out.safetensors"
    code, out = run(capsys, "ckpt", "export", root, "--format", "safetensors",
                    "-o", str(out_file), "--json")
    assert code == 0 and out["step"] == 3 and out["tensors"] == 4
    loaded = load_file(str(out_file))
    assert set(loaded) == {"model/weight", "model/bias", "counts", "nested/a~1b"}
    assert loaded["model/weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["model/weight"], model.weight.detach())
    assert torch.equal(loaded["counts"], state["counts"])
    assert torch.equal(loaded["nested/a~1b"], state["nested"]["a/b"])


def _leaf_parsers(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield from _leaf_parsers(sub, (*prefix, name))
            return
    yield prefix


@pytest.mark.parametrize("command", ["datasets", "offsets", "ckpt", "demo"])
def test_every_command_has_help(command, capsys):
    """--help works on the group and on each of its subcommands (exit 0, usage)."""
    leaves = [p for p in _leaf_parsers(build_parser()) if p[0] == command]
    assert leaves
    for argv in [(command,), *leaves]:
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        assert "usage: trainguard " + " ".join(argv) in capsys.readouterr().out


def test_redis_down_is_exit_1_with_a_message(capsys):
    """A Redis that does not answer: exit 1 and one line naming the URL, no traceback."""
    from tests.servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    code = main(["datasets", "ls", "--redis-url", url])
    err = capsys.readouterr().err
    assert code == 1 and url in err and "Traceback" not in err
