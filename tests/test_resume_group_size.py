"""Resuming with a changed group size (issue 38 item 5): the checkpoint's carried-over groups
have the old ``dynamic_sampling.n``; they are dropped on load with one warning naming the
change, and the resumed run trains on whole groups of the new size, one prompt each. Before
the fix the old groups went into the batch: it crashed ("RolloutBatch needs whole groups: got
232 responses for group_size=16") or, where the row count divided, trained silently on groups
that mix two prompts' responses and on the wrong number of groups (the three cross-size tests
here fail on that code; the same-size one guards against dropping too much)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_datamodule import ToyModule, scripted_dm, trainer
from test_producer import make_producer

CARRY_LOGGER = "dapo_lightning.data.sampling.carry_over"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def prompts_per_group(batch) -> list[int]:
    """How many different prompts each group of ``batch`` holds (1 for a real group): rows
    compared on their (left-padded) prompt columns, the ones before the response columns."""
    prompt = batch.input_ids[:, : batch.input_ids.shape[1] - batch.response_width]
    rows = prompt.view(batch.num_groups, batch.group_size, -1)
    return [len({tuple(r.tolist()) for r in group}) for group in rows]


class GroupCheckingModule(ToyModule):
    """ToyModule that also records the prompts per group of every batch it trains on."""

    def training_step(self, batch, batch_idx):
        self.groups_seen = getattr(self, "groups_seen", []) + [prompts_per_group(batch)]
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("new_n", [8, 2])
def test_producer_state_with_other_group_size_drops_the_carried_groups(tmp_path, caplog, new_n):
    kw = dict(gen_batch_size=12, carry_over=True, round_sizing="kept_frac")
    first = make_producer(n=4, **kw)
    first.next_batch(policy_version=0)
    carried = sum(r.num_groups for r, _ in first.carried)
    assert carried > 0  # the checkpoint holds groups of 4
    torch.save(first.state_dict(), tmp_path / "producer.pt")
    state = torch.load(tmp_path / "producer.pt", weights_only=True)

    resumed = make_producer(n=new_n, **kw)
    with caplog.at_level(logging.WARNING, logger=CARRY_LOGGER):
        resumed.load_state_dict(state)
        batch = resumed.next_batch(policy_version=1)
    # whole groups of the new size, each of one prompt, none of them carried from the old run
    assert batch.group_size == new_n and batch.num_groups == 8
    assert batch.batch_size == 8 * new_n and (batch.sample_version == 1).all()
    assert prompts_per_group(batch) == [1] * 8
    (note,) = _warnings(caplog)
    assert f"dynamic_sampling.n changed from 4 to {new_n}" in note
    assert f"its {carried} carried-over groups" in note
    # the rest of the state still applies: the prompt cursor continues where the run was
    assert resumed.sampler.state_dict() != make_producer(n=new_n, **kw).sampler.state_dict()


def test_producer_state_with_the_same_group_size_keeps_the_carried_groups(tmp_path, caplog):
    kw = dict(gen_batch_size=12, carry_over=True, round_sizing="kept_frac")
    first = make_producer(n=4, **kw)
    first.next_batch(policy_version=0)
    carried = sum(r.num_groups for r, _ in first.carried)
    resumed = make_producer(n=4, **kw)
    with caplog.at_level(logging.WARNING, logger=CARRY_LOGGER):
        resumed.load_state_dict(first.state_dict())
    assert _warnings(caplog) == []
    assert sum(r.num_groups for r, _ in resumed.carried) == carried > 0
    batch = resumed.next_batch(policy_version=1)
    assert int((batch.sample_version == 0).sum()) == min(carried, 8) * 4
    assert prompts_per_group(batch) == [1] * 8


def test_fit_resumed_from_a_checkpoint_with_another_n(tiny_checkpoint, tmp_path, caplog):
    """A real checkpoint of a fit with n=4 (carried groups in it), resumed by a fit with n=8
    through Trainer.fit(ckpt_path=...): the data module's load_state_dict path."""
    kw = dict(carry_over=True, gen_batch_size=6, retire_after=0)
    first_dm = scripted_dm(tiny_checkpoint, n=4, **kw)
    t1 = trainer(tmp_path / "a", 2)
    t1.fit(ToyModule(tiny_checkpoint), datamodule=first_dm)
    assert first_dm.stream.producer.carried  # what makes the resume hard: groups of 4 carried
    ckpt = tmp_path / "a" / "step2.ckpt"
    t1.save_checkpoint(ckpt)

    resumed_dm = scripted_dm(tiny_checkpoint, n=8, **kw)
    module = GroupCheckingModule(tiny_checkpoint)
    with caplog.at_level(logging.WARNING, logger=CARRY_LOGGER):
        trainer(tmp_path / "b", 4).fit(module, datamodule=resumed_dm, ckpt_path=ckpt)
    assert [s[1] for s in module.seen] == [2, 3]  # resumed at update 2
    assert all(size == 4 * 8 for *_, size in module.seen)  # 4 groups of 8 each step
    assert module.groups_seen == [[1] * 4, [1] * 4]  # each group one prompt's responses
    notes = [m for m in _warnings(caplog) if "carried-over groups" in m]
    assert len(notes) == 1 and "dynamic_sampling.n changed from 4 to 8" in notes[0]
