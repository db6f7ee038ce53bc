"""The policy loss's shared pieces: its config, the inputs every objective sees, aggregation.

Notation (all per response token ``t`` of row ``b``; ``m_t`` is the response mask)::

    log_ratio_t = clamp(logp_t - old_logp_t, -20, 20)           (token level)
    log_ratio_b = clamp(sum_t m_t (logp_t - old_logp_t) / max(sum_t m_t, 1), -20, 20)
                                                                 (sequence level, GSPO)
    ratio       = exp(log_ratio)                                 # pi_theta / pi_old

The loss of a micro-batch is assembled by :func:`dapo_lightning.policy_loss.policy_loss`::

    pg_t = objective(inputs, config, params)_t        (a registered policy objective: dapo,
                                                       gspo, cispo, sapo; dapo_lightning.objectives)
    l_t  = w_t * pg_t - entropy_coef * H_t + kl_coef * kl_t
    loss = aggregate_loss(l, m, loss_agg_mode, ...)

with ``w_t`` the rollout-correction weight (:mod:`dapo_lightning.rollout_correction`; 1 when
off), ``H_t`` the token entropy and ``kl_t`` the k3 estimator of the KL to a reference policy
(samples from ``pi_theta``)::

    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1,   ref_t - logp_t clamped to [-20, 20]

Gradients flow through ``log_probs`` (and ``entropy``) only; ``old_log_probs``,
``advantages``, ``rollout_log_probs`` and ``ref_log_probs`` are treated as constants.

Ranks and gradient accumulation. These functions know nothing of ranks. The returned loss is
*this micro-batch's share* of the full mini-batch loss: with the global normaliser passed in
(``global_token_count`` for ``token-mean``, ``global_seq_count`` for the ``seq-*`` modes) the
shares of all micro-batches on all ranks sum to the loss of the whole mini-batch. The caller
(``DAPOModule``) all-reduces the normaliser over ranks and multiplies each share by
``world_size`` before ``backward``, because DDP *averages* gradients over ranks while the
shares must be *summed*. Without the global normaliser each call normalises by its own
micro-batch, which is exact only for a single micro-batch on a single rank.

Safety. Tokens with ``m_t == 0`` are replaced by zeros before any arithmetic
(:meth:`LossInputs.build`), so padding may hold anything (even ``inf``/``NaN``) without
reaching the loss or the gradient. The log-ratio clamp keeps ``exp`` finite for any input;
outside ``[-20, 20]`` its gradient is zero (such a token is far outside the trust region
anyway). A fully masked micro-batch gives a loss of 0 that still belongs to the autograd graph,
and finite metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from dapo_lightning.checks import check_choice, check_finite, choices_of
from dapo_lightning.rollout_correction import RolloutCorrection

#: Where :class:`PolicyLossConfig` sits in a run's YAML (``model.init_args.loss``), named as the
#: module's other settings are in errors (``update.MODEL_PATH``: ``model.*``).
LOSS_PATH = "model.loss"

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""Valid values of ``loss_agg_mode`` (see :func:`aggregate_loss`)."""

DEFAULT_LOSS_AGG_MODE = "token-mean"
"""The aggregation of an objective that declares none (DAPO's token-level loss)."""

LOG_RATIO_CLAMP: float = 20.0
"""Bound on ``|logp - old_logp|`` (and ``|ref - logp|``) before ``exp``: ``exp(20) ~ 4.9e8``."""

Count = int | float | Tensor


def check_loss_agg_mode(mode: str, name: str = "loss_agg_mode") -> None:
    """Raise a ValueError naming ``name`` unless ``mode`` is one of :data:`LOSS_AGG_MODES`."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"{name}={mode!r} is not known; valid modes: {', '.join(LOSS_AGG_MODES)}.")


def _normaliser(count: Count | None, default: Tensor, like: Tensor, name: str) -> Tensor:
    """``count`` (or ``default``) as a detached scalar of ``like``'s dtype, floored at 1."""
    if count is None:
        value = default
    else:
        if isinstance(count, Tensor):
            if count.numel() != 1:
                raise ValueError(
                    f"{name} must be a scalar, got a tensor of shape {tuple(count.shape)}."
                )
            value = count.reshape(())
        else:
            if count < 0:
                raise ValueError(f"{name} must be >= 0, got {count}.")
            value = torch.tensor(count)
    value = value.detach().to(dtype=like.dtype, device=like.device)
    # Floored at 1 so an empty (micro-)batch gives 0 instead of 0/0.
    return value.clamp(min=1.0)


def _check_per_token_shapes(values: Tensor, mask: Tensor) -> None:
    """Raise unless ``values`` and ``mask`` are both ``[B, T]`` of the same shape."""
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values and mask must both be [B, T]; got values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)}."
        )


def _dr_grpo_share(
    masked: Tensor, global_seq_count: Count | None, max_response_length: int | None
) -> Tensor:
    """Dr. GRPO's ``seq-mean-token-sum-norm``: ``sum_bt(v * m) / (S' * L)`` with the masked
    values ``masked [B, T]``, ``S' = global_seq_count`` or ``B`` (floored at 1) and
    ``L = max_response_length`` (required, > 0)."""
    if max_response_length is None or max_response_length <= 0:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' (Dr. GRPO) needs max_response_length, the "
            f"constant response length it divides by (got {max_response_length!r}); pass the "
            "sampling max_tokens."
        )
    rows = torch.tensor(float(masked.shape[0]))
    seqs = _normaliser(global_seq_count, rows, masked, "global_seq_count")
    return masked.sum() / (seqs * max_response_length)


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Reduce per-token values ``v [B, T]`` under ``mask m [B, T]`` to this batch's share of the loss.

    With ``n_b = sum_t m_bt`` (tokens of row ``b``)::

        token-mean:               sum_bt(v * m) / N             N = global_token_count or sum(m)
        seq-mean-token-mean:      sum_b [sum_t(v * m) / max(n_b, 1)] / S
        seq-mean-token-sum:       sum_b  sum_t(v * m) / S
        seq-mean-token-sum-norm:  sum_bt(v * m) / (S' * max_response_length)    (Dr. GRPO)

    ``S = global_seq_count`` or, if None, the number of rows with ``n_b > 0``: a fully masked
    row (e.g. an overlong-filtered response) contributes 0 and is not counted. For Dr. GRPO
    the normaliser is a constant by design, so ``S' = global_seq_count`` or, if None, ``B``
    (every row counts, masked or not). ``token-mean`` is DAPO's token-level loss: every token
    of the mini-batch weighs the same, so long responses are not diluted as in
    ``seq-mean-token-mean`` (GRPO's sample-level loss).

    Every normaliser is floored at 1, so an empty batch gives 0 (with its autograd graph
    intact), never NaN. Pass the global normaliser (summed over all micro-batches and ranks)
    to make shares add up: ``sum_k aggregate_loss(v_k, m_k, ..., global_*=total)`` equals
    ``aggregate_loss(v, m, ...)`` over the concatenated batch.

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` bool or float, 1 where the token counts.
        mode: One of :data:`LOSS_AGG_MODES`.
        global_token_count: ``token-mean`` normaliser ``N`` (ignored by the other modes).
        global_seq_count: ``seq-*`` normaliser ``S`` (ignored by ``token-mean``).
        max_response_length: Dr. GRPO's constant length ``L`` (required by
            ``seq-mean-token-sum-norm``; usually the sampling ``max_tokens``).
    """
    check_loss_agg_mode(mode)
    _check_per_token_shapes(values, mask)
    m = mask.to(values.dtype)
    masked = torch.where(m != 0, values * m, torch.zeros_like(values))
    if mode == "token-mean":
        return masked.sum() / _normaliser(global_token_count, m.sum(), values, "global_token_count")
    if mode == "seq-mean-token-sum-norm":
        return _dr_grpo_share(masked, global_seq_count, max_response_length)
    row_tokens = m.sum(-1)
    seqs = _normaliser(global_seq_count, (row_tokens > 0).sum(), values, "global_seq_count")
    row_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / row_tokens.clamp(min=1.0)
    return row_sums.sum() / seqs


ImportanceSamplingLevel = Literal["token", "sequence"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


def _finite(name: str, value: float | None) -> None:
    check_finite(f"{LOSS_PATH}.{name}", value, none_ok=True)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss: which objective, its clipping, aggregation, corrections and extra terms.

    Declared and validated here once; passed whole (``DAPOModule(loss=PolicyLossConfig(...))``,
    YAML ``model.init_args.loss.*``). Every float must be finite.

    Args:
        objective: A registered policy objective (:mod:`dapo_lightning.objectives`: ``dapo``,
            the clipped surrogate of the paper; ``gspo``, the same at sequence level; ``cispo``;
            ``sapo``), or the dotted import path ``pkg.module.function`` of a user's function
            decorated with ``@register_policy_objective``.
        objective_kwargs: The objective's own parameters (``cispo``: ``cap``, default 5.0;
            ``sapo``: ``temperature_pos`` 1.0, ``temperature_neg`` 1.05); a key the objective
            does not declare is rejected when the module is built.
        advantage_estimator: A registered estimator (:mod:`dapo_lightning.advantages`:
            ``grpo``, ``reinforce_baseline``, ``rloo``, ``dr_grpo``) or a dotted import path. It
            is chosen here because it belongs to the algorithm as much as the objective does
            (Dr. GRPO changes both the estimator and ``loss_agg_mode``).
        clip_ratio_low: ``eps_low``, lower clip ``1 - eps_low`` of the ratio; in ``[0, 1)``
            (paper 0.2).
        clip_ratio_high: ``eps_high``, upper clip ``1 + eps_high``; ``>= eps_low``. DAPO's
            clip-higher uses 0.28 against entropy collapse (0.2: symmetric PPO/GRPO).
        clip_ratio_c: Dual-clip constant ``c > 1`` bounding the loss of negative-advantage
            tokens at ``c * |A|``; None disables it (the paper does not use it; verl: 3.0).
        loss_agg_mode: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO),
            ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (Dr. GRPO); see
            :func:`aggregate_loss`. None (the default): the objective's own, declared when it
            is registered (``sapo``: ``seq-mean-token-mean``, as TRL averages it), else
            :data:`DEFAULT_LOSS_AGG_MODE` (``dapo``, ``gspo``, ``cispo``: ``token-mean``).
        importance_sampling_level: ``token`` (one ratio per token) or ``sequence`` (one per
            response, the exp of its mean log-ratio: TRL's ``importance_sampling_level``), for
            the objectives that take a ratio (``gspo`` is always ``sequence``).
        rollout_correction: The engine/trainer mismatch correction
            (:class:`~dapo_lightning.rollout_correction.RolloutCorrection`; its ``stale_tis_cap``
            corrects stale responses).
        entropy_coef: Weight of the entropy bonus ``- entropy_coef * H_t`` at the start
            (``EntropyScheduler`` changes it during training); 0 in the paper.
        kl_coef: Weight ``>= 0`` of the k3 KL penalty to the initial policy; 0 (paper) loads no
            reference model.
    """

    objective: str = "dapo"
    objective_kwargs: dict[str, float] = field(default_factory=dict)
    advantage_estimator: str = "grpo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = None
    loss_agg_mode: LossAggMode | None = None
    importance_sampling_level: ImportanceSamplingLevel = "token"
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    entropy_coef: float = 0.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rollout_correction, dict):  # a plain mapping (e.g. saved hparams)
            object.__setattr__(
                self, "rollout_correction", RolloutCorrection(**self.rollout_correction)
            )
        for name in (
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "entropy_coef",
            "kl_coef",
        ):
            _finite(name, getattr(self, name))
        for key, value in self.objective_kwargs.items():
            _finite(f"objective_kwargs.{key}", value)
        for name in ("objective", "advantage_estimator"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(
                    f"{LOSS_PATH}.{name} must be a non-empty name, got {getattr(self, name)!r}."
                )
        check_loss_settings(
            self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.loss_agg_mode
        )
        if self.clip_ratio_high < self.clip_ratio_low:
            raise ValueError(
                f"{LOSS_PATH}.clip_ratio_high ({self.clip_ratio_high}) < {LOSS_PATH}.clip_ratio_low "
                f"({self.clip_ratio_low}): clip-higher needs eps_high >= eps_low (paper: 0.28 and 0.2)."
            )
        check_choice(
            f"{LOSS_PATH}.importance_sampling_level",
            self.importance_sampling_level,
            choices_of(ImportanceSamplingLevel),
        )
        if self.kl_coef < 0:
            raise ValueError(
                f"{LOSS_PATH}.kl_coef must be >= 0 (0: no KL penalty, no reference model), got {self.kl_coef}."
            )


def check_loss_settings(
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    loss_agg_mode: str | None,
) -> None:
    """Raise a ValueError naming the setting when a clip ratio or the aggregation mode is invalid
    (a None mode is valid: the objective's own)."""
    if loss_agg_mode is not None:
        check_loss_agg_mode(loss_agg_mode, f"{LOSS_PATH}.loss_agg_mode")
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(
            f"{LOSS_PATH}.clip_ratio_low (eps_low) must be in [0, 1) so that 1 - eps_low > 0; got {clip_ratio_low}."
        )
    if clip_ratio_high < 0.0:
        raise ValueError(
            f"{LOSS_PATH}.clip_ratio_high (eps_high) must be >= 0; got {clip_ratio_high}."
        )
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"{LOSS_PATH}.clip_ratio_c (dual clip) must be > 1, or None to disable it; got {clip_ratio_c}."
        )


def _check_same_shape(name: str, tensor: Tensor | None, shape: torch.Size) -> None:
    if tensor is not None and tensor.shape != shape:
        raise ValueError(
            f"{name} must have the shape of log_probs {tuple(shape)} ([B, T]); got {tuple(tensor.shape)}."
        )


@dataclass
class LossInputs:
    """One micro-batch as every policy objective sees it: ``[B, T]`` tensors, zeros wherever
    ``valid`` is False (build it with :meth:`build`).

    Args:
        log_probs: Current policy's log-probs of the response tokens (carries the gradient).
        old_log_probs: The policy's before the step's updates (``pi_old``), detached.
        advantages: Detached, broadcast over each row's tokens.
        mask: Response mask as floats (1 where the token enters the loss).
        valid: ``mask != 0``.
        rollout_log_probs: The engine's log-probs of the sampled tokens (rollout correction).
        entropy: Token entropies of the current policy (bonus and metric).
        ref_log_probs: A frozen reference policy's log-probs (KL penalty).
        global_token_count / global_seq_count / max_response_length: The normalisers of
            :func:`aggregate_loss`.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Tensor
    valid: Tensor
    rollout_log_probs: Tensor | None = None
    entropy: Tensor | None = None
    ref_log_probs: Tensor | None = None
    global_token_count: Count | None = None
    global_seq_count: Count | None = None
    max_response_length: int | None = None

    @classmethod
    def build(
        cls,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        **optional: Tensor | Count | int | None,
    ) -> LossInputs:
        """Validate the shapes (errors name the argument) and zero everything off the mask.

        ``advantages`` may be ``[B]`` (one per response) or ``[B, T]``; ``optional`` takes the
        other fields by name.
        """
        if log_probs.dim() != 2:
            raise ValueError(f"log_probs must be [B, T]; got shape {tuple(log_probs.shape)}.")
        if not log_probs.is_floating_point():
            raise TypeError(f"log_probs must be a floating-point tensor; got {log_probs.dtype}.")
        shape = log_probs.shape
        for name in ("rollout_log_probs", "entropy", "ref_log_probs"):
            _check_same_shape(name, optional.get(name), shape)
        _check_same_shape("old_log_probs", old_log_probs, shape)
        _check_same_shape("response_mask", response_mask, shape)
        if advantages.shape not in (shape, shape[:1]):
            raise ValueError(
                f"advantages must be [B] = {tuple(shape[:1])} or [B, T] = {tuple(shape)}; "
                f"got {tuple(advantages.shape)}."
            )
        mask = response_mask.to(log_probs.dtype)
        valid = mask != 0
        zeros = torch.zeros_like(log_probs)

        def clean(x: Tensor | None, detach: bool = True) -> Tensor | None:
            if x is None:
                return None
            x = x.detach() if detach else x
            return torch.where(valid, x.to(log_probs.dtype), zeros)

        adv = advantages.detach().to(log_probs.dtype)
        adv = adv.unsqueeze(-1).expand(shape) if adv.dim() == 1 else adv
        tensors = {k: clean(optional.pop(k, None)) for k in ("rollout_log_probs", "ref_log_probs")}
        entropy = optional.pop("entropy", None)
        return cls(
            clean(log_probs, detach=False),
            clean(old_log_probs),
            clean(adv),
            mask,
            valid,
            entropy=clean(entropy, detach=False),
            **tensors,
            **optional,
        )

    def mean(self, x: Tensor) -> Tensor:
        """Masked mean over the valid tokens (``x`` broadcast to ``[B, T]``); 0 when none."""
        x = x.expand_as(self.mask)
        total = torch.where(self.valid, x * self.mask, torch.zeros_like(self.mask)).sum()
        return total / self.mask.sum().clamp(min=1.0)

    def frac(self, cond: Tensor) -> Tensor:
        """Fraction of the valid tokens where ``cond`` (broadcast to ``[B, T]``) holds."""
        return self.mean((cond.expand_as(self.valid) & self.valid).to(self.mask.dtype))


def importance_log_ratio(inputs: LossInputs, level: str) -> Tensor:
    """``log(pi_theta / pi_old)``: ``[B, T]`` at the ``token`` level, ``[B, 1]`` (the masked mean
    of the row's token log-ratios, GSPO) at the ``sequence`` level; clamped to ``[-20, 20]``."""
    diff = inputs.log_probs - inputs.old_log_probs
    if level == "sequence":
        diff = (diff * inputs.mask).sum(-1, keepdim=True) / inputs.mask.sum(-1, keepdim=True).clamp(
            min=1.0
        )
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k3_kl(ref_log_probs: Tensor, log_probs: Tensor) -> Tensor:
    """``exp(ref - logp) - (ref - logp) - 1`` with ``ref - logp`` clamped to ``[-20, 20]``."""
    diff = (ref_log_probs - log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(diff) - diff - 1.0
