"""PolicyState: the run state's checkpoint form (old and new checkpoints load), its declared
calls, and how a callback reaches it through ``pl_module``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from dapo_lightning.policy_state import HoldsPolicyState, PolicyState, policy_state_of

#: A checkpoint's ``"dapo"`` entry as every release so far wrote it (``rng`` beside it).
SAVED = {"policy_version": 12, "rollout_step": 5, "skipped_updates": 2, "entropy_coef": 0.003}


def test_state_dict_keeps_the_checkpoint_keys_and_round_trips() -> None:
    state = PolicyState(version=12, skipped_updates=2, entropy_coef=0.003, rollout_step=5)
    assert state.state_dict() == SAVED
    loaded = PolicyState(entropy_coef=0.5)
    loaded.load_state_dict({**SAVED, "rng": {"python": None}})  # the entry as saved
    assert loaded == state


def test_an_older_checkpoint_without_some_keys_loads() -> None:
    """Missing counts are 0; a missing entropy weight keeps the configured one."""
    state = PolicyState(version=3, skipped_updates=1, entropy_coef=0.25, rollout_step=2)
    state.load_state_dict({"policy_version": 7})
    assert state == PolicyState(version=7, skipped_updates=0, entropy_coef=0.25, rollout_step=0)
    state.load_state_dict({})
    assert state == PolicyState(version=0, skipped_updates=0, entropy_coef=0.25, rollout_step=0)


def test_declared_calls_change_only_their_field() -> None:
    state = PolicyState(version=4, skipped_updates=1, entropy_coef=0.0, rollout_step=3)
    assert state.bump_version() == 5
    state.set_entropy_coef(0.01)
    assert state == PolicyState(version=5, skipped_updates=1, entropy_coef=0.01, rollout_step=3)


def test_a_dapo_module_holds_the_loops_state_and_a_plain_module_none() -> None:
    from dapo_lightning.module import DAPOModule

    module = DAPOModule(policy=torch.nn.Linear(2, 2))
    assert isinstance(module, HoldsPolicyState)
    assert policy_state_of(module, "X") is module.updater.state
    plain = pl.LightningModule()
    assert not isinstance(plain, HoldsPolicyState)
    with pytest.raises(TypeError, match=r"^CollapseDetector needs a LightningModule"):
        policy_state_of(plain, "CollapseDetector")
