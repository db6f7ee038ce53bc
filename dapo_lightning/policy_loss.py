"""The policy loss of one micro-batch: the one call of the module's update loop.

:func:`policy_loss` assembles (formulas: :mod:`dapo_lightning.loss`)::

    pg_t = objective(inputs, config, params)_t                  (the registered objective)
    l_t  = w_t * pg_t - entropy_coef * H_t + kl_coef * kl_t     (w_t: rollout correction)
    loss = aggregate_loss(l, m, mode, global normalisers)
           mode: config.loss_agg_mode, or the objective's own when that is None

:func:`compute_policy_loss` is the same with the settings as keyword arguments (the API of
earlier versions: ``tis_cap`` is token truncation against ``rollout_log_probs``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from dapo_lightning.loss import (
    LOSS_PATH,
    Count,
    LossInputs,
    PolicyLossConfig,
    aggregate_loss,
    importance_log_ratio,
    k3_kl,
)
from dapo_lightning.objectives import objective_loss_agg_mode, objective_params, policy_objective
from dapo_lightning.rollout_correction import (
    ROLLOUT_CORRECTION_PATH,
    RolloutCorrection,
    correction_weights,
)


def _check_inputs(inputs: LossInputs, config: PolicyLossConfig) -> None:
    mode = config.rollout_correction.mode
    if config.rollout_correction.enabled and inputs.rollout_log_probs is None:
        raise ValueError(
            f"{ROLLOUT_CORRECTION_PATH}.mode={mode!r} needs the engine's log-probs: pass "
            "rollout_log_probs=[B, T], or set the mode to 'off'."
        )
    if config.entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError(
            f"{LOSS_PATH}.entropy_coef={config.entropy_coef} needs the token entropies: pass entropy=[B, T] "
            "(response_log_probs(..., with_entropy=True)) or set entropy_coef=0."
        )
    if config.kl_coef != 0.0 and inputs.ref_log_probs is None:
        raise ValueError(
            f"{LOSS_PATH}.kl_coef={config.kl_coef} needs the reference policy: pass ref_log_probs=[B, T] or "
            "set kl_coef=0."
        )


def policy_loss(inputs: LossInputs, config: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the loss, and its detached scalar metrics.

    Metrics (masked means over the valid tokens unless said; weight them by ``token_count`` to
    reduce over micro-batches): ``token_count``; ``pg_loss`` (mean of ``w_t * pg_t``);
    ``approx_kl_k1`` (mean of ``old - logp``), ``approx_kl_k3`` (mean of ``r - 1 - log r``,
    KL(old || new)), ``ratio_mean``, ``ratio_max`` (token ratios ``r``; 0 when empty); the
    objective's (``dapo``/``gspo``: ``clipfrac_high``, ``clipfrac_low``, ``dual_clipfrac``);
    ``entropy`` when entropies are given; ``kl_ref`` (mean of ``kl_t``) with a reference; with a
    rollout correction those of :func:`~dapo_lightning.rollout_correction.correction_weights`.
    """
    _check_inputs(inputs, config)
    entry = policy_objective(config.objective)
    pg, metrics = entry.fn(inputs, config, objective_params(entry, config.objective_kwargs))
    pg = pg.expand_as(inputs.log_probs)
    if config.rollout_correction.enabled:
        weights, correction_metrics = correction_weights(
            inputs.old_log_probs, inputs.rollout_log_probs, inputs.valid, config.rollout_correction
        )
        pg = pg * weights
        metrics.update(correction_metrics)
    token_loss = pg
    if inputs.entropy is not None and config.entropy_coef != 0.0:
        token_loss = token_loss - config.entropy_coef * inputs.entropy
    kl_ref = None
    if inputs.ref_log_probs is not None:
        kl_ref = k3_kl(inputs.ref_log_probs, inputs.log_probs)
        if config.kl_coef != 0.0:
            token_loss = token_loss + config.kl_coef * kl_ref
    loss = aggregate_loss(
        token_loss,
        inputs.mask,
        objective_loss_agg_mode(entry, config),
        global_token_count=inputs.global_token_count,
        global_seq_count=inputs.global_seq_count,
        max_response_length=inputs.max_response_length,
    )
    with torch.no_grad():
        shared = _shared_metrics(inputs, pg.detach(), kl_ref)
    return loss, {**shared, **{k: v.detach() for k, v in metrics.items()}}


def _shared_metrics(inputs: LossInputs, pg: Tensor, kl_ref: Tensor | None) -> dict[str, Tensor]:
    """The metrics every objective reports (:func:`policy_loss`)."""
    log_ratio = importance_log_ratio(inputs, "token").detach()
    ratio = torch.exp(log_ratio)
    zeros = torch.zeros_like(ratio)
    out = {
        "token_count": inputs.mask.sum().detach(),
        "pg_loss": inputs.mean(pg),
        "approx_kl_k1": inputs.mean(-log_ratio),
        "approx_kl_k3": inputs.mean(ratio - 1.0 - log_ratio),
        "ratio_mean": inputs.mean(ratio),
        "ratio_max": torch.where(inputs.valid, ratio, zeros).amax()
        if ratio.numel()
        else zeros.sum(),
    }
    if inputs.entropy is not None:
        out["entropy"] = inputs.mean(inputs.entropy.detach())
    if kl_ref is not None:
        out["kl_ref"] = inputs.mean(kl_ref.detach())
    return out


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    rollout_log_probs: Tensor | None = None,
    tis_cap: float | None = None,
    entropy: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    max_response_length: int | None = None,
    config: PolicyLossConfig | None = None,
    **settings: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss` with keyword arguments.

    ``settings`` are fields of :class:`~dapo_lightning.loss.PolicyLossConfig` (``clip_ratio_low``,
    ``clip_ratio_high``, ``clip_ratio_c``, ``loss_agg_mode``, ``entropy_coef``, ``kl_coef``,
    ``objective``, ...) applied over ``config`` (default: the paper's). ``tis_cap`` sets token
    truncation ``w_t = min(exp(old_t - rollout_t), tis_cap)`` (needs ``rollout_log_probs``;
    without it ``rollout_log_probs`` changes nothing unless ``config`` sets a correction).
    ``advantages`` is ``[B]`` or ``[B, T]``; ``log_probs`` is the only input that carries
    gradients. Returns ``(loss share, metrics)`` as :func:`policy_loss` does.
    """
    config = replace(config or PolicyLossConfig(), **settings)
    if tis_cap is not None:
        if not tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0, or None to disable TIS; got {tis_cap}.")
        if rollout_log_probs is None:
            raise ValueError(
                "tis_cap is set but rollout_log_probs is None: pass the engine's sampling "
                "log-probabilities, or set tis_cap=None to disable the rollout correction."
            )
        config = replace(config, rollout_correction=RolloutCorrection("token_truncate", tis_cap))
    inputs = LossInputs.build(
        log_probs,
        old_log_probs,
        advantages,
        response_mask,
        rollout_log_probs=rollout_log_probs,
        entropy=entropy,
        ref_log_probs=ref_log_probs,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        max_response_length=max_response_length,
    )
    return policy_loss(inputs, config)


__all__ = ["compute_policy_loss", "policy_loss"]
