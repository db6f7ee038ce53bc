"""Policy objectives: the per-token policy term ``pg_t`` of the loss, registered by name.

Every objective has one fixed signature::

    objective(inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float])
        -> (pg [B, T] or [B, 1], metrics: dict[str, Tensor])

``inputs`` holds the micro-batch (zeros off the mask: :class:`~dapo_lightning.loss.LossInputs`),
``config`` the loss settings, ``params`` the objective's own parameters (its registered
defaults updated with ``config.objective_kwargs``). ``pg`` is a loss (lower is better) per token,
or per row at the sequence level (broadcast over the row's tokens); rollout correction, the
entropy and KL terms and the aggregation are applied around it by
:func:`dapo_lightning.policy_loss.policy_loss`. Metrics are masked means over the valid tokens
(``inputs.mean`` / ``inputs.frac``).

An objective may declare its own aggregation (``loss_agg_mode`` at registration): it is used
when ``config.loss_agg_mode`` is None (the default), so an objective runs as its source
computes it unless the user chooses another (:func:`objective_loss_agg_mode`).

Built-ins, with ``r`` the importance ratio (token or sequence level, see
:func:`~dapo_lightning.loss.importance_log_ratio`) and ``A`` the advantage:

* ``dapo``: DAPO's clipped surrogate (Yu et al. 2025, Eq. 8/10), decoupled ``eps_low`` /
  ``eps_high``, with optional dual clip (:func:`clipped_surrogate`).
* ``gspo``: the same at the sequence level (Zheng et al. 2025; TRL's
  ``importance_sampling_level="sequence"``): ``r_b = exp(mean_t log r_bt)``.
* ``cispo``: ``pg_t = -sg(min(r_t, cap)) * A_t * logp_t`` (MiniMax-M1; TRL ``loss_type="cispo"``
  with ``epsilon_high = cap``, ScaleRL's recommended 5.0).
* ``sapo``: ``pg_t = -sigmoid(tau (r_t - 1)) * 4 / tau * A_t`` with ``tau = temperature_pos`` for
  ``A > 0`` else ``temperature_neg`` (Gao et al. 2025; TRL ``loss_type="sapo"``, 1.0 / 1.05),
  averaged per sequence by default (``seq-mean-token-mean``, as TRL's ``GRPOTrainer`` does).

A user's objective is one decorated function in their own module, selected from YAML by name
or dotted path (README, "Your own objective").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from dapo_lightning.loss import (
    DEFAULT_LOSS_AGG_MODE,
    LOSS_PATH,
    LossInputs,
    PolicyLossConfig,
    check_loss_agg_mode,
    importance_log_ratio,
)
from dapo_lightning.registry import Entry, Registry

PolicyObjective = Callable[
    [LossInputs, PolicyLossConfig, Mapping[str, float]], tuple[Tensor, dict[str, Tensor]]
]

POLICY_OBJECTIVES: Registry[PolicyObjective] = Registry(
    "policy objective", f"{LOSS_PATH}.objective", "register_policy_objective"
)
"""The registered policy objectives."""


def register_policy_objective(
    name: str,
    params: dict[str, float] | None = None,
    positive: tuple[str, ...] = (),
    loss_agg_mode: str | None = None,
) -> Callable[[PolicyObjective], PolicyObjective]:
    """Decorator registering a policy objective under ``name`` (signature: module docstring);
    ``params`` declares its own parameters and their defaults (``loss.objective_kwargs``),
    ``positive`` those of them that must be > 0, ``loss_agg_mode`` its own aggregation (one of
    :data:`~dapo_lightning.loss.LOSS_AGG_MODES`; None: ``token-mean``), used where the loss
    config leaves ``loss_agg_mode`` unset."""
    if loss_agg_mode is not None:
        check_loss_agg_mode(loss_agg_mode, f"register_policy_objective({name!r}).loss_agg_mode")
    return POLICY_OBJECTIVES.register(
        name, params, positive=tuple(positive), loss_agg_mode=loss_agg_mode
    )


def policy_objective(name: str) -> Entry[PolicyObjective]:
    """The objective registered as ``name`` (or at a dotted import path); a ValueError listing
    the valid names otherwise."""
    return POLICY_OBJECTIVES.get(name)


def objective_params(
    entry: Entry[PolicyObjective], kwargs: Mapping[str, float]
) -> dict[str, float]:
    """The objective's defaults updated with ``kwargs``; an undeclared key is a ValueError."""
    unknown = sorted(set(kwargs) - set(entry.params))
    if unknown:
        known = ", ".join(entry.params) or "none"
        raise ValueError(
            f"{LOSS_PATH}.objective_kwargs has {', '.join(unknown)}, which objective {entry.name!r} does "
            f"not take; its parameters: {known}."
        )
    params = {**entry.params, **{k: float(v) for k, v in kwargs.items()}}
    for key in entry.traits.get("positive", ()):
        if not params[key] > 0:
            raise ValueError(
                f"{LOSS_PATH}.objective_kwargs.{key} of objective {entry.name!r} must be > 0, got {params[key]}."
            )
    return params


def objective_loss_agg_mode(entry: Entry[PolicyObjective], config: PolicyLossConfig) -> str:
    """The aggregation the loss uses: ``config.loss_agg_mode`` when set, else the objective's
    declared one, else :data:`~dapo_lightning.loss.DEFAULT_LOSS_AGG_MODE`."""
    if config.loss_agg_mode is not None:
        return config.loss_agg_mode
    return entry.traits.get("loss_agg_mode") or DEFAULT_LOSS_AGG_MODE


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, low: float, high: float, dual_clip: float | None
) -> Tensor:
    """``pg = max(-A r, -A clip(r, 1 - low, 1 + high))``; with dual clip ``c``, for ``A < 0``
    ``pg = min(pg, -c A)`` (the loss of a negative-advantage token capped at ``c |A|``)."""
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    return pg


def _clipped(inputs: LossInputs, config: PolicyLossConfig, level: str) -> tuple[Tensor, dict]:
    ratio = torch.exp(importance_log_ratio(inputs, level))
    adv = inputs.advantages
    pg = clipped_surrogate(
        ratio, adv, config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c
    )
    r = ratio.detach()
    c = config.clip_ratio_c
    metrics = {
        "clipfrac_high": inputs.frac((adv > 0) & (r > 1.0 + config.clip_ratio_high)),
        "clipfrac_low": inputs.frac((adv < 0) & (r < 1.0 - config.clip_ratio_low)),
        "dual_clipfrac": inputs.frac((adv < 0) & (r > c)) if c is not None else adv.new_zeros(()),
    }
    return pg, metrics


@register_policy_objective("dapo")
def dapo_objective(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's clipped surrogate at ``config.importance_sampling_level`` (:func:`clipped_surrogate`)."""
    return _clipped(inputs, config, config.importance_sampling_level)


@register_policy_objective("gspo")
def gspo_objective(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate of the sequence-level ratio ``r_b = exp(mean_t log r_bt)``
    (``[B, 1]``); the GSPO paper clips at ``eps`` 3e-4 / 4e-4 with ``seq-mean-token-mean``."""
    return _clipped(inputs, config, "sequence")


@register_policy_objective("cispo", params={"cap": 5.0}, positive=("cap",))
def cispo_objective(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: ``pg_t = -sg(min(r_t, cap)) * A_t * logp_t`` (the clipped ratio only weighs the
    REINFORCE gradient, so no token's gradient is dropped). Metric ``cispo_clipfrac``: ``A > 0``
    and ``r > cap`` (TRL's ``cispo_clip_ratio``)."""
    cap = params["cap"]
    ratio = torch.exp(importance_log_ratio(inputs, config.importance_sampling_level))
    weight = ratio.clamp(max=cap).detach()
    pg = -weight * inputs.advantages * inputs.log_probs
    clipped = (ratio.detach() > cap) & (inputs.advantages > 0)
    return pg, {"cispo_clipfrac": inputs.frac(clipped)}


@register_policy_objective(
    "sapo",
    params={"temperature_pos": 1.0, "temperature_neg": 1.05},
    positive=("temperature_pos", "temperature_neg"),
    loss_agg_mode="seq-mean-token-mean",  # TRL's GRPOTrainer averages SAPO per sequence
)
def sapo_objective(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: ``pg_t = -sigmoid(tau (r_t - 1)) * 4 / tau * A_t``, ``tau`` = ``temperature_pos``
    where ``A > 0`` else ``temperature_neg`` (a soft gate instead of a hard clip; its gradient at
    ``r = 1`` equals the plain policy gradient's). Aggregated per sequence unless the config sets
    ``loss_agg_mode``: ``loss = mean_b [sum_t m_bt pg_bt / n_b]``, TRL's ``loss_type="sapo"``."""
    ratio = torch.exp(importance_log_ratio(inputs, config.importance_sampling_level))
    adv = inputs.advantages
    tau = torch.where(
        adv > 0,
        adv.new_tensor(params["temperature_pos"]),
        adv.new_tensor(params["temperature_neg"]),
    )
    soft = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -soft * adv, {}


__all__ = [
    "POLICY_OBJECTIVES",
    "PolicyObjective",
    "clipped_surrogate",
    "objective_loss_agg_mode",
    "objective_params",
    "policy_objective",
    "register_policy_objective",
]
