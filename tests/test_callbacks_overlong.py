"""Tests for dapo_lightning.callbacks.overlong: Eq. 13 penalty and the shaping callback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dapo_lightning.callbacks.overlong import OverlongRewardShaping, overlong_penalty

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.rollout.base import SamplingConfig


class RecordingModule:
    """Stand-in for the LightningModule: the hooks only call ``log`` on it, and logging
    outside a running Trainer loop is refused by Lightning, so this one records the calls."""

    def __init__(self) -> None:
        self.logged: dict[str, list[float]] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged.setdefault(name, []).append(float(value))


def make_rollouts(lengths: list[int], truncated: list[bool], max_len: int) -> ScoredRollouts:
    n = len(lengths)
    return ScoredRollouts(
        prompt_ids=[[5, 6]] * n,
        response_ids=[[7] * length for length in lengths],
        rollout_log_probs=[[-0.5] * length for length in lengths],
        finish_reason=["length" if t else "stop" for t in truncated],
        group_index=torch.arange(n) // 2,
        prompt_uid=[f"p{i // 2}" for i in range(n)],
        score=torch.ones(n),
        acc=torch.ones(n),
        sampling=SamplingConfig(max_tokens=max_len),
    )


# Lmax = 20, Lcache = 4: penalty starts after 16 and reaches -1 at 20.
@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (15, 0.0),
        (16, 0.0),  # L = Lmax - Lcache: still free
        (17, -0.25),
        (18, -0.5),
        (19, -0.75),
        (20, -1.0),  # L = Lmax
        (21, -1.0),  # past the maximum
        (1000, -1.0),
    ],
)
def test_penalty_on_ints_around_both_boundaries(length: int, expected: float) -> None:
    value = overlong_penalty(length, 20, 4)
    assert isinstance(value, float)
    assert value == pytest.approx(expected)
    assert overlong_penalty(length, 20, 4, penalty_factor=0.5) == pytest.approx(0.5 * expected)


def test_penalty_on_tensors_matches_ints_elementwise() -> None:
    lengths = torch.tensor([[0, 16, 17], [19, 20, 25]])
    out = overlong_penalty(lengths, 20, 4, penalty_factor=2.0)
    assert out.shape == lengths.shape and out.dtype == torch.float32
    expected = torch.tensor(
        [[overlong_penalty(int(x), 20, 4, 2.0) for x in row] for row in lengths]
    )
    torch.testing.assert_close(out, expected)
    # a float tensor keeps its dtype
    assert overlong_penalty(lengths.double(), 20, 4).dtype == torch.float64


def test_paper_scale_values() -> None:
    # DAPO paper: 20480 tokens, 4096 buffer -> free up to 16384
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(16384 + 2048, 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)


def test_zero_buffer_only_punishes_past_the_maximum() -> None:
    assert overlong_penalty(20, 20, 0) == 0.0
    assert overlong_penalty(21, 20, 0) == -1.0
    out = overlong_penalty(torch.tensor([19, 20, 21]), 20, 0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -1.0]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_response_length": 20, "buffer_length": 20}, "buffer_length must be in"),
        ({"max_response_length": 20, "buffer_length": -1}, "buffer_length must be an integer >= 0"),
        (
            {"max_response_length": 0, "buffer_length": 0},
            "max_response_length must be an integer >= 1",
        ),
        ({"max_response_length": 20, "buffer_length": 4, "penalty_factor": -1.0}, "penalty_factor"),
        ({"max_response_length": 20, "buffer_length": 4.0}, "buffer_length must be an integer"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, match: str) -> None:
    """The function names its arguments; the callback names its own fields."""
    with pytest.raises(ValueError, match=f"^{match}"):
        overlong_penalty(5, **kwargs)
    with pytest.raises(ValueError, match=f"^OverlongRewardShaping.{match}"):
        OverlongRewardShaping(**kwargs)


def test_callback_shapes_reward_in_place_with_run_max_length() -> None:
    rollouts = make_rollouts([10, 17, 18, 20], [False, False, False, True], max_len=20)
    reward = rollouts.reward
    cb = OverlongRewardShaping(buffer_length=4)
    cb.on_rollouts_scored(SimpleNamespace(), RecordingModule(), rollouts)
    assert rollouts.reward is reward  # mutated in place
    torch.testing.assert_close(rollouts.reward, torch.tensor([1.0, 0.75, 0.5, 0.0]))
    assert rollouts.score.eq(1).all()  # raw score untouched
    assert rollouts.loss_mask.all()  # no filtering by default


def test_explicit_max_length_overrides_the_rollouts() -> None:
    rollouts = make_rollouts([10, 12], [False, False], max_len=20)
    OverlongRewardShaping(buffer_length=4, max_response_length=12).on_rollouts_scored(
        SimpleNamespace(), RecordingModule(), rollouts
    )
    torch.testing.assert_close(rollouts.reward, torch.tensor([0.5, 0.0]))


def test_buffer_not_below_run_max_length_is_a_clear_error() -> None:
    rollouts = make_rollouts([3], [False], max_len=4)
    with pytest.raises(ValueError, match="buffer_length=4"):
        OverlongRewardShaping(buffer_length=4).on_rollouts_scored(
            SimpleNamespace(), RecordingModule(), rollouts
        )


def test_filtering_removes_truncated_responses_from_the_token_count() -> None:
    rollouts = make_rollouts([5, 20, 8, 20], [False, True, False, True], max_len=20)
    cb = OverlongRewardShaping(buffer_length=4, overlong_filtering=True, apply_penalty=False)
    cb.on_rollouts_scored(SimpleNamespace(), RecordingModule(), rollouts)
    assert rollouts.loss_mask.tolist() == [True, False, True, False]
    torch.testing.assert_close(rollouts.reward, torch.ones(4))  # no penalty
    batch = RolloutBatch.from_rollouts(rollouts, group_size=2, pad_token_id=0)
    assert batch.response_mask.sum().item() == 5 + 8  # truncated tokens left the count
    assert batch.response_mask[[1, 3]].sum().item() == 0


def test_logs_stashed_rates_at_batch_end_and_state_round_trip() -> None:
    module = RecordingModule()
    cb = OverlongRewardShaping(buffer_length=4, overlong_filtering=True)
    # two generation rounds for one rollout step
    cb.on_rollouts_scored(None, module, make_rollouts([18, 20], [False, True], 20))
    cb.on_rollouts_scored(None, module, make_rollouts([4, 20], [False, True], 20))
    assert module.logged == {}  # nothing logged inside the buffer hook
    cb.on_train_batch_end(None, module, None, None, 0)
    assert module.logged["overlong/truncation_rate"] == [0.5]
    assert module.logged["overlong/mean_penalty"] == [pytest.approx((-0.5 - 1.0 - 1.0) / 4)]
    assert module.logged["overlong/filtered"] == [0.5]
    assert cb.totals["responses"] == 4 and cb.totals["truncated"] == 2

    restored = OverlongRewardShaping(buffer_length=4, overlong_filtering=True)
    restored.load_state_dict(cb.state_dict())
    assert restored.state_dict() == cb.state_dict()
    # both continue identically
    for c in (cb, restored):
        c.on_rollouts_scored(None, module, make_rollouts([19, 3], [False, False], 20))
    assert restored.state_dict() == cb.state_dict()
    assert restored.totals["penalty_sum"] == pytest.approx(-0.5 - 2.0)  # a step takes a round
    for c in (cb, restored):
        c.on_train_batch_end(None, module, None, None, 0)
    assert restored.totals == cb.totals
    assert restored.totals["penalty_sum"] == pytest.approx(-0.5 - 2.0 - 0.75)
