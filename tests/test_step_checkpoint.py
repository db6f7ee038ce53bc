"""StepCheckpoint (callbacks/step_checkpoint.py): periodic saves at every crossing of a multiple
of ``every_n_train_steps`` when rollout steps make uneven numbers of updates (issue 53)."""

from __future__ import annotations

import torch
from dapo_lightning.callbacks import RunGuard
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dapo_lightning.module import DAPOModule
from dapo_lightning.update import BatchingConfig
from tests._harness import fit
from tests._module_harness import FixedBatches, fixed_batch, sgd
from tests._save_recorder import SaveRecorder

EVERY = 4
STEPS = 8


class UnevenBatches(FixedBatches):
    """The fixed batch (4 groups: 2 mini-batches of 2) every step; on every third step from
    the second the first mini-batch's responses are masked out, so that update is skipped
    (no tokens: no optimizer step) and the step makes 1 update instead of 2."""

    def train_dataloader(self) -> DataLoader:
        batches = []
        for step in range(self.steps):
            batch = self.batch.select(list(range(self.batch.batch_size)))
            if step % 3 == 1:
                batch.response_mask = batch.response_mask.clone()
                batch.response_mask[batch.group_index < 2] = 0
            batches.append(batch)
        return DataLoader(batches, batch_size=None)


class PlainModelCheckpoint(ModelCheckpoint):
    """Lightning's class as it is (a subclass: the guard leaves it alone), for the control."""


def uneven_fit(root, model, checkpoint_class: type[ModelCheckpoint]) -> SaveRecorder:
    saves = SaveRecorder()
    module = DAPOModule(
        str(model),
        optimizer=sgd,
        batching=BatchingConfig(mini_batch_size=2, micro_batch_size=16),
        parity_check_every=0,
    )
    checkpoint = checkpoint_class(
        dirpath=root / "ckpts", save_last=True, every_n_train_steps=EVERY, save_top_k=0
    )
    fit(
        module, UnevenBatches(fixed_batch(), steps=STEPS), [checkpoint, RunGuard(), saves],
        max_steps=100, max_epochs=1, default_root_dir=root, enable_checkpointing=True,
        num_sanity_val_steps=0,
    )  # fmt: skip
    return saves


def test_periodic_saves_come_at_every_crossing_with_uneven_steps(tmp_path, tiny_checkpoint):
    """Updates per step 2, 1, 2, 2, 1, 2, 2, 1: counts 2, 3, 5, 7, 8, 10, 12, 13. Every multiple
    of 4 gets a save at the end of the step that reaches or passes it (5, 8, 12), then the
    final one (13); Lightning's ModelCheckpoint alone, whose rule is "the count is a multiple",
    misses 4 (3 -> 5) and saves only 8 and 12."""
    torch.manual_seed(0)
    saves = uneven_fit(tmp_path / "step", tiny_checkpoint, ModelCheckpoint)
    assert saves.updates == [5, 8, 12, 13]
    for multiple in range(EVERY, 13, EVERY):
        assert any(multiple <= s < multiple + 2 for s in saves.updates), multiple
    control = uneven_fit(tmp_path / "plain", tiny_checkpoint, PlainModelCheckpoint)
    assert control.updates == [8, 12, 13]
