"""dapo_lightning.update_loop without Lightning: the update loop on the tiny model with no
Trainer and no LightningModule (``StrategyAdapter(None)``: one process, plain backward and
step), pinned against the independent float64 computation of tests/test_module_absolute.py;
and the module <-> data contract (dapo_lightning.contract) as the loop and a stop use it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_lightning import update_loop
from dapo_lightning.contract import PolicyHandle, RolloutChannel, RolloutSpec, rollout_channel
from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop
from dapo_lightning.loss import PolicyLossConfig
from dapo_lightning.schedules import WarmupConstantLR
from dapo_lightning.step_guard import StepStart
from dapo_lightning.strategy import StrategyAdapter
from dapo_lightning.update import BatchingConfig, OptimizerStepConfig
from dapo_lightning.update_loop import StepContext, UpdateLoop
from tests._module_harness import fixed_batch
from tests.test_module_absolute import LR, reference_updates, rel_diff


def _loop(checkpoint, mini_batch_size, share_prompts=True):
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).train()
    loop = UpdateLoop(
        PolicyLossConfig(),
        BatchingConfig(
            mini_batch_size=mini_batch_size, micro_batch_size=3, share_prompts=share_prompts
        ),
        StrategyAdapter(None),
        OptimizerStepConfig(gradient_clip_val=None),
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    loop.bind(policy, optimizer, WarmupConstantLR(optimizer))
    return loop, policy, optimizer


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared prompts", "whole rows"])
@pytest.mark.parametrize(
    ("mini_batch_size", "groups_per_update"), [(None, 4), (2, 2)], ids=["one update", "2 updates"]
)
def test_the_loop_alone_equals_sgd_on_the_token_mean_objective(
    tiny_checkpoint, mini_batch_size, groups_per_update, share_prompts, monkeypatch
):
    torch.manual_seed(0)
    loop, policy, _ = _loop(str(tiny_checkpoint), mini_batch_size, share_prompts)
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    updates: list[dict[str, float]] = []
    shared = []  # micro-batches that ran each shared prompt once
    real = update_loop.shared_prompt_log_probs

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        shared.append(out is not None)
        return out

    monkeypatch.setattr(update_loop, "shared_prompt_log_probs", spy)
    loop.run(fixed_batch().trim(), StepContext(on_update=updates.append))
    assert any(shared) == share_prompts
    ours = {k: v.detach() for k, v in policy.named_parameters()}
    ref = reference_updates(str(tiny_checkpoint), fixed_batch(), groups_per_update)
    assert rel_diff(ours, ref, start) < 1e-5
    assert len(updates) == 4 // groups_per_update == loop.state.version
    assert loop.state.rollout_step == 1
    assert all(u["skipped_nonfinite"] == 0.0 and u["tokens"] > 0 for u in updates)


class _Channel:
    """A data side that records what the contract hands it (a real object, no trainer)."""

    def __init__(self) -> None:
        self.handles: list[PolicyHandle] = []
        self.rewinds = 0

    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(
            group_size=4, train_batch_size=4, max_prompt_length=8, max_response_tokens=8
        )

    def publish_policy(self, handle: PolicyHandle) -> None:
        self.handles.append(handle)

    def rewind_rollout_batch(self) -> None:
        self.rewinds += 1

    def core_share(self) -> None:
        return None  # no rollout thread beside the update


def test_a_stop_after_an_update_undoes_the_step_and_rewinds_the_data(tiny_checkpoint):
    """A stop requested after the first of two updates: that update is undone
    from the step's start copy, the data side is rewound once, StopRequested is raised."""
    loop, policy, optimizer = _loop(str(tiny_checkpoint), 2)
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    channel = _Channel()
    assert isinstance(channel, RolloutChannel)
    copy = StepStart()

    def take_start() -> StepStart:
        copy.take(optimizer, [])
        return copy

    def stop_after_first(metrics: dict[str, float]) -> None:
        request_stop("test: stop inside the rollout step")

    context = StepContext(
        train_batch_size=channel.rollout_spec().train_batch_size,
        on_update=stop_after_first,
        take_step_start=take_start,
        rewind=channel.rewind_rollout_batch,
    )
    try:
        with pytest.raises(StopRequested):
            loop.run(fixed_batch().trim(), context)
    finally:
        clear_stop_request()
    assert channel.rewinds == 1 and loop.step_updates == 0
    assert all(torch.equal(start[k], v) for k, v in policy.named_parameters())


def test_rollout_channel_is_the_trainers_data_module_when_it_declares_the_contract():
    class Trainer:
        datamodule = _Channel()

    class Other:
        datamodule = object()

    assert rollout_channel(Trainer()) is Trainer.datamodule
    assert rollout_channel(Other()) is None and rollout_channel(None) is None


def test_each_update_records_its_own_step_outcome_and_a_step_without_it_fails(
    tiny_checkpoint, monkeypatch
):
    """The optimizer step's outcome (gradient norm, skipped) is reset before every step: each
    update reports the norm its own step measured, and a strategy whose step never calls
    ``before_optimizer_step`` is an error, never the previous step's norm reused."""
    loop, policy, _ = _loop(str(tiny_checkpoint), 2)
    norms: list[float] = []
    real = loop.before_optimizer_step

    def measured(optimizer):
        real(optimizer)
        norms.append(loop.stepper.outcome.grad_norm)

    monkeypatch.setattr(loop, "before_optimizer_step", measured)
    updates: list[dict[str, float]] = []
    loop.run(fixed_batch().trim(), StepContext(on_update=updates.append))
    assert len(updates) == len(norms) == 2 and norms[0] != norms[1]
    assert [u["grad_norm"] for u in updates] == pytest.approx(norms, rel=1e-12)
    monkeypatch.setattr(loop.ranks, "optimizer_step", lambda optimizer, before: optimizer.step())
    with pytest.raises(RuntimeError, match="without before_optimizer_step"):
        loop.run(fixed_batch().trim(), StepContext())
