"""Rollout correction (dapo_lightning/rollout_correction.py) against TRL 1.16 and by hand.

TRL computes its vLLM importance-sampling ratio inline in
``GRPOTrainer._generate_and_score_completions`` (trl/trainer/grpo_trainer.py, 1.16.0, lines
2660-2706; its ``sampling/*`` metrics at lines 2860-2895). That method generates with vLLM,
scores rewards and tokenizes, so it cannot be called on tensors; ``trl_ratio`` and
``trl_metrics`` below are a literal float64 transcription of those lines. What TRL then does
with the ratio, ``per_token_loss * importance_sampling_ratio`` (line 3146-3147), is driven in
TRL's own ``_compute_loss`` (tests/test_objectives.py's harness), and our full loss must equal it.
"""

from __future__ import annotations

import math

import pytest
import torch

from dapo_lightning.loss import LOSS_PATH, PolicyLossConfig
from dapo_lightning.policy_loss import compute_policy_loss
from dapo_lightning.rollout_correction import (
    PRESETS,
    ROLLOUT_CORRECTION_PATH,
    TRL_METRICS,
    RolloutCorrection,
    correction_weights,
)
from dapo_lightning.update import MODEL_PATH
from tests.test_objectives import _fixed_tensors, ours, trl_loss

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """grpo_trainer.py 2660-2706, transcribed (float64)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def trl_metrics(old, sampling, mask, mode, ratio):
    """grpo_trainer.py 2860-2895, transcribed (one process)."""
    delta = torch.abs(old - sampling)
    m = mask.bool()
    delta = delta[m & ~torch.isnan(delta)]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[m]
    return {
        TRL_METRICS[0]: delta.mean(),
        TRL_METRICS[1]: delta.max(),
        TRL_METRICS[2]: flat.min(),
        TRL_METRICS[3]: flat.mean(),
        TRL_METRICS[4]: flat.max(),
    }


def _engine(old, mask, seed=3):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(old.shape, generator=g, dtype=old.dtype)
    return old + 0.25 * noise * mask


@pytest.mark.parametrize("mode", TRL_MODES)
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (None, 1.2), (0.8, 1.2)])
def test_weights_and_metrics_equal_trl(mode, clip_min, clip_max):
    _, old, _, mask = _fixed_tensors()
    engine = _engine(old, mask)
    correction = RolloutCorrection(mode, clip_max=clip_max, clip_min=clip_min)
    weights, metrics = correction_weights(old, engine, mask != 0, correction)
    want = trl_ratio(old, engine, mask, mode, clip_min, clip_max)
    assert torch.allclose(weights, (want * mask).expand_as(weights), atol=1e-12, rtol=0)
    for key, value in trl_metrics(old, engine, mask, mode, want).items():
        assert float(metrics[key]) == pytest.approx(float(value), abs=1e-12), key
    # ours beside TRL's: token-weighted mean and min over the valid tokens
    valid = mask != 0
    assert float(metrics["tis_weight_mean"]) == pytest.approx(float(weights[valid].mean()))
    assert float(metrics["tis_weight_min"]) == pytest.approx(float(weights[valid].min()))
    assert float(metrics["tis_masked_frac"]) == pytest.approx(
        float((weights[valid] == 0).double().mean())
    )


def test_the_cases_exercise_truncation_and_masking():
    _, old, _, mask = _fixed_tensors()
    engine = _engine(old, mask)
    for mode in TRL_MODES:
        raw = trl_ratio(
            old, engine, mask, mode.replace("truncate", "mask"), None, None
        )  # no bounds
        assert bool(((raw > 1.2) & (mask != 0 if mode.startswith("token") else True)).any()), mode
        assert bool(((raw < 0.8) & (mask != 0 if mode.startswith("token") else True)).any()), mode


@pytest.mark.parametrize("mode", TRL_MODES)
def test_loss_with_correction_equals_trl_compute_loss(mode):
    """The weight multiplies the objective's token loss before aggregation, as in TRL."""
    pytest.importorskip("trl")
    logp, old, adv, mask = _fixed_tensors()
    engine = _engine(old, mask)
    ratio = trl_ratio(old, engine, mask, mode, None, 1.2)
    want, want_grad, _ = trl_loss("dapo", "token", logp, old, adv, mask,
                                  eps_low=0.2, eps_high=0.28, is_ratio=ratio)  # fmt: skip
    correction = RolloutCorrection(mode, clip_max=1.2)
    got, grad, _ = ours(logp, old, adv, mask, rollout_log_probs=engine,
                        config=PolicyLossConfig(rollout_correction=correction))  # fmt: skip
    # float64 on both sides (tests/test_objectives.py's bound): a formula difference, never
    # float64 reordering (1e-16), could reach 1e-6
    assert abs(float(got - want)) <= 1e-6
    assert float((grad - want_grad).abs().max()) <= 1e-6


def test_trl_preset_is_trls_default():
    """One setting: TRL 1.16's vllm_importance_sampling_mode / clip_max / clip_min defaults."""
    from dataclasses import fields

    pytest.importorskip("trl")
    from trl import GRPOConfig

    defaults = {f.name: f.default for f in fields(GRPOConfig)}
    mode = defaults["vllm_importance_sampling_mode"]
    high, low = (
        defaults["vllm_importance_sampling_clip_max"],
        defaults["vllm_importance_sampling_clip_min"],
    )
    assert RolloutCorrection("trl").resolved() == (mode, high, low) == ("sequence_mask", 3.0, None)


def test_presets_resolve_and_explicit_bounds_win():
    assert RolloutCorrection("icepop").resolved() == ("token_mask", 5.0, 0.5)
    assert RolloutCorrection("geo_mean").resolved() == ("geometric_mask", 1.001, 0.999)
    assert RolloutCorrection("token_tis").resolved() == ("token_truncate", 2.0, None)
    assert RolloutCorrection("seq_tis", clip_max=4.0).resolved() == ("sequence_truncate", 4.0, None)
    assert RolloutCorrection("seq_mis").resolved() == ("sequence_mask", 2.0, 0.5)
    assert set(PRESETS) == {"trl", "token_tis", "seq_tis", "seq_mis", "geo_mean", "icepop"}


def test_geometric_mean_rejects_whole_rows_by_their_mean_log_ratio():
    """w = 1 on every token of a row whose exp(mean_t d_t) is inside the band, else 0."""
    _, old, _, mask = _fixed_tensors()
    engine = old.clone()
    engine[0, :6] -= 0.0005  # mean d = 0.0005: exp inside [0.999, 1.001]
    engine[2, :5] -= 0.01  # outside
    engine[4, :4] += torch.tensor([0.004, -0.004, 0.001, -0.001], dtype=old.dtype)  # mean 0: inside
    weights, metrics = correction_weights(old, engine, mask != 0, RolloutCorrection("geo_mean"))
    for b in range(5):
        n = int(mask[b].sum())
        g = math.exp(float((old[b, :n] - engine[b, :n]).sum()) / n)
        keep = 0.999 <= g <= 1.001
        assert weights[b, :n].tolist() == [1.0 if keep else 0.0] * n and (weights[b, n:] == 0).all()
    assert weights[2].sum() == 0 and weights[4, :4].sum() == 4
    assert float(metrics["sampling/importance_sampling_ratio/mean"]) == pytest.approx(4 / 5)


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_ratio_inside():
    _, old, _, mask = _fixed_tensors()
    engine = old.clone()
    engine[0, 0] += 1.0  # ratio e^-1 = 0.37 < 0.5: masked
    engine[0, 1] -= 2.0  # ratio e^2 = 7.4 > 5: masked
    engine[0, 2] -= 0.5  # ratio e^0.5 = 1.65: kept, weight = ratio
    weights, _ = correction_weights(old, engine, mask != 0, RolloutCorrection("icepop"))
    assert weights[0, 0] == 0 and weights[0, 1] == 0
    assert float(weights[0, 2]) == pytest.approx(math.exp(0.5), rel=1e-12)
    assert weights[1, :3].tolist() == [1.0, 1.0, 1.0] and (weights[mask == 0] == 0).all()


def test_token_truncation_is_the_old_tis_cap():
    """``tis_cap`` (the old keyword) and ``mode: token_truncate`` give the same loss and metrics."""
    logp, old, adv, mask = _fixed_tensors()
    engine = _engine(old, mask)
    a, _, ma = ours(logp, old, adv, mask, rollout_log_probs=engine, tis_cap=1.1)
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection("token_truncate", clip_max=1.1))
    b, _, mb = ours(logp, old, adv, mask, rollout_log_probs=engine, config=cfg)
    assert float(a) == float(b) and all(float(ma[k]) == float(mb[k]) for k in ma)
    w = torch.clamp(torch.exp(old - engine), max=1.1)
    assert float(ma["tis_weight_min"]) == pytest.approx(float(w[mask != 0].min()), rel=1e-12)


def test_empty_micro_batch_has_neutral_metrics():
    z = torch.zeros(2, 3, dtype=torch.float64)
    _, met = correction_weights(z, z, torch.zeros(2, 3, dtype=torch.bool), RolloutCorrection("trl"))
    assert float(met["tis_weight_min"]) == 3.0 and float(met[TRL_METRICS[4]]) == 0.0
    assert all(math.isfinite(float(v)) for v in met.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "token"}, r"mode='token' is not known; valid: off, token_truncate"),
        ({"mode": "token_mask"}, "needs a bound"),
        ({"mode": "token_mask", "clip_max": math.nan}, "clip_max=nan is not finite"),
        (
            {"mode": "token_mask", "clip_max": 1.0, "clip_min": 2.0},
            r"clip_min \(2.0\) must be < clip_max",
        ),
        ({"stale_tis_cap": 0.0}, "stale_tis_cap must be > 0"),
        ({"stale_tis_cap": math.inf}, "stale_tis_cap=inf is not finite"),
    ],
)
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=r"^model\.loss\.rollout_correction\..*" + match):
        RolloutCorrection(**kwargs)


def test_the_loss_settings_paths_agree():
    """The errors of the loss settings name them as the module's others are named (``model.*``);
    ``rollout_correction`` writes its path out (``loss`` imports it), so it must not drift."""
    assert LOSS_PATH == f"{MODEL_PATH}.loss"
    assert ROLLOUT_CORRECTION_PATH == f"{LOSS_PATH}.rollout_correction"


def test_a_correction_without_engine_log_probs_is_an_error():
    logp, old, adv, mask = _fixed_tensors()
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection("trl"))
    with pytest.raises(
        ValueError,
        match=r"^model\.loss\.rollout_correction\.mode='trl' needs the engine's log-probs",
    ):
        compute_policy_loss(logp, old, adv, mask, config=cfg)
