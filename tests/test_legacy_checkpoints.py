"""dapo_lightning.data.legacy_checkpoints: a one-step-off batch in flight saved before
``RolloutBatch.finish`` (a ``truncated`` mask) loads as today's batch."""

from __future__ import annotations

import torch

from dapo_lightning.batch import RolloutBatch
from dapo_lightning.data.legacy_checkpoints import legacy_ready_batch
from dapo_lightning.testing import make_random_rollout_batch


def test_a_saved_truncated_mask_becomes_finish_codes():
    batch = make_random_rollout_batch(num_groups=2, group_size=2)
    saved = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
    saved.pop("finish")
    saved["truncated"] = torch.tensor([False, True, True, False])
    loaded = RolloutBatch(**legacy_ready_batch(saved))
    assert loaded.finish.tolist() == [0, 1, 1, 0]
    assert loaded.truncated.tolist() == [False, True, True, False]
    assert not loaded.demonstrated.any()
    today = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
    assert legacy_ready_batch(today).keys() == today.keys()
    assert torch.equal(legacy_ready_batch(today)["finish"], batch.finish)
