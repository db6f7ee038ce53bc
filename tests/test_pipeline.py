"""The one-step-off pipeline (dapo_lightning/data/streams/one_step_off.py) inside a real Trainer.fit: batch
k + 1 is sampled with the weights from before update k (pinned by the HF engine's log-probs
against the weights of each step), version stamps, exact resume with the batch in flight saved
in the checkpoint, a stop that undoes a step, validation, the thread split and the refusals."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _length_reward import EvenLengthReward
from test_datamodule import ToyModule, scripted_dm, straight_and_resumed, trainer

from dapo_lightning.batch import RolloutBatch
from dapo_lightning.checks import ConfigError
from dapo_lightning.data import DAPODataModule, DynamicSamplingConfig, OneStepOffConfig
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.streams.one_step_off import (
    Idle,
    InFlight,
    OneStepOffStream,
    Pending,
    Ready,
    check_pipeline,
)
from dapo_lightning.rollout import SamplingConfig

PIPELINED = dict(pipeline="one_step_off")


class ChangingModule(ToyModule):
    """Changes its weights at every step (a stand-in for an optimizer update) and keeps a copy
    of the weights each step started with."""

    def __init__(self, path):
        super().__init__(path)
        self.weights_at_step: list[dict[str, torch.Tensor]] = []
        self.batches: list[RolloutBatch] = []

    def training_step(self, batch, batch_idx):
        self.weights_at_step.append(
            {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        )
        self.batches.append(batch)
        super().training_step(batch, batch_idx)
        with torch.no_grad():  # a visible weight change: the sampled distribution moves
            for p in self.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))


def token_log_probs(policy, weights, batch: RolloutBatch) -> torch.Tensor:
    """Log-probs of the batch's response tokens under ``weights`` at the batch's temperature
    (written out here: logits of the previous position, log-softmax, gather)."""
    policy.load_state_dict(weights)
    width = batch.response_width
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, -width - 1 : -1].float() / batch.sampling.temperature
    targets = batch.input_ids[:, -width:]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def hf_dm(path, engine_kwargs=None, reward="arithmetic", **dynamic_sampling):
    settings = dict(n=2, train_batch_size=2, filter_metric=None, carry_over=False)
    settings.update(dynamic_sampling)
    return DAPODataModule(
        str(path),
        reward=reward,
        scoring=ScoringConfig(
            reward_kwargs={"strict": False} if reward == "arithmetic" else None, in_process=True
        ),
        engine="hf",
        engine_kwargs=engine_kwargs,
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(**settings),
        validation=ValidationConfig(fraction=0.2, n=2, batch_size=4),
        prompts=PromptConfig(
            task="arithmetic", task_kwargs={"num_prompts": 20}, max_prompt_length=64
        ),
    )


def test_batch_k_plus_1_is_sampled_with_the_weights_from_before_update_k(tiny_checkpoint, tmp_path):
    dm = hf_dm(tiny_checkpoint, **PIPELINED)
    module = ChangingModule(tiny_checkpoint)
    trainer(tmp_path, 4).fit(module, datamodule=dm)
    assert isinstance(dm.stream, OneStepOffStream)
    assert dm.engine.model is not module.policy  # the engine samples with its own copy
    probe = ChangingModule(tiny_checkpoint).policy
    for step, batch in enumerate(module.batches):
        mask = batch.response_mask.bool()
        sampled_with = max(step - 1, 0)  # batch 0 has nothing to overlap with
        assert batch.sample_version.tolist() == [sampled_with] * batch.batch_size
        expected = token_log_probs(probe, module.weights_at_step[sampled_with], batch)
        gap = (expected - batch.rollout_log_probs)[mask].abs().max().item()
        assert gap < 1e-4, (step, gap)
        if step >= 1:  # not the weights the step itself updates (they moved by 0.05 noise)
            newer = token_log_probs(probe, module.weights_at_step[step], batch)
            assert (newer - batch.rollout_log_probs)[mask].abs().max().item() > 1e-2
    stats = module.batches[-1].stats
    assert stats["time/trainer_wait_s"] >= 0 and stats["time/engine_idle_s"] >= 0


def test_version_stamps_lag_one_step(tiny_checkpoint, tmp_path):
    dm = scripted_dm(tiny_checkpoint, carry_over=False, **PIPELINED)
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 5).fit(module, datamodule=dm)
    assert [s[1] for s in module.seen] == [0, 1, 2, 3, 4]  # the module's version at each step
    assert [s[0] for s in module.seen] == [0, 0, 1, 2, 3]  # the batch's: one step behind
    assert len(dm.drawn_log) == 5  # one entry per batch trained on, in step order
    # the batch in flight at the end of fit: finished and kept, not thrown away
    assert isinstance(dm.stream.state, Ready)
    assert isinstance(dm.stream.state.produced.batch, RolloutBatch)


def test_resume_trains_on_the_saved_batch_in_flight(tiny_checkpoint, tmp_path):
    kw = dict(carry_over=True, gen_batch_size=6, retire_after=1, park_after=1, **PIPELINED)
    full_module, full_dm, first_dm, resumed_module, resumed_dm, ckpt = straight_and_resumed(
        tiny_checkpoint, tmp_path, **kw
    )
    saved = torch.load(ckpt, weights_only=False)
    assert saved["DAPODataModule"]["ranks"][0]["ready"]["policy_version"] == 1
    assert resumed_module.seen == full_module.seen[2:]  # the same batches, stamps included
    # one entry per batch trained on; the batch in flight at the save is not drawn again
    assert len(first_dm.drawn_log) == 2 and len(full_dm.drawn_log) == 6
    assert first_dm.drawn_log + resumed_dm.drawn_log == full_dm.drawn_log


def test_rewind_hands_the_undone_batch_over_again(tiny_checkpoint, tmp_path):
    dm = scripted_dm(tiny_checkpoint, carry_over=False, **PIPELINED)
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 3).fit(module, datamodule=dm)
    last = module.seen[-1]
    after = dm.stream.state_dict()["producer"]
    dm.rewind_rollout_batch()  # a stop undid step 3: its batch comes first again
    state = dm.stream.state
    assert isinstance(state, Ready) and isinstance(state.produced.batch, RolloutBatch)
    assert state.produced.batch.sample_version.tolist() == last[2]
    assert dm.stream.state_dict()["producer"] != after  # back to before the batch in flight
    batch = dm.next_rollout_batch()
    assert batch.policy_version == last[0] and batch.sample_version.tolist() == last[2]
    dm.teardown()


def test_validation_waits_for_the_batch_in_flight(tiny_checkpoint, tmp_path):
    dm = hf_dm(tiny_checkpoint, **PIPELINED)
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 3, val_check_interval=1, check_val_every_n_epoch=None).fit(
        module, datamodule=dm
    )
    assert len(module.val_seen) == 3 and [s[0] for s in module.seen] == [0, 0, 1]


def test_refusals_name_the_field():
    class Trainer:
        strategy = None

    check_pipeline(Trainer(), {})  # one device: fine
    with pytest.raises(ConfigError, match="enable_sleep_mode"):
        check_pipeline(Trainer(), {"enable_sleep_mode": True})
    with pytest.raises(ConfigError, match="pipeline must be 'sync' or 'one_step_off'"):
        DynamicSamplingConfig(pipeline="async")


def test_sharded_strategy_is_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    class FakeTrainer:  # only the strategy is read; FSDP itself is not started
        strategy = FSDPStrategy.__new__(FSDPStrategy)

    with pytest.raises(ConfigError, match=r"pipeline=one_step_off .* fsdp1 strategy"):
        check_pipeline(FakeTrainer(), {})


def test_sync_is_the_default(tiny_checkpoint, tmp_path):
    dm = scripted_dm(tiny_checkpoint, carry_over=False)
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 2).fit(module, datamodule=dm)
    assert not isinstance(dm.stream, OneStepOffStream)
    assert [s[0] for s in module.seen] == [0, 1]


@pytest.mark.parametrize("stale_old", ["trainer", "engine"])
def test_every_update_trains_on_one_step_old_groups_with_the_independent_tis_weights(
    tiny_checkpoint, tmp_path, monkeypatch, stale_old
):
    """DAPOModule with one_step_off (2 updates per rollout step, filter off): every batch after
    the first was sampled with the weights from before the previous step (2 policy versions
    old), and the correction the update applies to it is token TIS
    w_t = min(exp(old_t - engine_t), 2), old_t computed here from the step's starting weights.
    With ``stale_old: engine`` the ratio's old log-probs on those rows are the engine's (plain
    PPO on the stale samples) and their correction weight is exactly 1."""
    import dapo_lightning.update_loop as update_loop
    from dapo_lightning import BatchingConfig, DAPOModule, PolicyLossConfig
    from dapo_lightning.rollout_correction import RolloutCorrection, correction_weights

    seen: list[dict] = []
    real = update_loop.behaviour_log_probs

    def spy(batch, old, stale, correction, **kwargs):
        out = real(batch, old, stale, correction, **kwargs)
        seen.append({"batch": batch, "old": old, "stale": stale.clone(), "out": out})
        return out

    monkeypatch.setattr(update_loop, "behaviour_log_probs", spy)

    module = DAPOModule(
        str(tiny_checkpoint),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        batching=BatchingConfig(mini_batch_size=1, micro_batch_size=8),
        loss=PolicyLossConfig(rollout_correction=RolloutCorrection(stale_old=stale_old)),
        parity_check_every=0,
    )
    starts: list[tuple[int, dict[str, torch.Tensor]]] = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
            starts.append((pl_module.policy_version, weights))

    dm = hf_dm(tiny_checkpoint, **PIPELINED)
    trainer(tmp_path, 8, callbacks=[Recorder()]).fit(module, datamodule=dm)  # 4 rollout steps
    assert len(seen) == len(starts) == 4
    probe = ChangingModule(tiny_checkpoint).policy
    for step, (record, (version, weights)) in enumerate(zip(seen, starts)):
        batch = record["batch"]
        assert version == 2 * step
        expected_version = max(version - 2, 0)  # one rollout step (2 updates) earlier
        assert batch.sample_version.tolist() == [expected_version] * batch.batch_size
        if step == 0:
            assert not record["stale"].any() and record["out"] is None
            continue
        behaviour, correction = record["out"]
        assert record["stale"].all()
        assert torch.equal(behaviour, batch.rollout_log_probs.to(behaviour.dtype))
        mask = batch.response_mask.bool()
        old = token_log_probs(probe, weights, batch)  # the step's starting policy, here
        if stale_old == "engine":
            engine = batch.rollout_log_probs.to(old.dtype)
            assert torch.equal(record["old"][mask], engine[mask])  # the ratio's old policy
            got, _ = correction_weights(record["old"], behaviour, mask, correction)
            assert torch.equal(got[mask], torch.ones_like(got[mask]))
            continue
        assert torch.allclose(record["old"][mask], old[mask], atol=1e-5)  # the update's own
        expected = torch.clamp(torch.exp(old - batch.rollout_log_probs), max=2.0)
        got, _ = correction_weights(old, behaviour, mask, correction)
        assert torch.allclose(got[mask], expected[mask], atol=1e-5)
        assert (expected[mask] != 1.0).any()  # the weights move off 1: the step corrects


def test_a_late_start_samples_with_the_weights_after_that_many_updates(tiny_checkpoint, tmp_path):
    """``start_after_updates: 1`` with 2 updates per rollout step: each batch after the first is
    sampled with the weights right after the first update of the step before (version 2k - 1,
    pinned by the HF engine's log-probs against those weights), one version fresher than at
    the hand-over."""
    from dapo_lightning.callbacks import DAPOCallback

    from dapo_lightning import BatchingConfig, DAPOModule

    module = DAPOModule(
        str(tiny_checkpoint),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        batching=BatchingConfig(mini_batch_size=2, ppo_epochs=2, micro_batch_size=8),
        parity_check_every=0,
    )  # 2 updates per rollout step, each on both groups
    after_update: dict[int, dict[str, torch.Tensor]] = {}
    batches: list[tuple[int, RolloutBatch]] = []

    class Recorder(DAPOCallback):
        def on_train_start(self, trainer, pl_module):
            after_update[0] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

        def on_dapo_update(self, trainer, pl_module, metrics):
            weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
            after_update[pl_module.policy_version] = weights

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append((pl_module.policy_version, batch))

    late = OneStepOffConfig(start_after_updates=1)
    dm = hf_dm(tiny_checkpoint, reward=EvenLengthReward(), one_step_off=late, **PIPELINED)
    trainer(tmp_path, 8, callbacks=[Recorder()]).fit(module, datamodule=dm)  # 4 rollout steps
    probe = ChangingModule(tiny_checkpoint).policy
    assert [version for version, _ in batches] == [0, 2, 4, 6]
    handover_gaps = []
    for step, (version, batch) in enumerate(batches):
        sampled_with = max(version - 1, 0)  # after the first update of the step before
        assert batch.sample_version.tolist() == [sampled_with] * batch.batch_size
        mask = batch.response_mask.bool()
        expected = token_log_probs(probe, after_update[sampled_with], batch)
        assert (expected - batch.rollout_log_probs)[mask].abs().max().item() < 1e-4, step
        if step:  # the weights of the hand-over, one update earlier
            handover = token_log_probs(probe, after_update[version - 2], batch)
            handover_gaps.append((handover - batch.rollout_log_probs)[mask].abs().max().item())
    # (an update whose groups each have equal rewards leaves the weights as they were)
    assert sum(gap > 1e-3 for gap in handover_gaps) >= 2, handover_gaps


def test_a_late_start_falls_back_to_the_step_end_and_resumes_exactly(tiny_checkpoint, tmp_path):
    """A step with fewer updates than ``start_after_updates`` starts the next batch at its
    end (the ToyModule publishes once a step: every batch sampled with the newest weights, as
    sync), and the run resumes on the same batches."""
    late = OneStepOffConfig(start_after_updates=2)
    dm = scripted_dm(tiny_checkpoint, carry_over=False, one_step_off=late, **PIPELINED)
    module = ToyModule(tiny_checkpoint)
    trainer(tmp_path, 4).fit(module, datamodule=dm)
    assert [s[0] for s in module.seen] == [s[1] for s in module.seen] == [0, 1, 2, 3]
    kw = dict(carry_over=True, gen_batch_size=6, one_step_off=late, **PIPELINED)
    full_module, full_dm, first_dm, resumed_module, resumed_dm, _ = straight_and_resumed(
        tiny_checkpoint, tmp_path / "resume", **kw
    )
    assert resumed_module.seen == full_module.seen[2:]
    assert first_dm.drawn_log + resumed_dm.drawn_log == full_dm.drawn_log


def test_a_late_start_needs_the_one_step_off_pipeline():
    with pytest.raises(ConfigError, match=r"one_step_off.start_after_updates=2 .* set pipeline"):
        DynamicSamplingConfig(one_step_off={"start_after_updates": 2})
    with pytest.raises(ConfigError, match=r"one_step_off.start_after_updates must be an integer"):
        DynamicSamplingConfig(pipeline="one_step_off", one_step_off={"start_after_updates": -1})
    with pytest.raises(ConfigError, match=r"one_step_off is a group of settings"):
        DynamicSamplingConfig(one_step_off=True)


def test_a_flat_share_cores_of_an_older_checkpoint_loads_into_its_group():
    """A ``DynamicSamplingConfig`` pickled before the one-step-off settings were grouped (a
    flat ``share_cores``) unpickles with them in ``one_step_off``."""
    import pickle

    config = DynamicSamplingConfig(pipeline="one_step_off")
    legacy = {k: v for k, v in vars(config).items() if k != "one_step_off"}
    legacy["share_cores"] = False
    old = DynamicSamplingConfig.__new__(DynamicSamplingConfig)
    old.__dict__.update(legacy)  # the instance as an older release pickled it
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.one_step_off == OneStepOffConfig(share_cores=False, start_after_updates=0)
    assert "share_cores" not in vars(loaded)


def test_an_engine_device_needs_an_own_copy(tiny_checkpoint, tmp_path):
    """``engine_kwargs.device`` puts the HF engine's own copy on a device of its own (here the
    CPU: the GPU case is tests/test_gpu.py); with the shared policy it is refused by name."""
    dm = hf_dm(tiny_checkpoint, engine_kwargs={"device": "cpu"}, **PIPELINED)
    trainer(tmp_path / "own", 2).fit(ToyModule(tiny_checkpoint), datamodule=dm)
    assert dm.engine.owns_model and next(dm.engine.model.parameters()).device.type == "cpu"
    shared = hf_dm(tiny_checkpoint, engine_kwargs={"device": "cpu"})
    with pytest.raises(ValueError, match=r"engine_kwargs.device=.*pipeline: one_step_off"):
        trainer(tmp_path / "shared", 2).fit(ToyModule(tiny_checkpoint), datamodule=shared)


def test_the_next_batch_moves_through_named_states(tiny_checkpoint):
    """Without a trainer, ``start_after_updates: 2``: Idle before the first batch; Pending
    after the hand-over (a publish only takes the handle, ``state_dict`` refuses to save it);
    InFlight from the second publish on; Ready once the data module's ``state_dict`` quiesced
    it for the checkpoint; a rewind makes the handed batch Ready again, and the batch after it
    is generated again the same (the producer back at its start)."""
    from transformers import AutoModelForCausalLM

    from dapo_lightning.contract import PolicyHandle

    late = OneStepOffConfig(start_after_updates=2)
    dm = scripted_dm(tiny_checkpoint, carry_over=False, one_step_off=late, **PIPELINED)
    dm.setup("fit")
    stream, policy = dm.stream, AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint))
    assert isinstance(stream, OneStepOffStream) and isinstance(stream.state, Idle)
    assert dm.core_share() is stream.cores is not None
    try:
        dm.publish_policy(PolicyHandle(policy, 0))
        first = dm.next_rollout_batch()
        assert stream.state == Pending(dropped_prompts=dm.dropped_prompts, handed_at=0)
        with pytest.raises(RuntimeError, match=r"batch pending: call quiesce\(\) first"):
            stream.state_dict()
        dm.publish_policy(PolicyHandle(policy, 1))
        assert isinstance(stream.state, Pending)  # one update of the two
        dm.publish_policy(PolicyHandle(policy, 2))
        assert isinstance(stream.state, InFlight)
        saved = dm.state_dict()["ranks"][0]  # quiesced: the checkpoint holds the next batch
        assert isinstance(stream.state, Ready) and saved["ready"]["policy_version"] == 2
        nxt = stream.state.produced.batch
        dm.rewind_rollout_batch()
        assert stream.state == Ready(stream.state.produced) and stream.state.produced.batch is first
        assert dm.next_rollout_batch() is first and len(dm.drawn_log) == 1
        stream.quiesce()  # starts the pending batch with version 2 again
        again = stream.state.produced.batch
        assert torch.equal(again.input_ids, nxt.input_ids) and again.policy_version == 2
    finally:
        dm.teardown()
