"""Prompt selection's pure pieces (issue 40): selection weights pinned against hand
computations, reviews of retired prompts, the regression statistic, the settings' checks, and
the statistics reaching metrics.csv in a real fit."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from dapo_lightning.checks import ConfigError
from dapo_lightning.data.sampling.producer import DynamicSamplingConfig
from dapo_lightning.data.selection.difficulty import (
    PRIOR,
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
    PromptStats,
    revisit_interval,
    skip_probability,
    take_probability,
)

REPO = Path(__file__).resolve().parents[1]


def hand_p0(correct: int, wrong: int, n: int) -> float:
    """E[p^n + (1 - p)^n] under Beta(prior + counts), as exact fractions of the moments."""
    a = Fraction(PRIOR[0]).limit_denominator(1000) + correct
    b = Fraction(PRIOR[1]).limit_denominator(1000) + wrong
    right = wrong_all = Fraction(1)
    for k in range(n):
        right *= (a + k) / (a + b + k)
        wrong_all *= (b + k) / (a + b + k)
    return float(right + wrong_all)


SEL = PromptSelectionConfig(max_skip=0.9, revisit_after=2, revisit_within=8, review_weight=0.2)


def visited(correct: float, wrong: float, last: int = 0, **kw) -> PromptStats:
    return PromptStats(visits=1, recent_correct=correct, recent_wrong=wrong, last_epoch=last, **kw)


def test_hand_p0_values():
    right = (4.05 / 4.1) * (5.05 / 5.1) * (6.05 / 6.1) * (7.05 / 7.1)
    wrong = (0.05 / 4.1) * (1.05 / 5.1) * (2.05 / 6.1) * (3.05 / 7.1)
    assert hand_p0(4, 0, 4) == pytest.approx(right + wrong, rel=1e-12)
    assert 0.96 < hand_p0(4, 0, 4) < 0.97
    mixed = 2 * (2.05 / 4.1) * (3.05 / 5.1) * (4.05 / 6.1) * (5.05 / 7.1)
    assert hand_p0(2, 2, 4) == pytest.approx(mixed, rel=1e-12)
    assert 0.28 < mixed < 0.29


@pytest.mark.parametrize(
    "stats, epoch, take",
    [
        (None, 3, 1.0),  # never seen
        (PromptStats(), 3, 1.0),  # tracked, never visited
        (visited(4, 0, solved_streak=1), 1, 0.1),  # P0 = 0.961 > 1/2, not due: 1 - max_skip
        (visited(4, 0, solved_streak=1), 2, 1.0),  # due after revisit_after = 2 epochs
        (visited(4, 0, solved_streak=2), 3, 0.1),  # streak 2: due after 4
        (visited(4, 0, solved_streak=2), 4, 1.0),
        (visited(0, 4, wrong_streak=5), 7, 0.1),  # the back-off is capped at revisit_within 8
        (visited(0, 4, wrong_streak=5), 8, 1.0),
        (visited(2, 2), 1, 1.0),  # P0 = 0.282 <= 1/2: taken
        (visited(4, 0, solved_streak=3, retired=True), 1, 0.2),  # retired: review_weight
        (visited(4, 0, solved_streak=3, retired=True), 50, 0.2),  # whatever the due date
    ],
)
def test_take_probability_pins_hand_made_histories(stats, epoch, take):
    assert take_probability(stats, epoch, 4, SEL) == pytest.approx(take, abs=1e-12)
    if stats is None or not stats.retired:
        assert skip_probability(stats, epoch, 4, SEL) == pytest.approx(1.0 - take, abs=1e-12)
    if stats is not None and stats.last_epoch is not None:
        p0 = hand_p0(int(stats.recent_correct), int(stats.recent_wrong), 4)
        due = epoch - stats.last_epoch >= revisit_interval(stats, SEL)
        if not stats.retired and not due:
            assert (take < 1.0) == (p0 > SEL.skip_threshold)


def test_revisit_interval_is_the_doubling_capped():
    intervals = [revisit_interval(PromptStats(wrong_streak=k), SEL) for k in range(7)]
    assert intervals == [2, 2, 4, 8, 8, 8, 8]  # min(2 * 2^(k - 1), 8), k = max(1, streak)


def test_reviews_come_at_the_review_weight_and_not_at_0():
    retired = visited(4, 0, solved_streak=3, retired=True)
    sel = PredictiveSelector(4, SEL, seed=7)
    draws = 20000
    taken = sum(sel.review(retired) for _ in range(draws))
    assert taken == sel.reviewed
    assert abs(taken / draws - 0.2) < 0.012  # 4 standard errors
    assert not sel.review(visited(4, 0, solved_streak=1))  # not retired: no review, no draw
    off = PredictiveSelector(4, PromptSelectionConfig(review_weight=0.0), seed=7)
    state = off.rng.getstate()
    assert not any(off.review(retired) for _ in range(100)) and off.rng.getstate() == state
    # the reviews so far are in the selector's state
    again = PredictiveSelector(4, SEL, seed=0)
    again.load_state_dict(sel.state_dict())
    assert again.reviewed == taken and again.rng.random() == sel.rng.random()


def test_regressed_frac_and_failed_reviews():
    """A: all-correct, then not (regressed). B: all-correct twice (retired, not regressed).
    C: all wrong, then all-correct (solved later, not regressed). D: mixed. Regressed: 1 of 4.
    A review of B that fails puts B back in the draw and counts it as regressed: 2 of 4."""
    tr = DifficultyTracker(PromptSelectionConfig(retire_after=2))
    assert tr.regressed_frac == 0.0
    for uid, visits in {
        "A": [[1, 1, 1, 1], [1, 0, 1, 1]],
        "B": [[1, 1, 1, 1], [1, 1, 1, 1]],
        "C": [[0, 0, 0, 0], [1, 1, 1, 1]],
        "D": [[1, 0, 0, 0]],
    }.items():
        for epoch, accs in enumerate(visits):
            tr.update(uid, accs, epoch)
    assert [tr.stats[u].regressed for u in "ABCD"] == [True, False, False, False]
    assert tr.regressed_frac == 0.25 and tr.stats["B"].retired and tr.num_retired == 1
    tr.update("B", [1, 1, 0, 1], 5)  # the review of a retired prompt finds it regressed
    assert not tr.stats["B"].retired and tr.eligible("B", 6)
    assert tr.regressed_frac == 0.5 and tr.num_retired == 0
    # the flags are in the checkpointed statistics
    back = DifficultyTracker(tr.config)
    back.load_state_dict(tr.state_dict())
    assert back.stats == tr.stats and back.regressed_frac == 0.5


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_review_weight_out_of_range_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"data\.dynamic_sampling\.selection\.review_weight"):
        PromptSelectionConfig(review_weight=bad)


def test_min_gen_batch_size_is_checked_and_defaults_to_no_floor():
    assert DynamicSamplingConfig().min_gen_batch_size == 1
    assert PromptSelectionConfig().review_weight == 0.2
    with pytest.raises(ConfigError, match=r"data\.dynamic_sampling\.min_gen_batch_size"):
        DynamicSamplingConfig(min_gen_batch_size=0)


def test_selection_statistics_reach_metrics_csv(tmp_path, tiny_checkpoint):
    """A real 3-update fit (the console script on the quickstart config, the tiny model, a
    reward the random model earns half the time, predictive selection with retiring): every
    rollout step logs data/regressed_frac and data/review_frac, fractions in [0, 1]."""
    run_dir = tmp_path / "run"
    override = tmp_path / "override.yaml"
    override.write_text(
        f"""
trainer:
  default_root_dir: {run_dir}
  callbacks: []
model:
  init_args:
    model_name_or_path: {tiny_checkpoint}
    batching: {{mini_batch_size: null}}
data:
  init_args:
    prompts: {{task_kwargs: {{level: 1, num_prompts: 10}}}}
    reward: {{class_path: _length_reward.EvenLengthReward}}
    sampling: {{max_tokens: 4}}
    dynamic_sampling:
      n: 4
      train_batch_size: 4
      gen_batch_size: 4
      selection: {{strategy: predictive, retire_after: 1, review_weight: 1.0}}
"""
    )
    cli = str(Path(sys.executable).parent / "dapo-lightning")
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(override)]
    args += ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    proc = subprocess.run(
        [cli, "fit", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics,) = run_dir.rglob("metrics.csv")
    with open(metrics, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/step")]
    assert len(rows) == 3
    for key in ("data/regressed_frac", "data/review_frac"):
        values = [float(r[key]) for r in rows]
        assert all(0.0 <= v <= 1.0 for v in values), (key, values)
