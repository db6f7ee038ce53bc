"""Tests of dapo_lightning.advantages against hand computations (Python loops in float64)."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_lightning.advantages import ADVANTAGE_ESTIMATORS, compute_advantages


def _groups(rewards: list[float], ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        out.setdefault(g, []).append(i)
    return out


def _ref(rewards: list[float], ids: list[int], estimator: str, eps: float) -> list[float]:
    """Independent loop implementation of the four estimators."""
    groups = _groups(rewards, ids)
    mean = {g: sum(rewards[i] for i in idx) / len(idx) for g, idx in groups.items()}
    const = {g: len({rewards[i] for i in idx}) == 1 for g, idx in groups.items()}
    out = []
    centered = [0.0 if const[g] else r - mean[g] for r, g in zip(rewards, ids)]
    if estimator == "reinforce_baseline":
        mu = sum(centered) / len(centered)
        std = math.sqrt(sum((c - mu) ** 2 for c in centered) / (len(centered) - 1))
    for i, (r, g) in enumerate(zip(rewards, ids)):
        idx = groups[g]
        n = len(idx)
        if const[g]:
            out.append(0.0)
        elif estimator == "grpo":
            sd = math.sqrt(sum((rewards[j] - mean[g]) ** 2 for j in idx) / (n - 1))
            out.append((r - mean[g]) / (sd + eps))
        elif estimator == "reinforce_baseline":
            out.append(centered[i] / (std + eps))
        elif estimator == "rloo":
            others = [rewards[j] for j in idx if j != i]
            out.append(r - sum(others) / len(others))
        else:
            out.append(r - mean[g])
    return out


def _random_case(seed: int):
    """Non-contiguous, unequal groups with arbitrary ids, some with all-equal rewards."""
    g = torch.Generator().manual_seed(seed)
    sizes = [2, 5, 3, 8, 4, 2]
    ids = torch.cat([torch.full((n,), gid) for n, gid in zip(sizes, [7, 0, 42, 3, 11, 5])])
    rewards = torch.randn(len(ids), generator=g, dtype=torch.float64)
    rewards[ids == 42] = 0.1  # constant group (0.1 * 3 / 3 != 0.1 in floating point)
    rewards[ids == 5] = -1.0  # constant group
    perm = torch.randperm(len(ids), generator=g)  # groups interleaved, not contiguous
    return rewards[perm], ids[perm]


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_estimators_match_loop_reference(estimator, eps):
    rewards, ids = _random_case(seed=ADVANTAGE_ESTIMATORS.index(estimator))
    adv = compute_advantages(rewards, ids, estimator, eps=eps)
    expected = _ref(rewards.tolist(), ids.tolist(), estimator, eps)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(
        adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14
    )


def test_worked_example():
    # group a: rewards 1, 0, 0 (mean 1/3, unbiased std sqrt(1/3)); group b: 2, 4 (mean 3, std sqrt 2)
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 1, 0, 1, 0])
    s3, s2 = math.sqrt(1 / 3), math.sqrt(2)
    expected = {
        "grpo": [(2 / 3) / s3, -1 / s2, (-1 / 3) / s3, 1 / s2, (-1 / 3) / s3],
        "dr_grpo": [2 / 3, -1.0, -1 / 3, 1.0, -1 / 3],
        # leave-one-out: 1 - mean(0, 0); 2 - 4; 0 - mean(1, 0); 4 - 2; 0 - mean(1, 0)
        "rloo": [1.0, -2.0, -0.5, 2.0, -0.5],
    }
    # reinforce_baseline: centered = [2/3, -1, -1/3, 1, -1/3] (mean 0), std with n - 1 = 4
    centered = expected["dr_grpo"]
    std = math.sqrt(sum(c * c for c in centered) / 4)
    expected["reinforce_baseline"] = [c / std for c in centered]
    for est, values in expected.items():
        adv = compute_advantages(rewards, ids, est, eps=0.0)
        torch.testing.assert_close(
            adv, torch.tensor(values, dtype=torch.float64), rtol=1e-12, atol=0
        )


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_zero_variance_groups_get_exactly_zero(estimator, eps):
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.3, 0.3], dtype=torch.float32)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv = compute_advantages(rewards, ids, estimator, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[[0, 1, 2, 5, 6]] == 0).all()
    assert (adv[3:5] != 0).all()
    # a batch where every group is constant: all zeros, no NaN (0 / (0 + eps) and eps = 0 alike)
    flat = compute_advantages(
        torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), estimator, eps=eps
    )
    assert (flat == 0).all()


def test_grpo_equals_rescaled_reinforce_baseline():
    """A_grpo = A_rb * (std_global + eps) / (std_group + eps), per group."""
    rewards, ids = _random_case(seed=5)
    for eps in (1e-6, 0.0):
        grpo = compute_advantages(rewards, ids, "grpo", eps=eps)
        rb = compute_advantages(rewards, ids, "reinforce_baseline", eps=eps)
        centered = compute_advantages(rewards, ids, "dr_grpo")
        std_global = centered.std()
        for g in ids.unique():
            sel = ids == g
            std_g = rewards[sel].std()
            if std_g == 0:
                assert (grpo[sel] == 0).all() and (rb[sel] == 0).all()
                continue
            torch.testing.assert_close(
                grpo[sel], rb[sel] * (std_global + eps) / (std_g + eps), rtol=1e-12, atol=1e-14
            )


def test_rloo_is_scaled_dr_grpo():
    """r - (n mu - r)/(n - 1) = n/(n - 1) (r - mu): a cross-check of the leave-one-out form."""
    rewards, ids = _random_case(seed=6)
    rloo = compute_advantages(rewards, ids, "rloo")
    dr = compute_advantages(rewards, ids, "dr_grpo")
    n = torch.tensor([(ids == g).sum().item() for g in ids], dtype=torch.float64)
    torch.testing.assert_close(rloo, n / (n - 1) * dr, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_size_one_raises_for_grpo_and_rloo(estimator):
    with pytest.raises(ValueError, match="group size") as info:
        compute_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), estimator)
    assert "dr_grpo" in str(info.value) and "n >= 2" in str(info.value)


@pytest.mark.parametrize("estimator", ["dr_grpo", "reinforce_baseline"])
def test_group_size_one_is_zero_for_baseline_only_estimators(estimator):
    adv = compute_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), estimator)
    assert adv[2] == 0 and adv[0] > 0 > adv[1]
    single = compute_advantages(torch.tensor([3.0]), torch.tensor([0]), estimator)
    assert single.tolist() == [0.0]


def test_dtypes():
    ids = torch.tensor([0, 0, 1, 1])
    assert compute_advantages(torch.tensor([1, 0, 1, 1]), ids).dtype == torch.float32
    assert compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), ids).dtype == torch.float32
    bf = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.bfloat16), ids)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(
        bf.float(),
        compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), ids),
        atol=1e-2,
        rtol=1e-2,
    )
    assert compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_does_not_track_gradients_of_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2], requires_grad=True)
    assert not compute_advantages(rewards, torch.tensor([0, 0, 1, 1])).requires_grad


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"estimator": "ppo"}, ValueError, "grpo, reinforce_baseline, rloo, dr_grpo"),
        ({"rewards": torch.zeros(2, 2)}, ValueError, "rewards"),
        ({"group_index": torch.tensor([0, 0, 1])}, ValueError, "group_index"),
        ({"group_index": torch.tensor([0.0, 0.0, 1.0, 1.0])}, TypeError, "group_index"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"rewards": torch.tensor([1.0, float("nan"), 0.0, 1.0])}, ValueError, r"finite.*\[1\]"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, exc, match):
    args = {
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
        "group_index": torch.tensor([0, 0, 1, 1]),
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        compute_advantages(**args)
