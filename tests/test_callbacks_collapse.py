"""Tests for dapo_lightning.callbacks.collapse: the pure judge, detectors, actions, rollback,
state.

The hooks are driven directly. ``trainer`` is a SimpleNamespace stand-in (the hooks only read
``optimizers``, ``lr_scheduler_configs`` and ``strategy``, and set ``should_stop``); the
optimizer, scheduler, strategy and model in it are real. ``pl_module`` is a small stand-in
holding a real ``policy`` and recording ``log`` calls, because Lightning refuses ``log``
outside a running loop.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dapo_lightning.callbacks import DAPOCallback
from dapo_lightning.callbacks.collapse import (
    SIGNALS,
    CollapseDetector,
    Detector,
    SignalState,
    bad_here,
    ema_update,
    judge,
    judged_value,
    ngram_repetition,
    relative_drop,
    spike_ratio,
    step_readings,
    tally_rollouts,
)
from dapo_lightning.callbacks.snapshot import TrainingSnapshot, scale_lr
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.hooks import call_dapo_hook
from dapo_lightning.policy_state import PolicyState
from dapo_lightning.rollout.base import SamplingConfig
from tests._harness import fit


class RecordingModule:
    def __init__(self, policy: torch.nn.Module | None = None) -> None:
        self.policy = policy if policy is not None else torch.nn.Linear(2, 2)
        self.logged: dict[str, list[float]] = {}

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged.setdefault(name, []).append(float(value))


def make_trainer(optimizer=None, scheduler=None, strategy=None) -> SimpleNamespace:
    return SimpleNamespace(
        optimizers=[optimizer] if optimizer is not None else [],
        lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)] if scheduler else [],
        strategy=strategy or SingleDeviceStrategy(torch.device("cpu")),
        should_stop=False,
    )


def make_step(
    responses: list[list[int]],
    *,
    truncated: list[bool] | None = None,
    has_answer: list[bool] | None = None,
    stats: dict[str, float] | None = None,
) -> tuple[ScoredRollouts, RolloutBatch]:
    n = len(responses)
    rollouts = ScoredRollouts(
        prompt_ids=[[3, 4]] * n,
        response_ids=responses,
        rollout_log_probs=[[-1.0] * len(r) for r in responses],
        finish_reason=["length" if t else "stop" for t in (truncated or [False] * n)],
        group_index=torch.arange(n) // 2,
        prompt_uid=[str(i // 2) for i in range(n)],
        score=torch.arange(n).float(),
        acc=torch.zeros(n),
        sampling=SamplingConfig(max_tokens=64),
        extra={"has_answer": has_answer} if has_answer is not None else {},
    )
    batch = RolloutBatch.from_rollouts(rollouts, group_size=2, pad_token_id=0, stats=stats)
    return rollouts, batch


def drive(cb: CollapseDetector, trainer, module, stream: list) -> None:
    """Feed observations: ("update", metrics) or ("step", (rollouts, batch))."""
    for kind, item in stream:
        if kind == "update":
            cb.on_dapo_update(trainer, module, item)
        else:
            rollouts, batch = item
            cb.on_rollouts_scored(trainer, module, rollouts)
            cb.on_train_batch_end(trainer, module, None, batch, 0)


def updates(key: str, values: list[float]) -> list:
    base = {"entropy": 0.7, "grad_norm": 1.0, "approx_kl_k3": 0.01, "skipped_nonfinite": 0.0}
    return [
        ("update", {**base, key: v, "update": float(i + 1), "loss": 0.1})
        for i, v in enumerate(values)
    ]


def distinct(n: int = 4, length: int = 24) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 3 for j in range(length)] for i in range(n)]


def looping(n: int = 4, length: int = 24) -> list[list[int]]:
    return [[5, 6, 7] * (length // 3) for _ in range(n)]


STEP_STATS = {"generated_groups": 3.0, "kept_groups": 2.0, "zero_variance_frac": 0.33}

# signal -> (detector, healthy stream, unhealthy stream); every unhealthy stream is bad for
# at least `patience` consecutive observations at its end
CASES = {
    "entropy": (
        Detector("entropy", threshold=0.05, patience=3),
        updates("entropy", [0.7, 0.5, 0.3, 0.2, 0.1, 0.06, 0.3]),
        updates("entropy", [0.7, 0.3, 0.04, 0.01, 0.001]),
    ),
    "entropy_drop": (
        Detector("entropy_drop", threshold=0.5, patience=2, warmup=3, ema_decay=0.8),
        updates("entropy", [1.0, 1.05, 0.95, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),  # slow decline
        updates("entropy", [1.0, 1.05, 0.95, 1.0, 0.3, 0.2, 0.25]),  # sudden fall
    ),
    "grad_norm_spike": (
        Detector("grad_norm_spike", threshold=5.0, patience=2, warmup=3),
        updates("grad_norm", [1.0, 1.2, 0.8, 1.1, 3.0, 0.9, 1.0, 2.0]),
        updates("grad_norm", [1.0, 1.2, 0.8, 1.1, 30.0, 40.0]),
    ),
    "kl_spike": (
        Detector("kl_spike", threshold=10.0, patience=2, warmup=2, min_value=1e-3),
        # KL is ~0 on the first update of each step: tiny values must not count as spikes
        updates("approx_kl_k3", [0.0, 0.01, 0.0, 0.012, 1e-9, 0.0005, 0.02, 0.0]),
        updates("approx_kl_k3", [0.0, 0.01, 0.0, 0.012, 0.5, 0.8]),
    ),
    "nonfinite": (
        Detector("nonfinite", threshold=0.5, patience=3),
        updates("skipped_nonfinite", [0, 1, 1, 0, 1, 1, 0, 0]),
        updates("skipped_nonfinite", [0, 1, 1, 1]),
    ),
    "repetition": (
        Detector("repetition", threshold=0.5, patience=2, ngram=3, max_repeat=0.5),
        [("step", make_step(distinct(), stats=STEP_STATS))] * 4
        + [("step", make_step(distinct(2) + looping(2), stats=STEP_STATS))],  # share 0.5
        [("step", make_step(distinct(1) + looping(3), stats=STEP_STATS))] * 2,
    ),
    "format": (
        Detector("format", threshold=0.5, patience=2),
        [("step", make_step(distinct(), has_answer=[True, True, False, True]))] * 4,
        [("step", make_step(distinct(), has_answer=[False, False, False, True]))] * 2,
    ),
    "zero_variance": (
        Detector("zero_variance", threshold=0.9, patience=2),
        [("step", make_step(distinct(), stats={**STEP_STATS, "zero_variance_frac": 0.8}))] * 4,
        [("step", make_step(distinct(), stats={**STEP_STATS, "zero_variance_frac": 0.97}))] * 2,
    ),
    "oversampling": (
        Detector("oversampling", threshold=4.0, patience=2),
        [("step", make_step(distinct(), stats={**STEP_STATS, "generated_groups": 8.0}))] * 4,
        [("step", make_step(distinct(), stats={**STEP_STATS, "generated_groups": 10.0}))] * 2,
    ),
    "length_low": (
        Detector("length_low", threshold=5.0, patience=2),
        [("step", make_step(distinct(length=6)))] * 4,
        [("step", make_step(distinct(length=2)))] * 2,
    ),
    "length_high": (
        Detector("length_high", threshold=50.0, patience=2),
        [("step", make_step(distinct(length=48)))] * 4,
        [("step", make_step(distinct(length=60)))] * 2,
    ),
    "truncation": (
        Detector("truncation", threshold=0.5, patience=2),
        [("step", make_step(distinct(), truncated=[True, False, True, False]))] * 4,
        [("step", make_step(distinct(), truncated=[True, True, True, False]))] * 2,
    ),
}


def test_every_signal_has_a_case() -> None:
    from typing import get_args

    from dapo_lightning.callbacks.collapse import Signal

    assert set(CASES) == set(get_args(Signal)) == set(SIGNALS)


@pytest.mark.parametrize("signal", sorted(CASES))
def test_detector_silent_on_healthy_stream(signal: str) -> None:
    det, healthy, _ = CASES[signal]
    cb = CollapseDetector([copy.deepcopy(det)])
    module = RecordingModule()
    drive(cb, make_trainer(), module, healthy)
    assert cb.fired[det.name] == 0
    assert len(module.logged[f"collapse/{det.name}"]) > 0  # it did observe and log values


@pytest.mark.parametrize("signal", sorted(CASES))
def test_detector_fires_on_unhealthy_stream(signal: str) -> None:
    det, _, unhealthy = CASES[signal]
    cb = CollapseDetector([copy.deepcopy(det)])
    module = RecordingModule()
    with pytest.warns(UserWarning, match=f"{det.name} fired"):
        drive(cb, make_trainer(), module, unhealthy)
    assert cb.fired[det.name] == 1
    if det.signal in ("repetition", "format", "zero_variance", "oversampling") or "length" in (
        det.signal
    ):
        assert module.logged[f"collapse/fired_{det.name}"][-1] == 1.0


def test_patience_needs_consecutive_bad_observations() -> None:
    cb = CollapseDetector([Detector("entropy", threshold=0.1, patience=3)])
    module, trainer = RecordingModule(), make_trainer()
    drive(cb, trainer, module, updates("entropy", [0.05, 0.05, 0.5, 0.05, 0.05, 0.5]))
    assert cb.fired["entropy"] == 0
    with pytest.warns(UserWarning):
        drive(cb, trainer, module, updates("entropy", [0.05] * 7))
    assert cb.fired["entropy"] == 2  # fires, the count restarts, fires again after 3 more


def test_stop_action_sets_should_stop_and_keeps_the_reason() -> None:
    cb = CollapseDetector([Detector("nonfinite", threshold=0.5, patience=2, action="stop")])
    trainer = make_trainer()
    drive(cb, trainer, RecordingModule(), updates("skipped_nonfinite", [1.0]))
    assert not trainer.should_stop and cb.stop_reason is None
    with pytest.warns(UserWarning, match="Stopping training"):
        drive(cb, trainer, RecordingModule(), updates("skipped_nonfinite", [1.0]))
    assert trainer.should_stop
    assert "nonfinite fired" in cb.stop_reason


def test_pure_functions() -> None:
    assert ngram_repetition([1, 2, 3, 4, 5], n=2) == 0.0
    assert ngram_repetition([1, 2, 1, 2, 1, 2], n=2) == pytest.approx(1 - 2 / 5)
    assert ngram_repetition([9] * 11, n=3) == pytest.approx(1 - 1 / 9)
    assert ngram_repetition([1, 2], n=4) == 0.0
    assert ema_update(None, 3.0, 0.9) == 3.0
    assert ema_update(2.0, 4.0, 0.75) == pytest.approx(2.5)
    assert relative_drop(0.25, 1.0) == 0.75 and relative_drop(1.0, 0.0) == 0.0
    assert spike_ratio(10.0, 2.0) == 5.0 and math.isfinite(spike_ratio(1.0, 0.0))


# ------------------------------------------------------------------- the pure judge


def test_signal_table_holds_sources_directions_and_ema() -> None:
    assert {s for s, spec in SIGNALS.items() if spec.source == "update"} == {
        "entropy",
        "entropy_drop",
        "grad_norm_spike",
        "kl_spike",
        "nonfinite",
    }
    assert {s for s, spec in SIGNALS.items() if spec.bad_when == "below"} == {
        "entropy",
        "length_low",
    }
    assert {s for s, spec in SIGNALS.items() if spec.relative is not None} == {
        "entropy_drop",
        "grad_norm_spike",
        "kl_spike",
    }
    assert SIGNALS["kl_spike"].reading == "approx_kl_k3"


def test_judge_bad_below_and_above_the_threshold() -> None:
    low = Detector("entropy", threshold=0.1, patience=2)
    assert judge(low, 0.05, SignalState()) == (SignalState(streak=1), False, None)
    assert judge(low, 0.1, SignalState(streak=1)) == (SignalState(streak=0), False, None)
    assert judge(low, 0.5, SignalState(streak=1)) == (SignalState(streak=0), False, None)
    high = Detector("length_high", threshold=50.0)
    assert judge(high, 40.0, SignalState()) == (SignalState(), False, None)
    assert judge(high, 60.0, SignalState()) == (
        SignalState(streak=0),
        True,
        "length_high fired (value 60.0, threshold 50.0, 1 consecutive bad observations).",
    )


def test_judge_patience_counts_consecutive_bad_observations() -> None:
    det = Detector("truncation", threshold=0.5, patience=3)
    state, streaks, fired = SignalState(), [], []
    # bad, bad, not observed (leaves the streak), bad: fires; bad again starts a new streak
    for raw in (0.9, 0.8, None, 0.7, 0.9, 0.1):
        state, did_fire, _ = judge(det, raw, state)
        streaks.append(state.streak)
        fired.append(did_fire)
    assert streaks == [1, 2, 2, 0, 1, 0]
    assert fired == [False, False, False, True, False, False]


def test_judge_ema_warm_up_then_relative_to_healthy_ema() -> None:
    det = Detector("grad_norm_spike", threshold=5.0, warmup=2, ema_decay=0.5)
    s1, fired, _ = judge(det, 1.0, SignalState())
    assert (s1, fired) == (SignalState(ema=1.0, seen=1), False)
    assert judged_value(det, 100.0, s1) is None  # still warming up: never bad
    s2, fired, _ = judge(det, 3.0, s1)
    assert (s2, fired) == (SignalState(ema=2.0, seen=2), False)
    assert judged_value(det, 4.0, s2) == 2.0
    assert judge(det, 4.0, s2)[:2] == (SignalState(ema=3.0, seen=3), False)
    spiked, fired, reason = judge(det, 20.0, s2)  # ratio 10: bad, and kept out of the EMA
    assert (spiked, fired) == (SignalState(ema=2.0, seen=3), True)
    assert reason.startswith("grad_norm_spike fired (value 10.0, threshold 5.0")
    assert judge(det, None, s2) == (s2, False, None)

    drop = Detector("entropy_drop", threshold=0.5, warmup=0, ema_decay=0.9)
    d1 = judge(drop, 1.0, SignalState())[0]  # the first reading only starts the EMA
    assert d1 == SignalState(ema=1.0, seen=1)
    assert judged_value(drop, 0.4, d1) == pytest.approx(0.6)
    assert judge(drop, 0.4, d1)[1] is True
    d2, fired, _ = judge(drop, 0.8, d1)
    assert not fired and d2.ema == pytest.approx(0.98) and d2.seen == 2


def test_judge_min_value_floors_spikes_only() -> None:
    kl = Detector("kl_spike", threshold=10.0, warmup=1, min_value=1e-3)
    state = SignalState(ema=1e-6, seen=1)
    assert judged_value(kl, 5e-4, state) == pytest.approx(500.0)
    assert not bad_here(kl, 5e-4, state)  # a large ratio of a tiny KL is not a spike
    healthy, fired, _ = judge(kl, 5e-4, state)
    assert not fired and healthy.ema == pytest.approx(0.9e-6 + 0.1 * 5e-4)
    assert judge(kl, 0.01, state)[:2] == (SignalState(ema=1e-6, seen=2), True)
    entropy = Detector("entropy", threshold=0.1, min_value=1.0)  # no floor for entropy
    assert bad_here(entropy, 0.05, SignalState())


def test_judge_counts_a_bad_observation_on_another_rank() -> None:
    det = Detector("format", threshold=0.5, patience=2)
    state, fired, _ = judge(det, None, SignalState(), bad_elsewhere=True)
    assert (state, fired) == (SignalState(streak=1), False)
    assert "not observed here, bad on another rank" in judge(det, None, state, True)[2]
    state, fired, reason = judge(det, 0.1, state, bad_elsewhere=True)
    assert (state, fired) == (SignalState(streak=0), True)
    assert "value 0.1 here, bad on another rank" in reason


def test_step_readings_from_batch_and_tallied_rollouts() -> None:
    rollouts, batch = make_step(
        distinct(1) + looping(3),
        truncated=[True, False, False, False],
        has_answer=[True, False, True, False],
        stats=STEP_STATS,
    )
    pending = tally_rollouts({}, rollouts, [Detector("repetition", 0.5, ngram=3, name="rep")])
    assert pending == {"responses": 4, "repetitive/rep": 3, "format_seen": 4, "no_answer": 2}
    assert step_readings(batch, pending) == {
        "zero_variance_frac": pytest.approx(0.33),
        "oversampling": 1.5,
        "response_length_mean": 24.0,
        "truncated_share": 0.25,
        "no_answer_share": 0.5,
        "repetitive_share/rep": 0.75,
    }
    _, starved = make_step(distinct(), stats={"generated_groups": 3.0, "kept_groups": 0.0})
    assert step_readings(starved, {})["oversampling"] == math.inf
    logged_names = SimpleNamespace(stats={"data/zero_variance_frac": 0.5, "data/kept_groups": 2})
    assert step_readings(logged_names, {}) == {"zero_variance_frac": 0.5}


class CountingStrategy:
    """Records each ``reduce_boolean_decision`` call; ``others_bad`` plays another rank."""

    def __init__(self, others_bad: bool = False) -> None:
        self.calls: list[bool] = []
        self.others_bad = others_bad

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        assert all is False  # any rank bad = bad
        self.calls.append(decision)
        return decision or self.others_bad


def test_every_rank_agrees_once_per_detector_even_with_nothing_observed() -> None:
    dets = [
        Detector("entropy", threshold=0.1),
        Detector("grad_norm_spike", threshold=5.0),
        Detector("format", threshold=0.5, action="stop"),
        Detector("length_high", threshold=50.0),
    ]
    cb, quiet = CollapseDetector(copy.deepcopy(dets)), CountingStrategy()
    module = RecordingModule()
    cb.on_dapo_update(make_trainer(strategy=quiet), module, {"update": 1.0})  # no readings
    cb.on_train_batch_end(make_trainer(strategy=quiet), module, None, SimpleNamespace(), 0)
    assert quiet.calls == [False, False, False, False]
    assert sum(cb.fired.values()) == 0

    other = CollapseDetector(copy.deepcopy(dets))
    trainer = make_trainer(strategy=CountingStrategy(others_bad=True))
    with pytest.warns(UserWarning, match="bad on another rank"):
        other.on_dapo_update(trainer, module, {"update": 1.0})
        other.on_train_batch_end(trainer, module, None, SimpleNamespace(), 0)
    assert other.fired == {"entropy": 1, "grad_norm_spike": 1, "format": 1, "length_high": 1}
    assert trainer.should_stop and "format fired" in other.stop_reason


def test_collapse_detector_receives_the_dapo_hooks() -> None:
    assert isinstance(CollapseDetector(), DAPOCallback)


def test_detector_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="Detector.signal"):
        Detector("entropyy", threshold=0.1)
    with pytest.raises(ValueError, match="Detector.action"):
        Detector("entropy", threshold=0.1, action="explode")
    with pytest.raises(ValueError, match="Detector.patience"):
        Detector("entropy", threshold=0.1, patience=0)
    with pytest.raises(ValueError, match="names must be unique"):
        CollapseDetector([Detector("entropy", 0.1), {"signal": "entropy", "threshold": 0.2}])
    with pytest.raises(ValueError, match="rollback_lr_scale"):
        CollapseDetector([], rollback_lr_scale=0.0)


# ------------------------------------------------------------------------- rollback


def _tiny_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(policy.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return policy, opt, sched


def _train_update(policy, opt, sched) -> None:
    x = torch.randn(8, 4)
    opt.zero_grad()
    policy(x).pow(2).mean().backward()
    opt.step()
    sched.step()


def assert_same(a: Any, b: Any) -> None:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def _state(policy, opt, sched) -> dict:
    return copy.deepcopy(
        {"policy": policy.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    )


def test_snapshot_restores_bit_exactly_and_shares_no_storage() -> None:
    policy, opt, sched = _tiny_setup()
    for _ in range(2):
        _train_update(policy, opt, sched)
    snap, taken = TrainingSnapshot.take(policy, opt, sched), _state(policy, opt, sched)
    for _ in range(2):
        _train_update(policy, opt, sched)
    snap.restore(policy, opt, sched)
    assert_same(_state(policy, opt, sched), taken)
    _train_update(policy, opt, sched)  # training on must not change the snapshot
    TrainingSnapshot.from_state_dict(snap.state_dict()).restore(policy, opt, sched, lr_scale=0.5)
    got = _state(policy, opt, sched)
    assert_same(got["policy"], taken["policy"])
    assert_same(got["opt"]["state"], taken["opt"]["state"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * taken["opt"]["param_groups"][0]["lr"])
    assert sched.base_lrs == [pytest.approx(0.05)]
    with pytest.raises(ValueError, match="lr_scale"):
        snap.restore(policy, opt, sched, lr_scale=0.0)


def test_scale_lr_scales_optimizer_and_scheduler_for_good() -> None:
    policy, opt, sched = _tiny_setup()
    scale_lr(opt, sched, 0.25)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert sched.get_last_lr() == [pytest.approx(0.025)]
    _train_update(policy, opt, sched)  # LambdaLR: base_lr / (1 + step)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025 / 2)


def test_rollback_bumps_policy_version_so_the_engine_gets_the_weights() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    module.policy_state = PolicyState(version=7)
    cb = CollapseDetector([Detector("nonfinite", threshold=0.5, action="rollback")])
    cb.on_train_start(trainer, module)
    drive(cb, trainer, module, updates("skipped_nonfinite", [1.0]))
    assert cb.rollbacks == 1 and module.policy_state.version == 8


def test_rollback_of_a_module_without_a_policy_state_restores_the_weights_only() -> None:
    """A module that is no DAPOModule (no ``policy_state``, no engine to push to): the
    rollback restores the snapshot and bumps nothing (the documented no-op)."""
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    cb = CollapseDetector([Detector("nonfinite", threshold=0.5, action="rollback")])
    cb.on_train_start(trainer, module)
    start = [p.detach().clone() for p in policy.parameters()]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    drive(cb, trainer, module, updates("skipped_nonfinite", [1.0]))
    assert cb.rollbacks == 1 and not hasattr(module, "policy_state")
    assert all(torch.equal(p, s) for p, s in zip(policy.parameters(), start))


def test_rollback_without_snapshot_stops() -> None:
    cb = CollapseDetector([Detector("nonfinite", threshold=0.5, action="rollback")])
    trainer = make_trainer()
    with pytest.warns(UserWarning, match="No healthy snapshot"):
        drive(cb, trainer, RecordingModule(), updates("skipped_nonfinite", [1.0]))
    assert trainer.should_stop and cb.rollbacks == 0


def test_rollback_restores_weights_and_optimizer_bit_exactly() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    det = Detector("grad_norm_spike", threshold=5.0, patience=2, warmup=2, action="rollback")
    cb = CollapseDetector([det], snapshot_every=2, rollback_lr_scale=0.5)
    cb.on_train_start(trainer, module)
    healthy = {"grad_norm": 1.0, "entropy": 0.5, "approx_kl_k3": 0.0, "skipped_nonfinite": 0.0}
    for k in range(1, 6):  # 5 healthy updates: snapshots after updates 2 and 4
        _train_update(policy, opt, sched)
        cb.on_dapo_update(trainer, module, {**healthy, "update": float(k)})
        if k == 4:
            expected = _state(policy, opt, sched)
    for k in (6, 7):  # two spikes: the second fires the rollback
        _train_update(policy, opt, sched)
        cb.on_dapo_update(trainer, module, {**healthy, "grad_norm": 100.0, "update": float(k)})
    assert cb.rollbacks == 1 and cb.fired["grad_norm_spike"] == 1
    got = _state(policy, opt, sched)
    assert_same(got["policy"], expected["policy"])
    assert_same(got["opt"]["state"], expected["opt"]["state"])
    # the learning rate was scaled down, in the optimizer and in the scheduler
    lr4 = expected["opt"]["param_groups"][0]["lr"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * lr4)
    assert sched.base_lrs == [pytest.approx(0.05)]
    assert sched.last_epoch == expected["sched"]["last_epoch"]
    _train_update(policy, opt, sched)  # the next scheduler step keeps the scale
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / (1 + sched.last_epoch))

    # training on after the rollback must not leak into the snapshot (no shared storage)
    restored = got
    for k in (9, 10):
        _train_update(policy, opt, sched)
        cb.on_dapo_update(trainer, module, {**healthy, "grad_norm": 100.0, "update": float(k)})
    assert cb.rollbacks == 2
    again = _state(policy, opt, sched)
    assert_same(again["policy"], restored["policy"])
    assert_same(again["opt"]["state"], restored["opt"]["state"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25 * lr4)  # scales compound


def test_an_update_on_which_a_detector_fires_is_never_snapshotted() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    dets = [
        Detector("entropy", threshold=0.1, patience=1, action="warn"),
        Detector("nonfinite", threshold=0.5, patience=1, action="rollback"),
    ]
    cb = CollapseDetector(dets, snapshot_every=1)
    cb.on_train_start(trainer, module)
    _train_update(policy, opt, sched)
    drive(cb, trainer, module, updates("entropy", [0.5]))  # healthy: snapshot
    after_healthy = _state(policy, opt, sched)
    _train_update(policy, opt, sched)
    with pytest.warns(UserWarning, match="entropy fired"):
        drive(cb, trainer, module, updates("entropy", [0.01]))  # fires: no snapshot
    _train_update(policy, opt, sched)
    drive(cb, trainer, module, updates("skipped_nonfinite", [1.0]))  # rollback
    assert cb.rollbacks == 1
    assert_same(_state(policy, opt, sched)["policy"], after_healthy["policy"])


def test_rollback_falls_back_to_stop_after_max_rollbacks() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    cb = CollapseDetector(
        [Detector("nonfinite", threshold=0.5, patience=1, action="rollback")], max_rollbacks=1
    )
    cb.on_train_start(trainer, module)
    drive(cb, trainer, module, updates("skipped_nonfinite", [1.0]))
    assert cb.rollbacks == 1 and not trainer.should_stop
    with pytest.warns(UserWarning, match="max_rollbacks=1 reached"):
        drive(cb, trainer, module, updates("skipped_nonfinite", [1.0]))
    assert trainer.should_stop and "max_rollbacks" in cb.stop_reason


def test_step_detector_rolls_back_at_batch_end() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    cb = CollapseDetector([Detector("length_high", threshold=50.0, action="rollback")])
    cb.on_train_start(trainer, module)
    start = _state(policy, opt, sched)
    _train_update(policy, opt, sched)
    drive(cb, trainer, module, [("step", make_step(distinct(length=60)))])
    assert cb.rollbacks == 1
    assert_same(_state(policy, opt, sched)["policy"], start["policy"])


# ---------------------------------------------------------------------------- state


def test_state_round_trip_continues_identically() -> None:
    dets = [
        Detector("entropy_drop", threshold=0.4, patience=2, warmup=2),
        Detector("grad_norm_spike", threshold=5.0, patience=3, warmup=2),
        Detector("repetition", threshold=0.4, patience=2),
        Detector("format", threshold=0.5, patience=3),
    ]
    a = CollapseDetector(copy.deepcopy(dets))
    first = updates("entropy", [1.0, 0.9, 1.1, 0.5]) + [
        ("step", make_step(distinct(1) + looping(3), has_answer=[False] * 4))
    ]
    second = (
        updates("entropy", [0.4, 0.45, 1.0])
        + [("step", make_step(looping(), has_answer=[False, False, True, False]))] * 3
        + updates("grad_norm", [9.0, 9.0, 9.0, 1.0])
    )
    trainer, module = make_trainer(), RecordingModule()
    drive(a, trainer, module, first)
    a.on_rollouts_scored(trainer, module, make_step(looping())[0])  # stashed mid-step
    b = CollapseDetector(copy.deepcopy(dets))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.state_dict() == a.state_dict()
    with pytest.warns(UserWarning):
        drive(a, trainer, module, second)
    with pytest.warns(UserWarning):
        drive(b, trainer, module, second)
    assert b.state_dict() == a.state_dict()
    assert sum(a.fired.values()) >= 3


def test_snapshot_kept_in_checkpoint_only_when_asked() -> None:
    policy, opt, sched = _tiny_setup()
    module, trainer = RecordingModule(policy), make_trainer(opt, sched)
    det = Detector("nonfinite", threshold=0.5, action="rollback")
    small, full = CollapseDetector([det]), CollapseDetector([det], snapshot_in_checkpoint=True)
    for cb in (small, full):
        cb.on_train_start(trainer, module)
    assert "snapshot" not in small.state_dict()
    restored = CollapseDetector([det], snapshot_in_checkpoint=True)
    restored.load_state_dict(full.state_dict())
    assert_same(restored.snapshot.policy, full.snapshot.policy)


def test_built_from_yaml_by_jsonargparse() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    cfg = parser.parse_string(
        """
callbacks:
  - class_path: dapo_lightning.callbacks.CollapseDetector
    init_args:
      snapshot_every: 5
      rollback_lr_scale: 0.5
      detectors:
        - {signal: entropy, threshold: 0.05, patience: 5, action: stop}
        - {signal: kl_spike, threshold: 20.0, min_value: 0.001, name: kl}
"""
    )
    (cb,) = parser.instantiate(cfg).callbacks
    assert isinstance(cb, CollapseDetector)
    assert [d.name for d in cb.detectors] == ["entropy", "kl"]
    assert cb.detectors[0].action == "stop" and cb.detectors[1].min_value == 0.001
    assert cb.snapshot_every == 5 and cb.rollback_lr_scale == 0.5


# ------------------------------------------------------------------ real Trainer.fit


class SpikyDAPOLike(LightningModule):
    """Trivial module following the DAPOModule contract (manual optimization, on_dapo_update
    after every optimizer update, ``policy`` attribute); reports a grad-norm spike from
    update ``spike_from`` on, as a collapsing run would."""

    def __init__(self, spike_from: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = torch.nn.Linear(4, 2)
        self.spike_from = spike_from
        self.updates = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.policy(batch).pow(2).mean())
        opt.step()
        self.updates += 1
        grad_norm = 100.0 if self.updates >= self.spike_from else 1.0
        metrics = {"update": float(self.updates), "grad_norm": grad_norm, "entropy": 0.5}
        call_dapo_hook(self.trainer, "on_dapo_update", metrics)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), batch_size=2
        )


def test_real_trainer_rolls_back_logs_and_checkpoints_state(tmp_path) -> None:
    torch.manual_seed(0)
    det = Detector("grad_norm_spike", threshold=5.0, patience=2, warmup=2, action="rollback")
    stop = Detector("entropy", threshold=0.6, patience=100, action="stop")  # bad, never fires
    cb = CollapseDetector([det, stop], snapshot_every=1, rollback_lr_scale=0.5)
    module = SpikyDAPOLike(spike_from=5)
    trainer = fit(
        module, None, [cb, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        default_root_dir=tmp_path, max_steps=8, max_epochs=None, enable_checkpointing=True,
    )  # fmt: skip
    # spikes from update 5: rollbacks after updates 6 and 8, to the state after update 4
    assert cb.rollbacks == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)
    assert trainer.logged_metrics["collapse/fired_grad_norm_spike"].item() == 2.0
    assert trainer.logged_metrics["collapse/grad_norm_spike"].item() == pytest.approx(100.0)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    assert saved[cb.state_key]["fired"] == {"grad_norm_spike": 2, "entropy": 0}
    assert saved[cb.state_key]["rollbacks"] == 2
    assert saved[cb.state_key]["streak"]["entropy"] == 0  # a rollback clears every streak


# ------------------------------------------------------------------- two gloo ranks


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(rank)
    strategy = DDPStrategy(
        parallel_devices=[torch.device("cpu")] * 2,
        cluster_environment=env,
        process_group_backend="gloo",
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cb = CollapseDetector(
            [
                Detector("entropy", threshold=0.1, patience=2),
                Detector("format", threshold=0.5, patience=1, action="stop"),
            ]
        )
        trainer, module = make_trainer(strategy=strategy), RecordingModule()
        # only rank 0 sees the entropy collapse
        entropy = [0.01, 0.01] if rank == 0 else [0.5, 0.5]
        drive(cb, trainer, module, updates("entropy", entropy))
        # only rank 1 has has_answer information (and it is all missing answers)
        has_answer = None if rank == 0 else [False] * 4
        drive(cb, trainer, module, [("step", make_step(distinct(), has_answer=has_answer))])
        torch.save(
            {"fired": cb.fired, "should_stop": trainer.should_stop},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow  # two spawned interpreters importing torch + lightning: ~30 s on 2 busy cores
def test_ranks_fire_together(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["fired"] == {"entropy": 1, "format": 1}
        assert result["should_stop"]
