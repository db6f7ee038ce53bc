"""StrategyAdapter through real Trainers: kinds, clipping after GradScaler unscaling (16-mixed on
CPU with a real GradScaler), and a mini-batch with no tokens, which must not step."""

from __future__ import annotations

import pytest
import torch
from dapo_lightning.callbacks import DAPOCallback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from dapo_lightning.module import DAPOModule
from dapo_lightning.strategy import grad_norm, strategy_kind
from dapo_lightning.update import BatchingConfig
from tests._harness import fit
from tests._module_harness import FixedBatches, fixed_batch


class Record(DAPOCallback):
    def __init__(self) -> None:
        self.updates: list[dict[str, float]] = []

    def on_dapo_update(self, trainer, pl_module, metrics):
        self.updates.append(dict(metrics))


def test_strategy_kinds_by_isinstance():
    assert strategy_kind(SingleDeviceStrategy(torch.device("cpu"))) == "single"
    assert strategy_kind(DDPStrategy()) == "ddp"
    assert strategy_kind(FSDPStrategy()) == "fsdp1"
    assert strategy_kind(ModelParallelStrategy()) == "fsdp2"
    assert strategy_kind(DeepSpeedStrategy()) == "deepspeed"  # a DDPStrategy subclass
    assert strategy_kind(None) == "single"


def test_grad_norm_clips_and_reports_the_norm_before():
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert grad_norm([w], max_norm=1.0) == pytest.approx(5.0)
    assert float(w.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    assert grad_norm([torch.nn.Parameter(torch.zeros(2))], None) == 0.0  # no gradients


def _fit(checkpoint, *, plugins=(), batch=None, **module_kw):
    torch.manual_seed(0)
    rec = Record()
    kw = dict(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batching=BatchingConfig(micro_batch_size=4),
        parity_check_every=0,
    )
    kw.update(module_kw)
    module = DAPOModule(str(checkpoint), **kw)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    datamodule = FixedBatches(batch if batch is not None else fixed_batch())
    trainer = fit(module, datamodule, [rec], plugins=list(plugins))
    delta = {k: v.detach() - before[k] for k, v in module.policy.named_parameters()}
    return module, rec, delta, trainer


def _norm(delta):
    return float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())))


def test_fp16_mixed_clips_after_unscaling(tiny_checkpoint):
    """With a GradScaler (scale 2**12) the clip must see the true gradient: the update has the
    clipped norm lr * clip, not lr * clip / scale as when clipping scaled gradients."""
    clip, lr = 1e-3, 0.1
    _, rec32, delta32, _ = _fit(tiny_checkpoint, optimizer_step=dict(gradient_clip_val=clip))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    _, rec16, delta16, trainer = _fit(
        tiny_checkpoint,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        optimizer_step=dict(gradient_clip_val=clip),
    )
    assert trainer.precision == "16-mixed"
    assert rec16.updates[0]["skipped_nonfinite"] == 0.0
    # the reported norm is the unscaled one (fp16 autocast: a few % off the fp32 norm)
    assert rec16.updates[0]["grad_norm"] == pytest.approx(rec32.updates[0]["grad_norm"], rel=0.05)
    assert rec32.updates[0]["grad_norm"] > 10 * clip  # clipping is active
    assert _norm(delta32) == pytest.approx(lr * clip, rel=1e-3)
    assert _norm(delta16) == pytest.approx(lr * clip, rel=1e-2)


def _with_empty_first_group(batch):
    batch.response_mask = batch.response_mask.clone()
    batch.response_mask[: batch.group_size] = (
        0.0  # e.g. every response of the group overlong-filtered
    )
    return batch


def test_a_mini_batch_without_tokens_does_not_step(tiny_checkpoint):
    """SGD with weight decay and momentum moves every weight on a zero-gradient step: the update
    of the empty mini-batch is skipped on every rank (the token count is global)."""
    sgd_decay = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)  # noqa: E731
    module, rec, delta, trainer = _fit(
        tiny_checkpoint, batch=_with_empty_first_group(fixed_batch()), optimizer=sgd_decay,
        batching=BatchingConfig(1, 4),
    )  # fmt: skip
    assert [u["skipped_empty"] for u in rec.updates] == [1.0, 0.0, 0.0, 0.0]
    assert rec.updates[0]["tokens"] == 0.0
    assert module.policy_version == 3 and trainer.global_step == 3  # three optimizer steps
    # the same weights as a run that never saw the empty group
    rest = fixed_batch().select(list(range(4, 16)))
    rest.group_index = rest.group_index - 1
    _, _, delta_rest, _ = _fit(
        tiny_checkpoint, batch=rest, optimizer=sgd_decay, batching=BatchingConfig(1, 4)
    )
    for k in delta:
        # float32 updates of the same 12 rows in other micro-batch shapes: rtol is a bound of
        # float32_reorder_bound's kind for their ~250 tokens (3e-5), with room; atol for zeros
        assert torch.allclose(delta[k], delta_rest[k], atol=1e-6, rtol=1e-4), k
