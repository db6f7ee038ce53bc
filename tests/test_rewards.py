"""Rewards: math-verify, arithmetic, the registry, and the runner's timeout / failure accounting
(real worker processes, real hangs). The DAPO "Answer:" rule is in tests/test_rewards_dapo.py."""

from __future__ import annotations

import math
import time

import pytest

from dapo_lightning.rewards import (
    DAPOAnswerReward,
    MathVerifyReward,
    RewardFailureError,
    RewardOutputError,
    RewardResult,
    RewardRunner,
    get_reward,
)
from dapo_lightning.tasks.arithmetic import ArithmeticReward


class HangingReward:
    """Hangs (sleeps far past the timeout) on responses containing "HANG"; raises on "BOOM"."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        out = []
        for r, g in zip(responses, ground_truths):
            if "HANG" in r:
                time.sleep(3600)
            if "BOOM" in r:
                raise ValueError("boom")
            out.append(RewardResult(1.0 if r == g else -1.0, r == g, {"has_answer": True}))
        return out


class NaNReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(math.nan, False) for _ in responses]


class ShortReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(1.0, True)]


def test_math_verify_boxed_and_latex():
    reward = MathVerifyReward()
    res = reward(
        [
            "So we get \\boxed{\\frac{1}{2}}.",
            "The final answer is $0.5$",
            "\\boxed{\\frac{1}{3}}",
            "I do not know",
            "Thus \\boxed{540}",
        ],
        ["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", "540"],
    )
    assert [r.acc for r in res] == [True, True, False, False, True]
    assert [r.score for r in res] == [1.0, 1.0, -1.0, -1.0, 1.0]
    assert res[3].extra["has_answer"] is False and res[2].extra["has_answer"] is True


def test_arithmetic_reward_strict_and_lenient():
    strict = ArithmeticReward()
    res = strict([" 12 ", "12 apples", "13", ""], ["12"] * 4)
    assert [r.acc for r in res] == [True, False, False, False]
    assert [r.extra["has_answer"] for r in res] == [True, False, True, False]
    lenient = ArithmeticReward(strict=False)
    res = lenient(["it is 3, no 12", "12 apples", "none"], ["12"] * 3)
    assert [r.score for r in res] == [1.0, 1.0, -1.0]


def test_get_reward():
    assert isinstance(get_reward("dapo"), DAPOAnswerReward)
    assert isinstance(get_reward("math_verify"), MathVerifyReward)
    assert get_reward("arithmetic", strict=False).strict is False
    obj = HangingReward()
    assert get_reward(obj) is obj
    with pytest.raises(ValueError, match="not a built-in reward"):
        get_reward("nope")


def test_runner_timeout_and_failure_counting():
    runner = RewardRunner(
        HangingReward(), timeout_s=1.0, num_workers=2, max_failure_frac=0.5, chunk_size=4
    )
    try:
        responses = ["1", "HANG", "2", "BOOM", "3", "4"]
        truths = ["1", "1", "2", "2", "0", "4"]
        t0 = time.monotonic()
        res = runner.score(responses, truths)
        elapsed = time.monotonic() - t0
        # The hang lasts an hour: finishing at all proves the 1 s timeout cut it (the bound is
        # loose on purpose: these cores are shared and noisy).
        assert elapsed < 600, elapsed
        assert [r.acc for r in res] == [True, False, True, False, False, True]
        assert res[1].extra["reward_failure"] == "timeout"
        assert res[3].extra["reward_failure"].startswith("error")
        assert "boom" in res[3].extra["reward_failure"]
        assert res[1].score == -1.0 and res[3].score == -1.0
        assert runner.last_failures == 2
        # The killed worker was replaced: the runner still works.
        assert [r.acc for r in runner.score(["5"], ["5"])] == [True]
        with pytest.raises(RewardFailureError, match="data.scoring.max_failure_frac"):
            runner.score(["HANG", "BOOM", "1"], ["1", "1", "1"])
    finally:
        runner.close()


def test_runner_in_process_counts_exceptions():
    runner = RewardRunner(HangingReward(), in_process=True, max_failure_frac=0.5)
    res = runner.score(["1", "BOOM", "2"], ["1", "1", "2"])
    assert [r.acc for r in res] == [True, False, True]
    assert runner.last_failures == 1


@pytest.mark.parametrize("in_process", [True, False])
def test_runner_rejects_nan_and_wrong_length(in_process):
    for bad, match in ((NaNReward(), "finite"), (ShortReward(), "1 results for 2 responses")):
        runner = RewardRunner(bad, in_process=in_process, timeout_s=30)
        try:
            with pytest.raises(RewardOutputError, match=match):
                runner.score(["a", "b"], ["a", "b"])
        finally:
            runner.close()


# ------------------------------------------------------------- bad reward specs and outputs


def test_get_reward_builds_a_config_class_path():
    reward = get_reward(
        {"class_path": "dapo_lightning.tasks.arithmetic.ArithmeticReward",
         "init_args": {"strict": True}},
        strict=False,
    )  # fmt: skip
    assert isinstance(reward, ArithmeticReward) and reward.strict is False  # kwargs win


@pytest.mark.parametrize(
    ("class_path", "match"),
    [
        ("my_rewards.Exact", r"'my_rewards\.Exact' does not import \(ModuleNotFoundError: No module named 'my_rewards'\)"),
        ("dapo_lightning.rewards.Exact", r"'dapo_lightning\.rewards\.Exact' does not import \(AttributeError: .*Exact"),
        ("Exact", r"'Exact' must be a dotted path"),
    ],
)  # fmt: skip
def test_get_reward_class_path_that_does_not_import(class_path, match):
    with pytest.raises(ImportError, match=match):
        get_reward({"class_path": class_path})


def test_get_reward_class_path_with_wrong_init_args():
    path = "dapo_lightning.tasks.arithmetic.ArithmeticReward"
    with pytest.raises(TypeError, match=r"'dapo_lightning\.tasks.*' could not be built with "
                       r"init_args \{'strictness': 1\}"):  # fmt: skip
        get_reward({"class_path": path, "init_args": {"strictness": 1}})


class _ReturnsBadResult:
    failure_score = -1.0

    def __init__(self, **fields):
        self.fields = fields

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(**{"score": 1.0, "acc": True, **self.fields}) for _ in responses]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"score": "bad"}, r"_ReturnsBadResult returned RewardResult\(score='bad'\) at position "
                           r"0: the field score must be a number \(a str is not\)"),
        ({"score": None}, r"RewardResult\(score=None\) .*field score must be a number"),
        ({"acc": None}, r"RewardResult\(acc=None\) .*field acc must be True or False"),
        ({"acc": "yes"}, r"RewardResult\(acc='yes'\) .*field acc must be True or False"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("in_process", [True, False])
def test_bad_reward_result_fields_name_reward_field_and_value(fields, match, in_process):
    runner = RewardRunner(_ReturnsBadResult(**fields), in_process=in_process, timeout_s=30)
    try:
        with pytest.raises(RewardOutputError, match=match):
            runner.score(["a"], ["a"])
    finally:
        runner.close()


def test_numpy_and_tensor_scores_are_numbers():
    import numpy as np
    import torch

    for score, acc in ((np.float32(0.5), np.bool_(True)), (torch.tensor(1.0), 1), (1, False)):
        runner = RewardRunner(_ReturnsBadResult(score=score, acc=acc), in_process=True)
        (result,) = runner.score(["a"], ["a"])
        assert float(result.score) == float(score)
