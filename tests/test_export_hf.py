"""``trainguard ckpt export --key model``: a safetensors file that Hugging Face's
``from_pretrained`` loads whole, from a checkpoint saved as users save state
(``{"model": model.state_dict(), "optim": ..., "step": ...}``), through the store or
through DCP. The model is built from a config in the test: no hub downloads."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from checkpoint_store import CheckpointStore
from checkpoint_store.dcp import StorageWriter
from tests._ckpt_helpers import same_bits
from trainguard.ops.cli import main

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cli(capsys: Any, *argv: str) -> tuple[int, Any, str]:
    """Exit code, stdout (parsed when JSON) and stderr of the CLI run in-process."""
    code = main(list(argv))
    captured = capsys.readouterr()
    try:
        return code, json.loads(captured.out), captured.err
    except ValueError:
        return code, captured.out, captured.err


def _model() -> Any:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16,
                                     vocab_size=50)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _state(model: Any) -> dict[str, Any]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).reshape(1, 8), labels=torch.arange(8).reshape(1, 8)).loss.backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 3}


@pytest.mark.parametrize("through", ["store", "dcp"])
def test_export_by_key_loads_into_from_pretrained_with_no_missing_weights(tmp_path, capsys,
                                                                          through):
    """Saved as {"model": state_dict, "optim", "step"} (by CheckpointStore.save or
    dcp.save), exported with --key model next to the model's config.json:
    from_pretrained reports no missing, unexpected or mismatched weights (on main
    every name carried a model/ prefix and all were left random) and every tensor
    equals the trained one bit for bit; the file's metadata has "format": "pt"."""
    model = _model()
    state = _state(model)
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    if through == "store":
        store.save(state, step=3)
    else:
        dcp.save(state, storage_writer=StorageWriter(store, step=3))
    out_dir = tmp_path / "hf"
    model.config.save_pretrained(out_dir)
    code, result, _ = _cli(capsys, "ckpt", "export", str(root), "--key", "model", "-o",
                           str(out_dir / "model.safetensors"), "--json")
    assert code == 0, result
    expected = model.state_dict()
    assert result["tensors"] == len(expected) and result["names"] == sorted(expected)
    assert (result["key"], result["format"], result["step"]) == ("model", "pt", 3)
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
    loaded, info = type(model).from_pretrained(out_dir, output_loading_info=True)
    assert info["missing_keys"] in (set(), []) and info["unexpected_keys"] in (set(), [])
    assert info["mismatched_keys"] in (set(), []) and not info.get("error_msgs")
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert same_bits(got[name], t), name


def test_export_refuses_to_overwrite_and_bad_keys_say_what_to_do(tmp_path, capsys):
    """An existing output is refused (exit 4, the file untouched) unless --force; the
    human line says what was written; a key without tensors and a prefix no name has
    are refused (exit 2) naming what the checkpoint holds; --strip-prefix leaves the
    prefix off (a DDP-style "module." save)."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    store.save({"model": {"module.w": torch.ones(2), "module.b": torch.zeros(1)},
                "step": 1}, step=1)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep me")
    code, _, err = _cli(capsys, "ckpt", "export", str(root), "--key", "model", "-o", str(out))
    assert code == 4 and out.read_bytes() == b"keep me"
    assert "already exists" in err and "--force" in err
    code, text, _ = _cli(capsys, "ckpt", "export", str(root), "--key", "model", "-o", str(out),
                      "--strip-prefix", "module.", "--force")
    assert code == 0
    assert "2 tensors (the tensors under key 'model', prefix 'module.' stripped)" in text
    assert str(out) in text and "format pt" in text
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == ["b", "w"]
    code, _, err = _cli(capsys, "ckpt", "export", str(root), "--key", "optim", "-o",
                        str(tmp_path / "x.safetensors"))
    assert code == 2 and "no tensors under key 'optim'" in err and "['model']" in err
    code, _, err = _cli(capsys, "ckpt", "export", str(root), "--key", "model", "--strip-prefix",
                        "_orig_mod.", "-o", str(tmp_path / "y.safetensors"))
    assert code == 2 and "no tensor name starts with '_orig_mod.'" in err
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "o.safetensors"]
