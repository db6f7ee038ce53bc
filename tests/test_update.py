"""dapo_lightning.update: mini-batch cuts, micro-batch rows, stale-sample correction."""

from __future__ import annotations

import pytest
import torch

from dapo_lightning.rollout_correction import RolloutCorrection
from dapo_lightning.testing import make_random_rollout_batch
from dapo_lightning.update import (
    behaviour_log_probs,
    micro_batch,
    micro_batch_rows,
    mini_batch_ranges,
    rows_of_groups,
    split_groups,
)


def test_split_groups_is_even_and_covers_everything():
    assert split_groups(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_groups(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert split_groups(2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]


def test_mini_batches_keep_the_update_count_of_a_full_batch():
    # 16 groups over 2 ranks, mini-batches of 4 prompts: 2 per rank per update, 4 updates
    assert mini_batch_ranges(8, 4, 2, 8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # a short batch (5 groups kept here) still makes 4 updates: every rank makes the same ones
    assert len(mini_batch_ranges(5, 4, 2, 8)) == 4
    assert mini_batch_ranges(3, None, 2, 8) == [range(0, 3)]
    with pytest.raises(ValueError, match="divisible by the world size"):
        mini_batch_ranges(8, 3, 2, 8)
    with pytest.raises(ValueError, match="does not divide the rollout batch"):
        mini_batch_ranges(8, 6, 2, 8)


def test_micro_batch_rows_by_length_or_with_each_group_together():
    lengths = torch.tensor([5, 9, 2, 7, 8, 1])
    assert micro_batch_rows(lengths, 2) == [[1, 4], [3, 0], [2, 5]]
    assert micro_batch_rows(lengths, 4, max_tokens=20) == [[1, 4], [3, 0], [2, 5]]
    # groups [0, 0, 1, 1, 2, 2]: group 0 holds the longest row (9), then group 2 (8), group 1
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert micro_batch_rows(lengths, 2, groups=groups) == [[1, 0], [4, 5], [3, 2]]
    assert micro_batch_rows(lengths, 4, groups=groups) == [[1, 0, 4, 5], [3, 2]]


def test_rows_of_groups_and_empty_micro_batch():
    assert rows_of_groups(range(1, 3), 4) == [4, 5, 6, 7, 8, 9, 10, 11]
    batch = make_random_rollout_batch(num_groups=2, group_size=2)
    pad = micro_batch(batch, [])
    assert pad.batch_size == 1 and float(pad.response_mask.sum()) == 0.0
    empty = batch.select([])
    assert micro_batch(empty, []).response_mask.shape == (1, 1)


def test_stale_rows_are_corrected_against_the_engine_fresh_rows_not_at_all():
    batch = make_random_rollout_batch(num_groups=2, group_size=2)
    old = batch.rollout_log_probs + 0.3  # the policy moved since sampling
    stale = torch.tensor([True, True, False, False])
    logp, correction = behaviour_log_probs(batch, old, stale, RolloutCorrection(stale_tis_cap=2.0))
    assert correction.resolved() == ("token_truncate", 2.0, None)
    cap = correction.clip_max
    assert torch.equal(logp[:2], batch.rollout_log_probs[:2])  # engine's: w = min(e^0.3, 2)
    assert torch.equal(logp[2:], old[2:])  # w = exp(old - old) = 1
    weight = torch.clamp(torch.exp(old - logp), max=cap)
    assert torch.allclose(
        weight[:2], torch.full_like(weight[:2], float(torch.exp(torch.tensor(0.3))))
    )
    assert torch.allclose(weight[2:], torch.ones_like(weight[2:]))
    # tis_cap corrects every row against the engine; nothing stale and no cap: no correction
    tis = RolloutCorrection("token_truncate", clip_max=1.5)
    assert behaviour_log_probs(batch, old, stale, tis) == (batch.rollout_log_probs, tis)
    fresh = torch.zeros(4, dtype=torch.bool)
    assert behaviour_log_probs(batch, old, fresh, RolloutCorrection(stale_tis_cap=2.0)) is None
    assert behaviour_log_probs(batch, old, stale, RolloutCorrection(stale_tis_cap=None)) is None


def test_a_demonstrated_row_is_its_own_behaviour_policy():
    """A demonstration (``batch.demonstrated``, environment.demonstrate_unsolved) takes ``old``
    under a correction mode and under the stale cap, so its weight is exactly 1, while the
    sampled rows keep the engine's; a NaN engine log-prob stays bad input (not a marker)."""
    batch = make_random_rollout_batch(num_groups=2, group_size=2)
    engine = batch.rollout_log_probs.clone()
    batch.finish = torch.tensor([0, 2, 1, 0])  # stop, demonstration, length, stop
    old = engine + 0.3
    tis = RolloutCorrection("token_truncate", clip_max=1.5)
    logp, _ = behaviour_log_probs(batch, old, torch.zeros(4, dtype=torch.bool), tis)
    assert torch.equal(logp[1], old[1])
    assert torch.equal(logp[[0, 2, 3]], engine[[0, 2, 3]])
    stale = torch.tensor([True, True, False, False])
    logp, _ = behaviour_log_probs(batch, old, stale, RolloutCorrection(stale_tis_cap=2.0))
    assert torch.equal(logp[0], engine[0]) and torch.equal(logp[1:], old[1:])
    with pytest.raises(ValueError, match="old log-probs"):
        behaviour_log_probs(batch, None, stale, tis)
    assert batch.select([1, 2]).demonstrated.tolist() == [True, False]
    assert batch.truncated.tolist() == [False, False, True, False]
