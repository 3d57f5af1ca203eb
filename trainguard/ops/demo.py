"""``trainguard demo``: ingest, train, kill -9 the trainer, resume, count.

What it does, all on this machine and cleaned up afterwards:

1. starts its own ``redis-server`` (free port, temporary directory);
2. writes a dataset of token records (JSON Lines) and registers it;
3. starts the ingest service (``trainguard serve``, free port, admin API with a fresh
   token), which shards the records into Redis streams;
4. trains a small next-token MLP (:mod:`trainguard.ops.demo_trainer`, packaged: a wheel runs it too) through
   ``StreamingDataset`` + ``TrainingSession`` with checkpoints; the trainer's state
   includes a ledger (times each record ID went through an optimizer step);
5. kills the trainer with SIGKILL between two checkpoints, restarts it, lets it
   finish;
6. loads the final checkpoint's ledger independently and prints: records ingested,
   trained, duplicated, lost, checkpoints, resume time;
7. with ``--keep``: prints the dashboard's URL (``/ui``: the run's checkpoint
   timeline with the kill and the resume on it) and keeps Redis and the service up
   until Ctrl-C, then stops them (the work directory stays).

Every child runs in its own process group (and, on Linux, dies with the demo); the
demo kills them all on exit, on Ctrl-C and on SIGTERM. What it starts around the
trainer (Redis, the dataset, the service) is :mod:`trainguard.ops.demo_stack`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainguard.core.process import free_port
from trainguard.ops.demo_stack import (
    DATASET,
    STORE_NAME,
    Children,
    DemoError,
    records_ingested,
    register_dataset,
    start_redis,
    start_service,
    write_dataset,
)
from trainguard.ops.exits import EXIT_FAILED, EXIT_OK

__all__ = ["main", "register", "run_demo"]

RUN = "mlp"
TRAINER = "trainguard.ops.demo_trainer"
"""The trainer the demo runs (``python -m``): a module of the package, so that an
installed wheel has it."""
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""Where this ``trainguard`` is imported from (a checkout, or site-packages): the
trainer imports the same one."""


class Trainer:
    """One trainer subprocess; its JSON events are read line by line."""

    def __init__(self, children: Children, argv: list[str], log: Path, env: dict[str, str]):
        self.log = log.open("w")
        self.proc = children.start("trainer", argv, stdout=subprocess.PIPE,
                                   stderr=self.log, text=True, env=env)
        self.started = time.monotonic()

    def events(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    yield json.loads(line)


def run_trainer(
    children: Children, argv: list[str], log: Path, env: dict[str, str], *,
    kill_after_step: int | None, say: Any,
) -> dict[str, Any]:
    """Run one trainer until it is done or (with ``kill_after_step``) SIGKILL it
    once it reported that step. Returns what it reported."""
    trainer = Trainer(children, argv, log, env)
    out: dict[str, Any] = {"killed_at_step": None, "checkpoints": [], "restored": None,
                           "done": None, "first_step_s": None, "last_step": None,
                           "started_at": trainer.started}
    for ev in trainer.events():
        kind = ev.get("event")
        if kind == "restored":
            out["restored"] = ev
            say(f"trainer restored step {ev['step']} "
                f"({ev['trained']} records already in the model) in {ev['resume_s']} s")
        elif kind == "step":
            out["last_step"] = ev["step"]
            if out["first_step_s"] is None:
                out["first_step_s"] = time.monotonic() - trainer.started
            if kill_after_step is not None and ev["step"] >= kill_after_step:
                Children.kill_group(trainer.proc)
                trainer.proc.wait()
                out["killed_at_step"] = ev["step"]
                say(f"SIGKILL the trainer after it reported step {ev['step']} "
                    f"(loss {ev['loss']})")
                break
        elif kind == "checkpoint":
            out["checkpoints"].append(ev["step"])
            say(f"checkpoint of step {ev['step']} (offsets inside; commits in the background)")
        elif kind == "done":
            out["done"] = ev
    code = trainer.proc.wait()
    if out["killed_at_step"] is None and (code != 0 or out["done"] is None):
        raise DemoError(f"the trainer exited with code {code} before it was done; see {log}")
    return out


def final_ledger(store: Path, records: int) -> tuple[list[int], int]:
    """The ledger of the newest checkpoint, loaded (and verified) by the store."""
    import torch

    from checkpoint_store import CheckpointStore

    with CheckpointStore(str(store)) as cs:
        state = {"ledger": torch.zeros(records, dtype=torch.int32)}
        manifest = cs.load(state, keys=["ledger"], strict=True)
        if manifest is None:
            raise DemoError(f"no checkpoint in {store}")
        return state["ledger"].tolist(), len(cs.list())


# --------------------------------------------------------------------------- the run


def run_demo(args: argparse.Namespace, say: Any,
             hold: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The demo; ``hold(summary)`` (with ``--keep``) runs before the children stop."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="trainguard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    children = Children(sys.stderr)
    started = time.monotonic()
    failed = False
    try:
        redis_url = start_redis(children, workdir)
        say(f"redis-server at {redis_url} (data in {workdir / 'redis'})")
        source = workdir / "tokens.jsonl"
        write_dataset(source, args.records, args.seed)
        register_dataset(redis_url, source, args.partitions)
        say(f"dataset {DATASET!r}: {args.records} token records in {source}, "
            f"{args.partitions} partitions")
        store = workdir / "checkpoints"
        token = secrets.token_urlsafe(16)
        api = start_service(children, workdir, redis_url, store, token, args.port or free_port())
        say(f"dashboard: {api}/ui")
        say(f"admin API while it runs: {api}/admin/datasets/{DATASET}  "
            f"{api}/admin/datasets/{DATASET}/groups  {api}/admin/checkpoints/{STORE_NAME}  "
            f"(mutations: Authorization: Bearer {token})")

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-m", TRAINER, "--redis-url", redis_url, "--dataset", DATASET,
                "--run-name", RUN, "--store", str(store), "--records", str(args.records),
                "--batch-size", str(args.batch_size), "--checkpoint-every",
                str(args.checkpoint_every), "--step-delay-ms", str(args.step_delay_ms)]
        steps_total = -(-args.records // args.batch_size)
        kill_at = min(2 * args.checkpoint_every + max(1, args.checkpoint_every // 2),
                      max(1, steps_total - 2))
        first = run_trainer(children, argv, workdir / "trainer-1.log", env,
                            kill_after_step=kill_at, say=say)
        killed_at = time.monotonic()
        second = run_trainer(children, argv, workdir / "trainer-2.log", env,
                             kill_after_step=None, say=say)
        restored = second["restored"] or {}
        done = second["done"] or {}
        ingested, finished, dead = records_ingested(redis_url)
        ledger, checkpoints = final_ledger(store, args.records)
        trained = sum(ledger)
        summary = {
            "records_generated": args.records,
            "records_ingested": ingested,
            "producer_finished": finished,
            "dead_letters": dead,
            "records_trained": trained,
            "duplicated": sum(c - 1 for c in ledger if c > 1),
            # Record IDs are 0..records-1: a generated record never trained is lost,
            # whether it went missing in ingestion or in training.
            "lost": sum(1 for c in ledger if c == 0),
            "kills": 1 if first["killed_at_step"] is not None else 0,
            "killed_at_step": first["killed_at_step"],
            "resumed_from_step": restored.get("step"),
            "steps_redone": (first["killed_at_step"] or 0) - (restored.get("step") or 0),
            "final_step": done.get("step"),
            "final_loss": done.get("loss"),
            "checkpoints_written": len(first["checkpoints"]) + len(second["checkpoints"]),
            "checkpoints_kept": checkpoints,
            "restore_s": restored.get("resume_s"),
            # From the SIGKILL to the first training step of the restarted trainer
            # (process start, imports, restore, first batch).
            "resume_s": round(second["started_at"] + (second["first_step_s"] or 0.0)
                              - killed_at, 3),
            "admin_api": api,
            "workdir": str(workdir),
            "elapsed_s": round(time.monotonic() - started, 1),
            "dashboard": f"{api}/ui",
        }
        if hold is not None:
            hold(summary)
        return summary
    except DemoError:
        failed = True  # keep the logs the message points to
        raise
    finally:
        children.kill_all()
        if failed:
            print(f"logs kept in {workdir}", file=sys.stderr)
        elif not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _human(s: dict[str, Any]) -> str:
    ok = s["lost"] == 0 and s["duplicated"] == 0 and s["kills"] == 1
    lines = [
        "",
        "trainguard demo summary",
        f"  records ingested     {s['records_ingested']} (dead letters: {s['dead_letters']})",
        f"  records trained      {s['records_trained']}",
        f"  duplicated           {s['duplicated']}",
        f"  lost                 {s['lost']}",
        f"  trainer SIGKILLed    after step {s['killed_at_step']}, resumed from checkpoint of "
        f"step {s['resumed_from_step']} ({s['steps_redone']} steps redone, each record "
        "still counted once)",
        f"  checkpoints          {s['checkpoints_written']} written, "
        f"{s['checkpoints_kept']} kept (retention)",
        f"  resume time          {s['resume_s']} s from restart to the first step "
        f"(restore itself: {s['restore_s']} s)",
        f"  final step / loss    {s['final_step']} / {s['final_loss']}",
        f"  admin API (was)      {s['admin_api']}",
        f"  dashboard            {s['dashboard']} (stays up with --keep)",
        f"  took                 {s['elapsed_s']} s",
        "",
        "OK: every record trained exactly once." if ok else "FAILED: see the counts above.",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Signal handlers turn SIGTERM into the same clean exit as Ctrl-C."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    log = sys.stderr if args.json else sys.stdout

    def say(msg: str) -> None:
        print(f"[demo] {msg}", file=log, flush=True)

    def show(summary: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(summary, indent=2, sort_keys=True), flush=True)
        else:
            print(_human(summary), flush=True)

    def hold(summary: dict[str, Any]) -> None:
        # --keep: the summary now, then the service stays up for a look at the
        # dashboard; Ctrl-C (or SIGTERM) ends the demo normally.
        show(summary)
        say(f"the service stays up: open {summary['dashboard']} (Ctrl-C to stop; "
            f"files stay in {summary['workdir']})")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)

    try:
        summary = run_demo(args, say, hold if args.keep else None)
    except DemoError as exc:
        print(f"trainguard demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not args.keep:
        show(summary)
    ok = summary["lost"] == 0 and summary["duplicated"] == 0 and summary["kills"] == 1
    return EXIT_OK if ok else EXIT_FAILED


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="ingest, train, kill -9 the trainer, resume, count (0 lost, 0 duplicated)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--records", type=int, default=3000, help="records to generate (default 3000)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the demo dataset")
    p.add_argument("--batch-size", type=int, default=32, help="records per training batch")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--step-delay-ms", type=float, default=15.0,
                   help="sleep per training step, so the run can be watched (default 15)")
    p.add_argument("--seed", type=int, default=0, help="shuffle and model seed")
    p.add_argument("--port", type=int, default=None, help="service port (default: a free one)")
    p.add_argument("--workdir", help="keep everything here (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true",
                   help="after the run, keep the service up (print the dashboard URL) until "
                        "Ctrl-C, and keep the temp dir")
    p.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
    p.set_defaults(handler=main)
