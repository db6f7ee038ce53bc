"""Numeric guards and safe defaults.

- A non-finite loss (NaN reward -> NaN advantages; a poisoned engine log-prob under TIS) or a
  non-finite gradient norm skips the update: weights and optimizer state unchanged, the skip
  counted (``skipped_updates``) and logged (``update/skipped_nonfinite``), and repeated skips
  reach ``CollapseDetector``'s "nonfinite" detector, whose default action stops training.
- ``trust_remote_code`` is never turned on, and rewards named in configs are scored in worker
  processes with a timeout by default.
"""

from __future__ import annotations

import csv
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _module_harness import FixedBatches, fixed_batch, sgd
from dapo_lightning.callbacks import CollapseDetector
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from dapo_lightning import DAPODataModule, DAPOModule, DynamicSamplingConfig, SamplingConfig
from dapo_lightning.batch import RolloutBatch
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig
from dapo_lightning.loss import PolicyLossConfig
from dapo_lightning.rollout_correction import RolloutCorrection
from dapo_lightning.update import BatchingConfig
from tests._harness import fit

TIS_2 = PolicyLossConfig(rollout_correction=RolloutCorrection("token_truncate", clip_max=2.0))


class UpdateRecorder:
    """Records the metrics of every ``on_dapo_update`` call (a plain DAPO hook holder)."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_dapo_update(self, trainer: Any, pl_module: Any, metrics: dict[str, float]) -> None:
        self.metrics.append(dict(metrics))


def _fit(
    checkpoint: Path,
    batch: RolloutBatch,
    tmp_path: Path,
    *,
    steps: int,
    callbacks: list[Any] = (),
    module_setup: Any = None,
    **module_kw: Any,
) -> tuple[DAPOModule, dict[str, torch.Tensor], Trainer]:
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        optimizer=sgd, batching=BatchingConfig(micro_batch_size=8), parity_check_every=0
    )
    kw.update(module_kw)
    module = DAPOModule(str(checkpoint), **kw)
    module.configure_model()
    if module_setup is not None:
        module_setup(module)
    before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    from dapo_lightning.callbacks import DAPOCallback

    class Hooks(DAPOCallback):  # the library calls DAPO hooks on DAPOCallbacks; forward it
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def on_dapo_update(self, *args: Any) -> None:
            self.inner.on_dapo_update(*args)

    trainer = fit(
        module, FixedBatches(batch, steps=steps),
        [c if hasattr(c, "setup") else Hooks(c) for c in callbacks],
        max_steps=-1, logger=CSVLogger(tmp_path, name="logs"), log_every_n_steps=1,
        num_sanity_val_steps=0,
    )  # fmt: skip
    return module, before, trainer


def _logged(trainer: Trainer, key: str) -> list[float]:
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with open(path) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key) not in (None, "")]


def _unchanged(module: DAPOModule, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())


def _poisoned_batch() -> RolloutBatch:
    """A NaN sampled-token log-prob from the engine: it enters the loss through the TIS weight
    ``min(pi_old / pi_rollout, cap)`` (run with token truncation at 2.0)."""
    batch = fixed_batch()
    batch.rollout_log_probs = batch.rollout_log_probs.clone()
    batch.rollout_log_probs[3, 0] = float("nan")
    return batch


def test_nan_reward_is_refused_with_a_clear_error(tiny_checkpoint, tmp_path):
    """A NaN reward never reaches the loss: the advantage step names it."""
    batch = fixed_batch()
    batch.reward = batch.reward.clone()
    batch.reward[0] = float("nan")
    with pytest.raises(
        ValueError, match=r"rewards must be finite; non-finite values at indices \[0\]"
    ):
        _fit(tiny_checkpoint, batch, tmp_path, steps=1)


def test_nonfinite_loss_skips_update(tiny_checkpoint, tmp_path):
    rec = UpdateRecorder()
    module, before, trainer = _fit(
        tiny_checkpoint, _poisoned_batch(), tmp_path, steps=2, callbacks=[rec], loss=TIS_2
    )
    assert _unchanged(module, before)  # the weights were not corrupted
    # skipped updates change no weight: the policy version (weights applied) stays 0
    assert module.skipped_updates == 2 and module.policy_version == 0
    assert [m["skipped_nonfinite"] for m in rec.metrics] == [1.0, 1.0]
    assert not torch.isfinite(torch.tensor(rec.metrics[0]["loss"]))
    assert _logged(trainer, "update/skipped_nonfinite") == [1.0, 1.0]
    assert _logged(trainer, "update/skipped_total")[-1] == 2.0
    assert not any(p.grad is not None for p in module.policy.parameters())  # grads dropped


def test_nonfinite_grad_norm_skips_update(tiny_checkpoint, tmp_path):
    """Finite loss, infinite gradient (a fault injected with a gradient hook on one weight)."""

    def poison(module: DAPOModule) -> None:
        weight = module.policy.model.layers[0].mlp.up_proj.weight
        weight.register_hook(lambda g: g * float("inf"))

    rec = UpdateRecorder()
    module, before, _ = _fit(
        tiny_checkpoint, fixed_batch(), tmp_path, steps=1, callbacks=[rec], module_setup=poison
    )
    assert _unchanged(module, before) and module.skipped_updates == 1
    assert torch.isfinite(torch.tensor(rec.metrics[0]["loss"]))
    assert not torch.isfinite(torch.tensor(rec.metrics[0]["grad_norm"]))
    opt_state = module.trainer.optimizers[0].state
    assert all(not s for s in opt_state.values())  # no optimizer step happened


def test_healthy_batch_is_not_skipped(tiny_checkpoint, tmp_path):
    """Negative control: the same run on finite data updates the weights."""
    module, before, trainer = _fit(tiny_checkpoint, fixed_batch(), tmp_path, steps=1)
    assert not _unchanged(module, before) and module.skipped_updates == 0
    assert _logged(trainer, "update/skipped_nonfinite") == [0.0]


def test_repeated_skips_reach_collapse_detector_and_stop(tiny_checkpoint, tmp_path):
    detector = CollapseDetector()  # default detectors: nonfinite, patience 3, action stop
    module, before, trainer = _fit(
        tiny_checkpoint, _poisoned_batch(), tmp_path, steps=10, callbacks=[detector], loss=TIS_2
    )
    assert detector.fired["nonfinite"] == 1
    assert "nonfinite" in detector.stop_reason
    assert trainer.should_stop and module.rollout_step == 3  # stopped after 3 of 10 steps
    assert module.skipped_updates == 3 and _unchanged(module, before)
    assert _logged(trainer, "collapse/fired_nonfinite")[-1] == 1.0


def test_skip_nonfinite_off_lets_nan_through(tiny_checkpoint, tmp_path):
    """Negative control: with the guard off, the NaN reaches the weights."""
    module, _, _ = _fit(
        tiny_checkpoint,
        _poisoned_batch(),
        tmp_path,
        steps=1,
        optimizer_step=dict(skip_nonfinite=False),
        loss=TIS_2,
    )
    assert module.skipped_updates == 0
    assert any(not torch.isfinite(p).all() for p in module.policy.parameters())


# ----------------------------------------------------------------------------- safe defaults


def test_trust_remote_code_is_never_enabled(tiny_checkpoint, monkeypatch):
    """Every ``from_pretrained`` the module and data module make gets trust_remote_code off."""
    import transformers

    calls: list[dict[str, Any]] = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            calls.append(kwargs)
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    DAPOModule(str(tiny_checkpoint), loss=PolicyLossConfig(kl_coef=0.0)).configure_model()
    dm = DAPODataModule(
        str(tiny_checkpoint),
        prompts=PromptConfig(
            task="arithmetic",
            task_kwargs={"num_prompts": 4},
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        scoring=ScoringConfig(in_process=True),
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(n=2, train_batch_size=2),
    )
    dm.setup("fit")
    assert len(calls) == 2
    assert all(not kw.get("trust_remote_code", False) for kw in calls)


def test_no_source_file_enables_trust_remote_code():
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("dapo_lightning", "callbacks", "configs"):
        for path in (root / folder).rglob("*"):
            if path.suffix not in (".py", ".yaml", ".yml") or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8")
            for line in text.splitlines():
                low = line.replace(" ", "").lower()
                if "trust_remote_code=true" in low or "trust_remote_code:true" in low:
                    offenders.append(f"{path.relative_to(root)}: {line.strip()}")
    assert not offenders, offenders


def test_rewards_run_in_worker_processes_with_timeout_by_default(tiny_checkpoint):
    sig = inspect.signature(DAPODataModule.__init__).parameters
    assert sig["scoring"].default.in_process is False
    assert sig["scoring"].default.timeout_s > 0
    dm = DAPODataModule(
        str(tiny_checkpoint),
        prompts=PromptConfig(
            task="arithmetic",
            task_kwargs={"num_prompts": 4},
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        reward="arithmetic",
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(n=2, train_batch_size=2),
    )
    dm.setup("fit")
    runner = dm.reward_runner
    try:
        assert runner.in_process is False and runner.timeout_s == dm.scoring.timeout_s
        results = runner.score(["7", "3"], ["7", "8"])
        assert [r.acc for r in results] == [True, False]
        workers = [w.proc for w in runner._workers]
        assert workers and all(p.is_alive() and p.pid != os.getpid() for p in workers)
    finally:
        dm.teardown()


def test_quickstart_in_process_reward_is_explicit():
    """The quickstart opts in to in-process scoring explicitly (a trusted built-in reward)."""
    text = (Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml").read_text()
    assert "scoring:\n      in_process: true" in text


# ------------------------------------------------- non-finite weights (issue 29)


def _adam_eps0(params: Any) -> torch.optim.Optimizer:
    """AdamW with eps=0: a weight whose gradient is exactly 0 gets m / sqrt(v) = 0 / 0 = NaN
    although every input of the step is finite."""
    return torch.optim.AdamW(params, lr=1e-3, eps=0.0)


def _zero_grad_on_one_weight(module: DAPOModule) -> None:
    weight = module.policy.model.layers[0].mlp.up_proj.weight
    weight.register_hook(lambda g: g * 0.0)


def test_step_that_leaves_nonfinite_weights_is_undone(tiny_checkpoint, tmp_path):
    """The step itself makes NaN weights from finite inputs: the guard's after-check sees it
    and puts parameters and optimizer state back exactly as they were."""
    rec = UpdateRecorder()
    module, before, trainer = _fit(
        tiny_checkpoint,
        fixed_batch(),
        tmp_path,
        steps=2,
        callbacks=[rec],
        optimizer=_adam_eps0,
        module_setup=_zero_grad_on_one_weight,
    )
    assert _unchanged(module, before)
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    assert module.skipped_updates == 2 and module.policy_version == 0
    assert [m["skipped_nonfinite"] for m in rec.metrics] == [1.0, 1.0]
    assert torch.isfinite(torch.tensor(rec.metrics[0]["grad_norm"]))  # the norm was fine
    assert all(not s for s in trainer.optimizers[0].state.values())  # state as before: none
    assert module.nonfinite_guard.in_a_row == 2


def test_negative_control_eps0_without_the_guard_makes_nan_weights(tiny_checkpoint, tmp_path):
    module, _, _ = _fit(
        tiny_checkpoint, fixed_batch(), tmp_path, steps=1, optimizer=_adam_eps0,
        module_setup=_zero_grad_on_one_weight, optimizer_step=dict(skip_nonfinite=False),
    )  # fmt: skip
    assert any(not torch.isfinite(p).all() for p in module.policy.parameters())


class _NanLrAfter:
    """Sets the learning rate to NaN after ``after`` updates (a broken scheduler / callback)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_dapo_update(self, trainer: Any, pl_module: Any, metrics: dict[str, float]) -> None:
        self.weights.append({k: v.clone() for k, v in pl_module.policy.state_dict().items()})
        if len(self.weights) >= self.after:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = float("nan")


def test_nan_learning_rate_mid_run_skips_and_then_stops(tiny_checkpoint, tmp_path):
    """Update 1 is normal; then lr is NaN: the next updates are skipped before the step (the
    weights stay those of update 1) and the fifth in a row stops the run, naming lr."""
    from dapo_lightning.step_guard import NonFiniteUpdatesError

    hook = _NanLrAfter(after=1)
    with pytest.raises(NonFiniteUpdatesError, match=r"5 updates in a row .*last: the step would "
                       r"use lr=nan"):  # fmt: skip
        _fit(tiny_checkpoint, fixed_batch(), tmp_path, steps=10, callbacks=[hook])
    assert len(hook.weights) == 5  # updates 1..5 reported; the 6th raised
    first = hook.weights[0]
    for later in hook.weights[1:]:
        assert all(torch.equal(later[k], first[k]) for k in first)
    assert all(torch.isfinite(v).all() for v in first.values())


def test_snapshot_restores_parameters_and_adam_state_exactly():
    """StepSnapshot against an independent copy: after a real Adam step (state created) and a
    second one undone, parameters and state equal the deep copy taken before it."""
    import copy

    from dapo_lightning.step_guard import StepSnapshot, all_finite

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):  # first with no state yet, then with state
        model(torch.randn(5, 4)).pow(2).sum().backward()
        params_before = [p.detach().clone() for p in model.parameters()]
        state_before = copy.deepcopy(opt.state_dict())
        snap = StepSnapshot()
        snap.take(opt)
        opt.step()
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        assert not all_finite(list(model.parameters()))
        snap.restore()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params_before))
        after = opt.state_dict()
        assert after["state"].keys() == state_before["state"].keys()
        for k, st in state_before["state"].items():
            assert all(torch.equal(st[n], after["state"][k][n]) for n in st)
        opt.step()  # a real step, so the second round starts with state
        opt.zero_grad()


def test_all_finite_is_exact():
    from dapo_lightning.step_guard import all_finite

    ok = [torch.ones(3), torch.full((2, 2), 3.0e38)]  # near float32's max: no overflow
    assert all_finite(ok) and all_finite([])
    assert not all_finite([*ok, torch.tensor([0.0, float("nan")])])
    assert not all_finite([torch.tensor([-float("inf")])])
    assert not all_finite([torch.tensor([6.0e4, float("inf")], dtype=torch.float16)])
    # every position of a vectorised reduction (lanes, the tail) and every float dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for bad in (float("nan"), float("inf"), -float("inf")):
            for at in (0, 5, 16, 31, 1000, 4098):
                x = torch.zeros(4099, dtype=dtype)
                x[at] = bad
                assert not all_finite([torch.ones(2), x[:, None].expand(4099, 2)]), (dtype, at)
    assert all_finite([torch.zeros(4099).to(dtype) for dtype in (torch.bfloat16, torch.float16)])


def test_checkpoint_of_nonfinite_weights_is_refused(tmp_path):
    """AtomicCheckpointIO writes no file from NaN weights and names the last good one."""
    from dapo_lightning.checkpoint import AtomicCheckpointIO, NonFiniteCheckpointError

    io = AtomicCheckpointIO()
    good = {"state_dict": {"w": torch.ones(3), "step": torch.tensor(3)}}
    io.save_checkpoint(good, tmp_path / "last.ckpt")
    bad = {"state_dict": {"w": torch.tensor([1.0, float("nan")]), "step": torch.tensor(4)}}
    with pytest.raises(NonFiniteCheckpointError, match=rf"last.ckpt would hold non-finite "
                       rf"weights \(w has NaN / inf values\); the last good checkpoint is "
                       rf"{tmp_path / 'last.ckpt'}"):  # fmt: skip
        io.save_checkpoint(bad, tmp_path / "last.ckpt")
    assert torch.equal(torch.load(tmp_path / "last.ckpt")["state_dict"]["w"], torch.ones(3))
    assert not (tmp_path / "last-previous.ckpt").exists()
