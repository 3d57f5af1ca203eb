"""One real torchtitan training step through trainguard, killed and resumed (#30).

torchtitan's llama3 ``debugmodel`` (built from its own model registry and config,
initialised by its own ``init_weights``), its ``OptimizersContainer`` and
``LRSchedulersContainer``, its ``cross_entropy_loss``; the batches from
``TrainguardDataLoader``; saves and the restore through ``checkpoint_manager(...)``
(torchtitan's ``CheckpointManager`` over the session's DCP store)::

    python bench/titan_step.py --device cuda      # what `make gpu-check` runs

1. a first process trains 2 steps, saving after each, writes the committed weights
   (step 2) aside, trains a 3rd step it never saves, and is SIGKILLed;
2. a second process resumes: ``manager.load()`` must give step 2 and weights bitwise
   equal to those written aside, then it trains to the end of the data;
3. the records trained in the committed steps of the first process plus those of
   the second are each record of the dataset exactly once.

Record ``i`` is ``SEQ + 1`` token ids starting with ``i`` (so a batch names its
records); inputs are its first ``SEQ`` tokens, labels the last ``SEQ``.

Why only on a GPU: ``torchtitan.models`` imports ``triton`` when it is imported
(``torchtitan.models.common.moe`` -> ``token_dispatcher`` ->
``distributed.minimal_async_ep.kernels``), and CPU builds of torch come without
triton; its language models also accept only FlexAttention or varlen attention
("sdpa is no longer supported for language models"). Exits 0 when the run is right,
1 with what was wrong otherwise, 3 when torchtitan or its model cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

N, PARTITIONS, BATCH, SEQ, VOCAB = 24, 2, 4, 128, 2048
FIRST_STEPS = 2  # committed by the first process before its uncommitted 3rd step
UNAVAILABLE = 3


def record(i: int) -> np.ndarray:
    """Record ``i``: ``i`` then pseudo-random token ids below the debugmodel's vocab."""
    rest = (np.arange(1, SEQ + 1, dtype=np.int64) * 7919 + i * 104729) % VOCAB
    return np.concatenate([np.array([i], dtype=np.int64), rest])


def import_torchtitan() -> str | None:
    """None when torchtitan's model, optimizer and checkpoint modules import; else why not."""
    try:
        import torchtitan.components.checkpoint
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:
        return (f"torchtitan's llama3 model cannot be imported here ({type(e).__name__}: {e}); "
                "`make setup` installs torchtitan, and torchtitan.models needs triton, which "
                "ships with CUDA builds of torch only")
    return None


def _job(device: str, redis_url: str, store: str) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The model, its containers, the loader and the manager, as torchtitan's trainer
    builds them (meta device, ``to_empty``, ``init_weights``)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.models.llama3 import model_registry

    from tests._titan_job import TrainState  # torchtitan's train state, reduced to the step
    from trainguard.integrations.torchtitan import TrainguardDataLoader, checkpoint_manager

    torch.manual_seed(0)
    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    model.train()
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]),
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=100)
    loader = TrainguardDataLoader(redis_url, dataset="titan", run="titan-step", store=store,
                                  batch_size=BATCH, keep_last=2, block_ms=200)
    train_state = TrainState()
    manager = checkpoint_manager(
        loader, CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0),
        model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None)
    return model, optimizers, schedulers, loader, manager, train_state


def train_step(model: Any, optimizers: Any, schedulers: Any, batch: torch.Tensor,
               device: str) -> float:
    """One step as torchtitan's trainer takes it: positions, the model's own attention
    masks, the summed cross entropy over the tokens, backward, optimizer and LR steps."""
    from torchtitan.components.loss import cross_entropy_loss

    tokens = batch.to(device=device, dtype=torch.long)
    inputs, labels = tokens[:, :-1] % VOCAB, tokens[:, 1:] % VOCAB
    positions = torch.arange(SEQ, device=device).expand(len(tokens), SEQ)
    masks = model.get_attention_masks(positions=positions)
    optimizers.zero_grad()
    pred = model(inputs, positions=positions, attention_masks=masks)
    loss = cross_entropy_loss(pred, labels) / labels.numel()
    loss.backward()
    optimizers.step()
    schedulers.step()
    if not torch.isfinite(loss):
        raise RuntimeError(f"the torchtitan step's loss is {loss.item()}")
    return float(loss.item())


def phase(which: str, device: str, redis_url: str, store: str, work: Path) -> int:
    """One process of the run (see the module); writes what it trained under ``work``."""
    model, optimizers, schedulers, loader, manager, ts = _job(device, redis_url, store)
    manager.load()
    trained: list[list[int]] = []
    report = {"restored_step": loader.restored_step, "device": str(next(model.parameters()).device)}
    if which == "resume":
        committed = torch.load(work / "committed.pt")
        now = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        report["bitwise"] = sorted(committed) == sorted(now) and all(
            torch.equal(committed[k], now[k]) for k in committed)
    for batch in loader:
        report.setdefault("losses", []).append(train_step(model, optimizers, schedulers,
                                                          batch, device))
        ts.step += 1
        trained.append(batch[:, 0].tolist())
        if which == "first" and ts.step > FIRST_STEPS:  # trained, never saved: kill now
            (work / "first.json").write_text(json.dumps({**report, "trained": trained}))
            print("KILL ME", flush=True)
            signal.pause()
        manager.save(ts.step)
        if which == "first" and ts.step == FIRST_STEPS:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
                       work / "committed.pt")
    manager.close()
    loader.close()
    (work / f"{which}.json").write_text(json.dumps({**report, "trained": trained,
                                                    "step": ts.step}))
    return 0


def _spawn(which: str, device: str, redis_url: str, store: str, work: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--phase", which, "--device", device, "--redis", redis_url,
         "--store", store, "--work", str(work)],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})


def run(device: str, work: Path, timeout_s: float = 240) -> dict[str, Any]:
    """The whole check on ``device`` (see the module); raises ``AssertionError`` with
    what was wrong, returns the figures of a right run."""
    from tests import _client_fill as cf
    from tests.servers import RedisServer

    redis = RedisServer(work / "redis").start()
    try:
        spec = cf.create(redis.url, "titan", partitions=PARTITIONS, sample_len=SEQ + 1)
        cf.fill(redis.url, spec, N, make=record)
        store = f"file://{work}/ckpt"
        first = _spawn("first", device, redis.url, store, work)
        assert first.stdout is not None
        line = first.stdout.readline()
        if line.strip() != "KILL ME":
            first.kill()
            first.wait(timeout_s)
            raise AssertionError(f"the first process ended (rc {first.returncode}) before its "
                                 f"uncommitted step; it printed {line!r}")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout_s)
        resume = _spawn("resume", device, redis.url, store, work)
        resume.communicate(timeout=timeout_s)
        if resume.returncode != 0:
            raise AssertionError(f"the resumed process failed (rc {resume.returncode})")
    finally:
        redis.stop()
    a = json.loads((work / "first.json").read_text())
    b = json.loads((work / "resume.json").read_text())
    assert a["restored_step"] == 0, f"the first process did not start fresh: {a}"
    assert b["restored_step"] == FIRST_STEPS, \
        f"the resume restored step {b['restored_step']}, not the committed {FIRST_STEPS}"
    assert b["bitwise"], "the restored weights differ from those committed at step 2"
    seen = sorted(r for batch in a["trained"][:FIRST_STEPS] + b["trained"] for r in batch)
    assert seen == list(range(N)), (
        f"records trained in committed steps: lost {sorted(set(range(N)) - set(seen))}, "
        f"duplicated {sorted({r for r in seen if seen.count(r) > 1})}")
    return {"device": b["device"], "steps": b["step"], "records": N,
            "loss_first": a["losses"][0], "loss_last": b["losses"][-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phase", choices=["first", "resume"])
    ap.add_argument("--redis")
    ap.add_argument("--store")
    ap.add_argument("--work", type=Path)
    args = ap.parse_args(argv)
    if args.phase:
        return phase(args.phase, args.device, args.redis, args.store, args.work)
    why = import_torchtitan()
    if why is not None:
        print(f"titan step: {why}", file=sys.stderr)
        return UNAVAILABLE
    with tempfile.TemporaryDirectory(prefix="titan-step-") as tmp:
        try:
            got = run(args.device, Path(tmp))
        except AssertionError as e:
            print(f"titan step FAILED on {args.device}: {e}", file=sys.stderr)
            return 1
    print(f"titan step ok: {json.dumps(got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
