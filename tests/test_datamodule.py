"""DAPODataModule inside a real Trainer.fit: on-policy version stamps despite Lightning's prefetch,
the HF engine on the tiny checkpoint, validation, and resume through a real checkpoint file."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from test_producer import ScriptedEngine, config_with_selection
from transformers import AutoModelForCausalLM

from dapo_lightning.contract import PolicyHandle
from dapo_lightning.data import (
    DAPODataModule,
    DynamicSamplingConfig,
    RolloutBatch,
    ScoredRollouts,
    validation_metrics,
)
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.rollout import SamplingConfig
from tests._harness import make_trainer


class ToyModule(pl.LightningModule):
    """Owns ``policy`` and bumps ``policy_version`` once per step (a stand-in for DAPOModule);
    like it, publishes its weights and version to the data side (dapo_lightning.contract) at
    the start of training and of validation, and after each step."""

    def __init__(self, path):
        super().__init__()
        torch.manual_seed(0)
        self.policy = AutoModelForCausalLM.from_pretrained(path)
        self.policy_version = 0
        self.automatic_optimization = False
        self.seen: list[tuple[int, int, list[int], int]] = []
        self.val_seen: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, RolloutBatch)
        self.seen.append(
            (
                batch.policy_version,
                self.policy_version,
                batch.sample_version.tolist(),
                batch.batch_size,
            )
        )
        self.optimizers().step()  # an empty update: Lightning counts steps by optimizer steps
        self.policy_version += 1  # one "optimizer update"

    def _publish(self):
        self.trainer.datamodule.publish_policy(PolicyHandle(self.policy, self.policy_version))

    def on_train_start(self):
        self._publish()

    def on_validation_start(self):
        self._publish()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._publish()

    def validation_step(self, batch, batch_idx):
        assert isinstance(batch, ScoredRollouts)
        metrics = validation_metrics(batch)
        self.val_seen.append(metrics)
        self.log_dict(metrics, batch_size=len(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.0)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["policy_version"] = self.policy_version

    def on_load_checkpoint(self, checkpoint):
        self.policy_version = checkpoint["policy_version"]


def trainer(tmp_path, max_steps, **kw):
    return make_trainer(
        max_steps=max_steps, max_epochs=None, devices=1, num_sanity_val_steps=0,
        default_root_dir=tmp_path, **kw,
    )  # fmt: skip


def scripted_dm(path, **dynamic_sampling):
    settings = dict(n=4, train_batch_size=4, gen_batch_size=4, max_num_gen_batches=20)
    settings.update(dynamic_sampling)
    return DAPODataModule(
        str(path),
        prompts=PromptConfig(task="arithmetic", task_kwargs={"num_prompts": 40}),
        reward="arithmetic",
        scoring=ScoringConfig(in_process=True),
        engine=ScriptedEngine(),
        sampling=SamplingConfig(max_tokens=8),
        dynamic_sampling=config_with_selection(settings),
    )


def test_on_policy_version_stamps_in_fit(tiny_checkpoint, tmp_path):
    dm = scripted_dm(tiny_checkpoint, carry_over=False)  # no carried (older) groups
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 5).fit(module, datamodule=dm)
    assert len(module.seen) == 5
    for step, (batch_version, module_version, sample_versions, size) in enumerate(module.seen):
        # sampled with the weights after update step-1, i.e. version == step
        assert batch_version == module_version == step
        assert set(sample_versions) == {step} and size == 16
    # the prompt cursor advanced exactly once per step (prefetching drew nothing)
    assert len(dm.drawn_log) == 5


def test_hf_engine_fit_with_validation(tiny_checkpoint, tmp_path):
    dm = DAPODataModule(
        str(tiny_checkpoint),
        reward="arithmetic",
        scoring=ScoringConfig(reward_kwargs={"strict": False}, in_process=False),
        engine="hf",
        sampling=SamplingConfig(max_tokens=4),
        # a random tiny model solves nothing: no variance to filter on
        dynamic_sampling=DynamicSamplingConfig(n=3, train_batch_size=2, filter_metric=None),
        validation=ValidationConfig(fraction=0.2, n=2, batch_size=3),
        prompts=PromptConfig(
            task="arithmetic", task_kwargs={"num_prompts": 20}, max_prompt_length=64
        ),
    )
    module = ToyModule(tiny_checkpoint)
    try:
        trainer(tmp_path, 2, val_check_interval=2, check_val_every_n_epoch=None).fit(
            module, datamodule=dm
        )
    finally:
        dm.teardown()
    assert dm.engine.model is module.policy  # the HF engine samples with the policy itself
    assert [s[:2] for s in module.seen] == [(0, 0), (1, 1)]
    assert all(s[3] == 6 for s in module.seen)
    assert len(dm.val_records) == 4 and len(module.val_seen) == 2  # 4 prompts, chunks of 3
    for m in module.val_seen:
        assert set(m) == {"val/acc", "val/pass@2", "val/response_length"}
        assert 0 < m["val/response_length"] <= 4


def straight_and_resumed(path, tmp_path, **dynamic_sampling):
    """A 6-step fit, and the same as 2 steps, a checkpoint, and 4 more resumed from it: returns
    (straight module, straight data, first data, resumed module, resumed data, checkpoint)."""
    full_dm = scripted_dm(path, **dynamic_sampling)
    full_module = ToyModule(path)
    trainer(tmp_path / "full", 6).fit(full_module, datamodule=full_dm)
    first_dm = scripted_dm(path, **dynamic_sampling)
    t1 = trainer(tmp_path / "a", 2)
    t1.fit(ToyModule(path), datamodule=first_dm)
    ckpt = tmp_path / "a" / "step2.ckpt"
    t1.save_checkpoint(ckpt)
    resumed_dm = scripted_dm(path, **dynamic_sampling)
    resumed_module = ToyModule(path)
    trainer(tmp_path / "b", 6).fit(resumed_module, datamodule=resumed_dm, ckpt_path=ckpt)
    return full_module, full_dm, first_dm, resumed_module, resumed_dm, ckpt


def test_resume_from_checkpoint_draws_same_prompts(tiny_checkpoint, tmp_path):
    kw = dict(carry_over=True, gen_batch_size=6, retire_after=1, park_after=1)
    full_module, full_dm, first_dm, resumed_module, resumed_dm, _ = straight_and_resumed(
        tiny_checkpoint, tmp_path, **kw
    )
    assert first_dm.drawn_log + resumed_dm.drawn_log == full_dm.drawn_log
    # the same batches (a sized round's overshoot can fill a later batch from the carry-over)
    assert resumed_module.seen == full_module.seen[2:]
    assert [s[1] for s in resumed_module.seen] == [2, 3, 4, 5]


def test_validation_metrics():
    r = ScoredRollouts(
        prompt_ids=[[1]] * 4,
        response_ids=[[5], [5, 6], [7], [8, 9, 9]],
        rollout_log_probs=[[0.0], [0.0, 0.0], [0.0], [0.0] * 3],
        finish_reason=["stop"] * 4,
        group_index=torch.tensor([0, 0, 1, 1]),
        prompt_uid=["a", "a", "b", "b"],
        score=torch.tensor([1.0, -1.0, -1.0, -1.0]),
        acc=torch.tensor([1.0, 0.0, 0.0, 0.0]),
        sampling=SamplingConfig(max_tokens=4),
    )
    m = validation_metrics(r)
    assert m == {"val/acc": 0.25, "val/pass@2": 0.5, "val/response_length": 1.75}
    # episodes: the share that called a tool (2 of 4), kept through select and concat
    r.tool_calls = [0, 2, 1, 0]
    assert validation_metrics(r)["val/tool_use_frac"] == 0.5
    from dapo_lightning.data.sampling.groups import concat_rollouts

    both = concat_rollouts([r.select([1, 0]), r.select([2, 3])])
    assert both.tool_calls == [2, 0, 1, 0] and validation_metrics(both)["val/tool_use_frac"] == 0.5


def test_constructor_errors(tiny_checkpoint):
    with pytest.raises(ValueError, match="exactly one of train_files"):
        DAPODataModule(str(tiny_checkpoint))
    with pytest.raises(ValueError, match="engine='nope'"):
        DAPODataModule(str(tiny_checkpoint), prompts=PromptConfig(task="arithmetic"), engine="nope")
    with pytest.raises(ValueError, match="n >= 2"):
        scripted_dm(tiny_checkpoint, train_batch_size=3, gen_batch_size=None, n=1)
    with pytest.raises(ValueError, match="task='nope' is unknown|nope"):
        DAPODataModule(str(tiny_checkpoint), prompts=PromptConfig(task="nope"))
