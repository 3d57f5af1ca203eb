"""Loss-spike detector, rollback policy, and SpikeGuard in a real tiny torch training loop."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch

from trainer_client.errors import RollbackLimitError, TrainerClientError
from trainer_client.spikes import (
    Action,
    BatchId,
    LossSpikeDetector,
    RollbackConfig,
    RollbackPolicy,
    SpikeConfig,
    SpikeGuard,
)

# -- detector -------------------------------------------------------------------------


def feed(det: LossSpikeDetector, values: list[float], start: int = 0) -> list[Any]:
    return [det.observe(start + i, v) for i, v in enumerate(values)]


def test_factor_is_explicit_and_strict() -> None:
    """With factor 5.0 over a steady loss of 1.0, 5.0 is accepted and 5.01 is a spike;
    the spike's reason names value, factor, average and step."""
    det = LossSpikeDetector(SpikeConfig(window=10, factor=5.0, warmup_steps=3))
    assert not any(v.suspicious for v in feed(det, [1.0] * 5))
    assert not det.observe(5, 5.0).spike
    det2 = LossSpikeDetector(SpikeConfig(window=10, factor=5.0, warmup_steps=3))
    feed(det2, [1.0] * 5)
    verdict = det2.observe(5, 5.01)
    assert verdict.spike and verdict.steps == (5,)
    assert verdict.reason == "loss 5.01 > 5 x moving average 1 at step 5"
    assert SpikeConfig().factor == 5.0


def test_spikes_do_not_enter_the_average() -> None:
    """A spike leaves the moving average as it was; a normal value moves it."""
    det = LossSpikeDetector(SpikeConfig(window=4, warmup_steps=2))
    feed(det, [2.0, 2.0, 2.0, 2.0])
    assert det.observe(4, 1000.0).spike
    assert det.loss_mean() == 2.0
    det.observe(5, 6.0)
    assert det.loss_mean() == 3.0  # window of 4: 2, 2, 2, 6


def test_persistence_needs_k_consecutive_steps() -> None:
    """With persistence 3, two high steps then a normal one is no spike (and resets
    the run); three high steps in a row are one spike covering all three steps."""
    det = LossSpikeDetector(SpikeConfig(window=10, persistence=3, warmup_steps=2))
    feed(det, [1.0] * 4)
    high = feed(det, [10.0, 10.0], start=4)
    assert [(v.suspicious, v.spike) for v in high] == [(True, False), (True, False)]
    assert not det.observe(6, 1.0).suspicious
    run = feed(det, [10.0, 10.0, 10.0], start=7)
    assert [v.spike for v in run] == [False, False, True]
    assert run[-1].steps == (7, 8, 9)
    assert det.loss_mean() == 1.0


def test_nan_and_inf_trigger_at_once_even_in_warmup() -> None:
    """NaN or inf in the loss or the gradient norm is a spike on the spot: before
    warmup ends and with persistence 5."""
    for loss, grad in [(math.nan, None), (math.inf, None), (1.0, math.nan), (1.0, -math.inf)]:
        det = LossSpikeDetector(SpikeConfig(persistence=5, warmup_steps=100))
        det.observe(0, 1.0, 1.0)
        verdict = det.observe(1, loss, grad)
        assert verdict.spike and verdict.steps == (1,), (loss, grad)
        assert verdict.reason.startswith("non-finite")


def test_warmup_and_non_positive_average_skip_the_factor_check() -> None:
    """During warmup a huge value is accepted; with a non-positive average (e.g. an
    RL loss) the factor check does not apply."""
    det = LossSpikeDetector(SpikeConfig(window=10, warmup_steps=3))
    assert not any(v.suspicious for v in feed(det, [1.0, 100.0, 1.0]))
    assert det.observe(3, 1000.0).spike  # warmup over: 1000 > 5 x 34
    neg = LossSpikeDetector(SpikeConfig(window=10, warmup_steps=1))
    feed(neg, [-1.0, -2.0])
    assert not neg.observe(2, 50.0).suspicious


def test_grad_norm_has_its_own_factor() -> None:
    """With grad_norm_factor 3, a gradient norm 4x its average is a spike while the
    loss is normal; without grad_norm_factor the same norm is accepted."""
    cfg = SpikeConfig(window=10, warmup_steps=2, grad_norm_factor=3.0)
    det = LossSpikeDetector(cfg)
    for i in range(3):
        det.observe(i, 1.0, 2.0)
    verdict = det.observe(3, 1.0, 8.01)
    assert verdict.spike and "grad norm 8.01 > 3 x moving average 2" in verdict.reason
    plain = LossSpikeDetector(SpikeConfig(window=10, warmup_steps=2))
    for i in range(3):
        plain.observe(i, 1.0, 2.0)
    assert not plain.observe(3, 1.0, 8.01).suspicious


def test_detector_state_round_trips_through_msgpack() -> None:
    """state_dict is plain data (msgpack round trip); a restored detector judges the
    following values exactly like the original, pending suspicious run included."""
    cfg = SpikeConfig(window=5, persistence=2, warmup_steps=2, grad_norm_factor=4.0)
    a = LossSpikeDetector(cfg)
    for i, v in enumerate([3.0, 2.0, 2.5, 2.0, 30.0]):
        a.observe(i, v, v / 2)
    state = msgpack.unpackb(msgpack.packb(a.state_dict()))
    b = LossSpikeDetector(cfg)
    b.load_state_dict(state)
    tail = [31.0, 2.0, 2.2, 40.0, 41.0, 1.9]
    assert [a.observe(5 + i, v, v / 2) for i, v in enumerate(tail)] == [
        b.observe(5 + i, v, v / 2) for i, v in enumerate(tail)
    ]
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 99})


def test_config_validation() -> None:
    """A factor of 1 or less would flag ordinary noise: refused."""
    with pytest.raises(ValueError, match="factor"):
        SpikeConfig(factor=1.0)
    with pytest.raises(ValueError, match="lr_scale"):
        RollbackConfig(lr_scale=1.5)


# -- policy ---------------------------------------------------------------------------


def test_policy_caps_rollbacks_within_the_step_window() -> None:
    """max 2 rollbacks within 100 executed steps: a third inside the window raises
    RollbackLimitError naming the cap and the earlier rollbacks; once the first
    rollback is 100 steps old it no longer counts."""
    policy = RollbackPolicy(RollbackConfig(max_rollbacks=2, within_steps=100))
    policy.allow(clock=10, step=10, reason="a", batch_ids=("b10",))
    policy.allow(clock=60, step=50, reason="b", batch_ids=("b50",))
    with pytest.raises(RollbackLimitError) as info:
        policy.allow(clock=109, step=99, reason="c", batch_ids=("b99",))
    msg = str(info.value)
    assert "rollback 3 within 100 executed steps" in msg and "allows 2" in msg
    assert "step 10 (a), step 50 (b)" in msg and "'b99'" in msg
    assert isinstance(info.value, TrainerClientError) and isinstance(info.value, RuntimeError)
    policy.allow(clock=110, step=100, reason="d", batch_ids=("b100",))
    assert policy.total_rollbacks == 3
    assert policy.skipped_batch_ids == ["b10", "b50", "b100"]


# -- SpikeGuard in a real training loop -------------------------------------------------

N_BATCHES = 40
CKPT_EVERY = 5
BASE_LR = 0.05


def make_batches(poison: dict[int, str]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Linear-regression batches; ``poison[i]`` = "spike" scales batch i's targets by
    1e4, "nan" puts a NaN into its inputs."""
    gen = torch.Generator().manual_seed(7)
    w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    batches = []
    for i in range(N_BATCHES):
        x = torch.randn(16, 4, generator=gen)
        y = x @ w_true
        if poison.get(i) == "spike":
            y = y * 1e4
        elif poison.get(i) == "nan":
            x = x.clone()
            x[0, 0] = math.nan
        batches.append((f"b{i:03d}", x, y))
    return batches


@dataclass
class Snapshot:
    pos: int
    step: int
    model: dict[str, torch.Tensor]
    optim: dict[str, Any]
    ledger: list[str]


@dataclass
class Run:
    model: torch.nn.Linear
    trained: list[str]
    rollbacks: list[tuple[int, tuple[BatchId, ...], int]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


def train(batches: list[tuple[str, torch.Tensor, torch.Tensor]], guard: SpikeGuard | None,
          *, grad_norm: bool = False) -> Run:
    """A real loop: checkpoint every CKPT_EVERY steps (in memory), observe the loss
    (and the gradient norm) after backward and before the optimizer step, roll back
    weights, optimizer and data position together."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    run = Run(model, [])

    def snapshot(pos: int, step: int) -> Snapshot:
        return Snapshot(pos, step, copy.deepcopy(model.state_dict()),
                        copy.deepcopy(opt.state_dict()), list(run.trained))

    ckpts = [snapshot(0, 0)]
    pos = step = 0
    while pos < len(batches):
        batch_id, x, y = batches[pos]
        if guard is not None and guard.is_skipped(batch_id):
            pos += 1  # consumed, never trained
            continue
        lr = BASE_LR * (guard.lr_scale if guard else 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        norm = None
        if grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        if guard is not None:
            decision = guard.observe(step, loss.item(), batch_id=batch_id, grad_norm=norm)
            if decision.action is Action.STOP:
                decision.raise_for_stop()
            if decision.action is Action.ROLLBACK:
                ck = ckpts[-1 - decision.checkpoints_back]
                model.load_state_dict(ck.model)
                opt.load_state_dict(ck.optim)
                pos, step, run.trained = ck.pos, ck.step, list(ck.ledger)
                run.rollbacks.append((decision.step, decision.skip_batch_ids, ck.step))
                continue
        opt.step()
        run.lrs.append(lr)
        run.trained.append(batch_id)
        pos += 1
        step += 1
        if step % CKPT_EVERY == 0:
            ckpts.append(snapshot(pos, step))
    return run


def guard_for(spikes: SpikeConfig | None = None, **rollback: Any) -> SpikeGuard:
    return SpikeGuard(LossSpikeDetector(spikes or SpikeConfig(window=20, warmup_steps=5)),
                      RollbackPolicy(RollbackConfig(**rollback)))


def test_injected_spike_rolls_back_and_is_never_trained() -> None:
    """A 1e4x target spike at batch 17 triggers a rollback to the step-15 checkpoint;
    batch 17 is recorded as skipped and never trained; every other batch is trained
    exactly once; and the final weights equal, bit for bit, a clean run over the data
    without batch 17 (the spike left no trace)."""
    batches = make_batches({17: "spike"})
    guard = guard_for()
    run = train(batches, guard)
    assert run.rollbacks == [(17, ("b017",), 15)]
    assert guard.skipped_batch_ids == ["b017"]
    expected = [b for b, _, _ in batches if b != "b017"]
    assert run.trained == expected
    clean = train([b for b in batches if b[0] != "b017"], None)
    assert torch.equal(run.model.weight, clean.model.weight)
    assert torch.equal(run.model.bias, clean.model.bias)


def test_nan_triggers_at_once_during_warmup() -> None:
    """A NaN input at batch 2 (still in warmup) rolls back at once to step 0 and the
    batch is skipped; the run ends with finite weights."""
    guard = guard_for()
    run = train(make_batches({2: "nan"}), guard)
    assert run.rollbacks == [(2, ("b002",), 0)]
    assert guard.skipped_batch_ids == ["b002"]
    assert "b002" not in run.trained and len(run.trained) == N_BATCHES - 1
    assert torch.isfinite(run.model.weight).all()


def test_cap_stops_a_loop_that_spikes_every_time() -> None:
    """When every batch from 12 on spikes, the guard rolls back twice (max 2) and the
    third spike stops the loop with RollbackLimitError instead of looping forever."""
    guard = guard_for(max_rollbacks=2, within_steps=1000)
    batches = make_batches({i: "spike" for i in range(12, N_BATCHES)})
    with pytest.raises(RollbackLimitError, match="rollback 3 within 1000 executed steps"):
        train(batches, guard)
    assert guard.skipped_batch_ids == ["b012", "b013"]
    assert guard.policy.total_rollbacks == 2


def test_lr_scale_applies_after_each_rollback() -> None:
    """With lr_scale 0.5, steps after the first rollback use half the learning rate,
    after the second a quarter."""
    guard = guard_for(lr_scale=0.5)
    run = train(make_batches({17: "spike", 27: "spike"}), guard)
    assert [r[1] for r in run.rollbacks] == [("b017",), ("b027",)]
    assert guard.lr_scale == 0.25
    assert run.lrs[:17] == [BASE_LR] * 17
    assert set(run.lrs[-1:]) == {BASE_LR * 0.25}
    assert BASE_LR * 0.5 in run.lrs


def test_guard_state_survives_a_restart() -> None:
    """SpikeGuard.state_dict (msgpack round trip) restores skipped IDs, LR scale and
    the rollback history, so a restarted run still skips the batch and still counts
    earlier rollbacks toward the cap."""
    guard = guard_for(max_rollbacks=1, lr_scale=0.5)
    train(make_batches({17: "spike"}), guard)
    state = msgpack.unpackb(msgpack.packb(guard.state_dict()))
    restored = guard_for(max_rollbacks=1, lr_scale=0.5)
    restored.load_state_dict(state)
    assert restored.is_skipped("b017") and restored.lr_scale == 0.5
    for step in range(30):
        assert restored.observe(100 + step, 1.0, batch_id=f"x{step}").action is Action.CONTINUE
    decision = restored.observe(130, math.nan, batch_id="bad")
    assert decision.action is Action.STOP
    assert isinstance(decision.error, RollbackLimitError)


def test_grad_norm_spike_rolls_back_in_the_loop() -> None:
    """With the loss check effectively off (factor 1e12), a batch whose inputs are
    scaled by 300 is caught by its gradient norm alone (factor 5) and rolled back;
    without grad-norm checking the same run trains it."""
    batches = make_batches({})
    bid, x, y = batches[23]
    batches[23] = (bid, x * 300.0, y)
    cfg = SpikeConfig(window=20, warmup_steps=5, factor=1e12, grad_norm_factor=5.0)
    guard = guard_for(cfg)
    run = train(batches, guard, grad_norm=True)
    assert [r[1] for r in run.rollbacks] == [("b023",)]
    assert "grad norm" in guard.policy.state_dict()["history"][0]["reason"]
    assert "b023" not in run.trained and len(run.trained) == N_BATCHES - 1
    blind = train(batches, guard_for(cfg), grad_norm=False)
    assert blind.rollbacks == [] and "b023" in blind.trained


def test_restart_mid_suspicious_run_keeps_the_batch_ids() -> None:
    """With persistence 2, a restart between the first and second high step still
    skips both batches when the spike fires after the restart."""
    cfg = SpikeConfig(window=10, warmup_steps=2, persistence=2)
    guard = guard_for(cfg)
    for i in range(4):
        guard.observe(i, 1.0, batch_id=f"ok{i}")
    assert guard.observe(4, 50.0, batch_id="hi4").action is Action.CONTINUE
    restarted = guard_for(cfg)
    restarted.load_state_dict(msgpack.unpackb(msgpack.packb(guard.state_dict())))
    decision = restarted.observe(5, 60.0, batch_id="hi5")
    assert decision.action is Action.ROLLBACK
    assert decision.skip_batch_ids == ("hi4", "hi5")
