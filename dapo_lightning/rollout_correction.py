"""Rollout correction: weights for the mismatch between the engine that sampled a response
(``pi_rollout``, e.g. vLLM in bf16) and the trainer's policy before the update (``pi_old``).

With ``d_t = old_logp_t - rollout_logp_t`` on the response tokens of a row (``n`` of them)::

    token level:      log rho_t = d_t                          (one weight per token)
    sequence level:   log rho   = sum_t d_t                    (one per row: the product of ratios)
    geometric level:  log rho   = (1/n) sum_t d_t              (one per row: their geometric mean)

each clamped to ``[-20, 20]`` before ``exp``. Then, with bounds ``C_min`` / ``C_max`` (None:
unbounded on that side)::

    *_truncate:       w = clamp(rho, C_min, C_max)             (TIS: truncated importance sampling)
    token/sequence_mask:  w = rho if C_min <= rho <= C_max else 0    (MIS: masked, TRL's *_mask)
    geometric_mask:   w = 1   if C_min <= rho <= C_max else 0  (pure rejection, verl's geometric RS)

``w`` (detached) multiplies the policy term of every token of the row: ``pg_t <- w_t * pg_t``.
Presets (``mode``) fill in the bounds that are not given:

=============  ===================  ======  ======  ==========================================
preset         mode                 C_max   C_min   from
=============  ===================  ======  ======  ==========================================
``trl``        sequence_mask        3.0     --      TRL 1.16's default vLLM IS correction
``token_tis``  token_truncate       2.0     --      verl token-TIS
``seq_tis``    sequence_truncate    2.0     --      verl seq-TIS
``seq_mis``    sequence_mask        2.0     0.5     verl seq-MIS (band [1/C, C])
``geo_mean``   geometric_mask       1.001   0.999   verl geometric-mean rejection
``icepop``     token_mask           5.0     0.5     IcePop's token band [alpha, beta]
=============  ===================  ======  ======  ==========================================

Stale rows. A response sampled by an older policy version (carried over from an earlier step)
is corrected with ``stale_tis_cap`` even when ``mode`` is ``off``: token TIS against the engine's
log-probs stored with the sample, rows sampled by the current version getting weight 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dapo_lightning.checks import check_choice, check_finite, choices_of

#: Where :class:`RolloutCorrection` sits in a run's YAML (``model.init_args.loss.rollout_correction``),
#: named as its errors name it: ``loss.LOSS_PATH`` + ``.rollout_correction`` (written out:
#: ``loss`` imports this module).
ROLLOUT_CORRECTION_PATH = "model.loss.rollout_correction"

#: Which old log-probs stale rows take in the ratio (RolloutCorrection.stale_old).
StaleOld = Literal["trainer", "engine"]
CorrectionMode = Literal[
    "off",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_mask",
    "trl",
    "token_tis",
    "seq_tis",
    "seq_mis",
    "geo_mean",
    "icepop",
]

#: ``preset: (mode, C_max, C_min)`` (see the module docstring's table).
PRESETS: dict[str, tuple[str, float | None, float | None]] = {
    "trl": ("sequence_mask", 3.0, None),
    "token_tis": ("token_truncate", 2.0, None),
    "seq_tis": ("sequence_truncate", 2.0, None),
    "seq_mis": ("sequence_mask", 2.0, 0.5),
    "geo_mean": ("geometric_mask", 1.001, 0.999),
    "icepop": ("token_mask", 5.0, 0.5),
}

MODES: tuple[str, ...] = (
    "off",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_mask",
)
"""The correction modes (the presets of :data:`PRESETS` resolve to one of them)."""

MAX_LOG_WEIGHT: float = 20.0
"""Bound on ``|log rho|`` before ``exp`` (``exp(20) ~ 4.9e8``)."""

#: TRL's metric names (``GRPOTrainer._generate_and_score_completions``), logged beside ours.
TRL_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


@dataclass(frozen=True)
class RolloutCorrection:
    """How the engine/trainer mismatch is corrected (formulas: module docstring).

    Args:
        mode: ``off``, one of :data:`MODES`, or a preset of :data:`PRESETS` (``trl`` selects
            TRL 1.16's default: sequence-level masking at 3.0).
        clip_max: Upper bound ``C_max`` (> 0); None takes the preset's, or no upper bound.
        clip_min: Lower bound ``C_min`` (>= 0, < ``C_max``); None takes the preset's, or none.
        stale_tis_cap: Token-TIS cap of stale responses (sampled by an older policy version)
            when ``mode`` is ``off``; None leaves them uncorrected.
        stale_old: The old policy of the PPO ratio on stale responses: ``"trainer"``
            (default: the trainer's before the step, the stale tokens weighed by the
            correction, AReaL's decoupled objective) or ``"engine"`` (the engine's log-probs
            that sampled them: plain PPO on stale samples, the clip bounding the move from the
            policy that sampled them, verl's bypass mode; their correction weight is then 1).
    """

    mode: CorrectionMode = "off"
    clip_max: float | None = None
    clip_min: float | None = None
    stale_tis_cap: float | None = 2.0
    stale_old: StaleOld = "trainer"

    def __post_init__(self) -> None:
        prefix = ROLLOUT_CORRECTION_PATH
        if self.mode not in MODES and self.mode not in PRESETS:
            raise ValueError(
                f"{prefix}.mode={self.mode!r} is not known; valid: "
                f"{', '.join(MODES + tuple(PRESETS))}."
            )
        check_choice(f"{prefix}.stale_old", self.stale_old, choices_of(StaleOld))
        for name in ("clip_max", "clip_min", "stale_tis_cap"):
            check_finite(f"{prefix}.{name}", getattr(self, name), none_ok=True)
        if self.stale_tis_cap is not None and not self.stale_tis_cap > 0:
            raise ValueError(
                f"{prefix}.stale_tis_cap must be > 0 (or null), got {self.stale_tis_cap}."
            )
        mode, high, low = self.resolved()
        if high is not None and not high > 0:
            raise ValueError(f"{prefix}.clip_max must be > 0 (or null), got {high}.")
        if low is not None and not low >= 0:
            raise ValueError(f"{prefix}.clip_min must be >= 0 (or null), got {low}.")
        if high is not None and low is not None and not low < high:
            raise ValueError(f"{prefix}.clip_min ({low}) must be < clip_max ({high}).")
        if mode != "off" and high is None and low is None:
            raise ValueError(
                f"{prefix}.mode={mode!r} needs a bound: set clip_max (e.g. 2.0) and/or clip_min."
            )

    def resolved(self) -> tuple[str, float | None, float | None]:
        """``(mode, C_max, C_min)`` with a preset's values filled in where not given."""
        if self.mode in PRESETS:
            mode, high, low = PRESETS[self.mode]
            return (
                mode,
                self.clip_max if self.clip_max is not None else high,
                self.clip_min if self.clip_min is not None else low,
            )
        return self.mode, self.clip_max, self.clip_min

    @property
    def enabled(self) -> bool:
        """True when every row is corrected against the engine's log-probs."""
        return self.mode != "off"


def token_truncation(cap: float) -> RolloutCorrection:
    """Token TIS ``w_t = min(exp(old_t - rollout_t), cap)`` (the stale-row correction)."""
    return RolloutCorrection("token_truncate", clip_max=cap)


def log_rollout_ratio(diff: Tensor, valid: Tensor, level: str) -> Tensor:
    """``log rho``: ``[B, T]`` (token), or ``[B, 1]`` (``sequence``: ``sum_t d_t``; ``geometric``:
    ``sum_t d_t / max(n, 1)``), clamped to ``[-20, 20]``; ``diff`` is zero off ``valid``."""
    if level == "token":
        out = diff
    elif level == "sequence":
        out = diff.sum(-1, keepdim=True)
    else:
        out = diff.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    return out.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)


def bounded_weights(
    ratio: Tensor, kind: str, high: float | None, low: float | None, *, unit: bool = False
) -> Tensor:
    """``truncate``: ``clamp(rho, C_min, C_max)``; ``mask``: ``rho`` (``1`` if ``unit``) inside
    ``[C_min, C_max]``, 0 outside."""
    if kind == "truncate":
        return ratio.clamp(min=low, max=high)
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if high is not None:
        keep = keep & (ratio <= high)
    if low is not None:
        keep = keep & (ratio >= low)
    inside = torch.ones_like(ratio) if unit else ratio
    return torch.where(keep, inside, torch.zeros_like(ratio))


def correction_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, correction: RolloutCorrection
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached ``[B, T]`` weights ``w`` (0 off ``valid``) and their metrics.

    Metrics: ours, over the valid tokens: ``tis_weight_mean``, ``tis_weight_min``,
    ``tis_masked_frac`` (tokens with ``w = 0``); TRL's (:data:`TRL_METRICS`):
    ``sampling/sampling_logp_difference/mean|max`` of ``|d_t|`` over the valid tokens, and
    ``sampling/importance_sampling_ratio/min|mean|max`` of ``w`` over the valid tokens (token
    level) or over the rows with a valid token (sequence / geometric level). Empty: means 0,
    maxima 0, minima ``C_max`` (or inf).
    """
    mode, high, low = correction.resolved()
    if mode == "off":
        raise ValueError("correction_weights needs a correction mode other than 'off'.")
    level, kind = mode.split("_")
    with torch.no_grad():
        zeros = torch.zeros_like(old_log_probs)
        diff = torch.where(valid, old_log_probs - rollout_log_probs, zeros)
        ratio = torch.exp(log_rollout_ratio(diff, valid, level))
        per_unit = bounded_weights(ratio, kind, high, low, unit=level == "geometric")
        weights = torch.where(valid, per_unit.expand_as(diff), zeros)
        units = valid if level == "token" else valid.any(-1, keepdim=True)
        metrics = _correction_metrics(weights, per_unit.expand_as(units), diff, valid, units, high)
    return weights, metrics


def _correction_metrics(
    weights: Tensor,
    per_unit: Tensor,
    diff: Tensor,
    valid: Tensor,
    units: Tensor,
    high: float | None,
) -> dict[str, Tensor]:
    """The metrics of :func:`correction_weights` (``units``: where the ratios live)."""
    neutral_min = high if high is not None else math.inf
    count = valid.sum().clamp(min=1)

    def stats(x: Tensor, where: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not bool(where.any()):
            zero = x.new_zeros(())
            return x.new_tensor(neutral_min), zero, zero
        picked = x[where]
        return picked.min(), picked.mean(), picked.max()

    w_min, _, _ = stats(weights, valid)
    _, d_mean, d_max = stats(diff.abs(), valid)
    r_min, r_mean, r_max = stats(per_unit, units)
    return {
        "tis_weight_mean": weights.sum() / count,
        "tis_weight_min": w_min,
        "tis_masked_frac": ((weights == 0) & valid).sum() / count,
        TRL_METRICS[0]: d_mean,
        TRL_METRICS[1]: d_max,
        TRL_METRICS[2]: r_min,
        TRL_METRICS[3]: r_mean,
        TRL_METRICS[4]: r_max,
    }


__all__ = [
    "MODES",
    "PRESETS",
    "ROLLOUT_CORRECTION_PATH",
    "TRL_METRICS",
    "RolloutCorrection",
    "bounded_weights",
    "correction_weights",
    "log_rollout_ratio",
    "token_truncation",
]
