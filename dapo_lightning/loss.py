"""The DAPO policy objective: clipped token-level surrogate, aggregation modes, metrics.

Notation (all per response token ``t`` of row ``b``; ``m_t`` is the response mask)::

    log_ratio_t = clamp(logp_t - old_logp_t, -20, 20)
    ratio_t     = exp(log_ratio_t)                                   # pi_theta / pi_old
    pg_t        = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
                = max(-ratio_t * A_t, -clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)

``pg_t`` is the per-token term of DAPO's clip-higher objective (Yu et al. 2025, Eq. 8/10,
negated into a loss); ``eps_low`` and ``eps_high`` are decoupled (the paper uses 0.2 / 0.28).

Optional terms, each added per token before aggregation:

* Dual clip (Ye et al. 2020), ``c = clip_ratio_c > 1``: for ``A_t < 0`` the token loss is
  ``min(pg_t, -c * A_t)``, i.e. capped at ``c * |A_t|`` (it engages when ``ratio_t > c``).
* Rollout correction, truncated importance sampling (TIS): the rollout engine samples from
  ``pi_rollout`` which may differ numerically from ``pi_old`` (other kernels, lower precision)::

      w_t = min(exp(old_logp_t - rollout_logp_t), tis_cap)        # detached

  multiplies the policy-gradient term: ``pg_t <- w_t * pg_t``.
* Entropy bonus: ``- entropy_coef * H_t``.
* KL penalty to a reference policy with the k3 estimator (samples from ``pi_theta``)::

      kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1,   ref_t - logp_t clamped to [-20, 20]

  added as ``+ kl_coef * kl_t``.

So the token loss is ``l_t = w_t * pg_t - entropy_coef * H_t + kl_coef * kl_t``, and the
returned loss is ``aggregate_loss(l, m, loss_agg_mode, ...)`` (see :func:`aggregate_loss` for
the four modes). Gradients flow through ``log_probs`` (and ``entropy``) only; ``old_log_probs``,
``advantages``, ``rollout_log_probs`` and ``ref_log_probs`` are treated as constants.

Ranks and gradient accumulation. These functions know nothing of ranks. The returned loss is
*this micro-batch's share* of the full mini-batch loss: with the global normaliser passed in
(``global_token_count`` for ``token-mean``, ``global_seq_count`` for the ``seq-*`` modes) the
shares of all micro-batches on all ranks sum to the loss of the whole mini-batch. The caller
(``DAPOModule``) all-reduces the normaliser over ranks and multiplies each share by
``world_size`` before ``backward``, because DDP *averages* gradients over ranks while the
shares must be *summed*. Without the global normaliser each call normalises by its own
micro-batch, which is exact only for a single micro-batch on a single rank.

Safety. Tokens with ``m_t == 0`` are replaced by zeros before any arithmetic, so padding may
hold anything (even ``inf``/``NaN``) without reaching the loss or the gradient. The log-ratio
clamp keeps ``exp`` finite for any input; outside ``[-20, 20]`` its gradient is zero (such a
token is far outside the trust region anyway). A fully masked micro-batch gives a loss of 0
that still belongs to the autograd graph, and finite metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""Valid values of ``loss_agg_mode`` (see :func:`aggregate_loss`)."""

LOG_RATIO_CLAMP: float = 20.0
"""Bound on ``|logp - old_logp|`` (and ``|ref - logp|``) before ``exp``: ``exp(20) ~ 4.9e8``."""

Count = int | float | Tensor


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
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={mode!r} is not known; valid modes: {', '.join(LOSS_AGG_MODES)}."
        )
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values and mask must both be [B, T]; got values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)}."
        )
    m = mask.to(values.dtype)
    masked = torch.where(m != 0, values * m, torch.zeros_like(values))
    if mode == "token-mean":
        return masked.sum() / _normaliser(global_token_count, m.sum(), values, "global_token_count")
    row_tokens = m.sum(-1)
    if mode == "seq-mean-token-sum-norm":
        if max_response_length is None or max_response_length <= 0:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' (Dr. GRPO) needs max_response_length, the "
                f"constant response length it divides by (got {max_response_length!r}); pass the "
                "sampling max_tokens."
            )
        rows = torch.tensor(float(values.shape[0]))
        seqs = _normaliser(global_seq_count, rows, values, "global_seq_count")
        return masked.sum() / (seqs * max_response_length)
    seqs = _normaliser(global_seq_count, (row_tokens > 0).sum(), values, "global_seq_count")
    row_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / row_tokens.clamp(min=1.0)
    return row_sums.sum() / seqs


def _check_same_shape(name: str, tensor: Tensor | None, shape: torch.Size) -> None:
    if tensor is not None and tensor.shape != shape:
        raise ValueError(
            f"{name} must have the shape of log_probs {tuple(shape)} ([B, T]); got {tuple(tensor.shape)}."
        )


def check_loss_settings(
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None, loss_agg_mode: str
) -> None:
    """Raise a ValueError naming the setting when a clip ratio or the aggregation mode is invalid."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r} is not known; valid modes: {', '.join(LOSS_AGG_MODES)}."
        )
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(
            f"clip_ratio_low (eps_low) must be in [0, 1) so that 1 - eps_low > 0; got {clip_ratio_low}."
        )
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high (eps_high) must be >= 0; got {clip_ratio_high}.")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c (dual clip) must be > 1, or None to disable it; got {clip_ratio_c}."
        )


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    max_response_length: int | None = None,
    rollout_log_probs: Tensor | None = None,
    tis_cap: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO clipped token-level policy loss of one micro-batch (formulas: module docstring).

    Args:
        log_probs: ``[B, T]`` log-probabilities of the response tokens under the current
            policy (the only input that must carry gradients).
        old_log_probs: ``[B, T]`` log-probabilities under the policy that the advantages and
            the trust region refer to (``pi_old``; computed before the first update).
        advantages: ``[B]`` (one per response, broadcast over its tokens) or ``[B, T]``.
        response_mask: ``[B, T]`` bool or float, 1 on tokens that enter the loss.
        clip_ratio_low: ``eps_low``, lower clip ``1 - eps_low`` of the ratio; in ``[0, 1)``.
        clip_ratio_high: ``eps_high``, upper clip ``1 + eps_high``; ``>= 0``. DAPO's
            clip-higher uses ``eps_high > eps_low`` (0.28 vs 0.2) against entropy collapse.
        clip_ratio_c: Dual-clip constant ``c > 1`` bounding the loss of negative-advantage
            tokens at ``c * |A|``; None disables it (the DAPO paper does not use it; verl's
            default is 3.0).
        loss_agg_mode: One of :data:`LOSS_AGG_MODES`; DAPO uses ``"token-mean"``.
        global_token_count: Response tokens in the whole mini-batch over all micro-batches
            and ranks (``token-mean``); None uses this micro-batch's count.
        global_seq_count: Sequences in the whole mini-batch over all micro-batches and ranks
            (``seq-*`` modes); None uses this micro-batch's (see :func:`aggregate_loss`).
        max_response_length: Dr. GRPO's constant ``L`` (``seq-mean-token-sum-norm`` only).
        rollout_log_probs: ``[B, T]`` the rollout engine's log-probabilities of the sampled
            tokens; used for TIS only when ``tis_cap`` is set.
        tis_cap: Truncation ``C > 0`` of the TIS weight ``min(exp(old - rollout), C)``; None
            disables the correction (typical value 2.0).
        entropy: ``[B, T]`` token entropies of the current policy (for the bonus and the
            ``entropy`` metric).
        entropy_coef: Weight of the entropy bonus (``0`` disables it; DAPO uses 0).
        ref_log_probs: ``[B, T]`` log-probabilities under a frozen reference policy.
        kl_coef: Weight of the k3 KL penalty to the reference (``0`` disables it; DAPO uses 0).

    Returns:
        ``(loss, metrics)``: the scalar loss share, and detached scalar metrics of this
        micro-batch. Means are over its valid tokens (weighted by the mask); to reduce them
        over micro-batches/ranks weight each by ``metrics["token_count"]``. Keys:
        ``token_count``, ``pg_loss`` (mean of ``w_t * pg_t``), ``clipfrac_high``
        (``A > 0`` and ``ratio > 1 + eps_high``), ``clipfrac_low`` (``A < 0`` and
        ``ratio < 1 - eps_low``), ``dual_clipfrac`` (``A < 0`` and ``ratio > c``; 0 when
        dual clip is off), ``approx_kl_k1`` (mean of ``old - logp``), ``approx_kl_k3``
        (mean of ``ratio - 1 - log ratio``, KL(old || new)), ``ratio_mean``, ``ratio_max``;
        ``entropy`` when ``entropy`` is given; ``tis_weight_mean``, ``tis_weight_min`` when
        TIS is active; ``kl_ref`` (mean of ``kl_t``) when ``ref_log_probs`` is given. On a
        fully masked micro-batch means are 0, ``ratio_max`` is 0 and ``tis_weight_min`` is
        ``tis_cap`` (the neutral elements of a max / min reduction).
    """
    # ---- validation: every error names the argument and the fix.
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T]; got shape {tuple(log_probs.shape)}.")
    if not log_probs.is_floating_point():
        raise TypeError(f"log_probs must be a floating-point tensor; got {log_probs.dtype}.")
    shape = log_probs.shape
    _check_same_shape("old_log_probs", old_log_probs, shape)
    _check_same_shape("response_mask", response_mask, shape)
    _check_same_shape("rollout_log_probs", rollout_log_probs, shape)
    _check_same_shape("entropy", entropy, shape)
    _check_same_shape("ref_log_probs", ref_log_probs, shape)
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be [B] = {tuple(shape[:1])} or [B, T] = {tuple(shape)}; "
            f"got {tuple(advantages.shape)}."
        )
    check_loss_settings(clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode)
    if tis_cap is not None:
        if not tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0, or None to disable TIS; got {tis_cap}.")
        if rollout_log_probs is None:
            raise ValueError(
                "tis_cap is set but rollout_log_probs is None: pass the engine's sampling "
                "log-probabilities, or set tis_cap=None to disable the rollout correction."
            )
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(
            f"entropy_coef={entropy_coef} needs the token entropies: pass entropy=[B, T] "
            "(response_log_probs(..., with_entropy=True)) or set entropy_coef=0."
        )
    if kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError(
            f"kl_coef={kl_coef} needs the reference policy: pass ref_log_probs=[B, T] or set kl_coef=0."
        )

    # ---- sanitise: masked tokens become zeros before any arithmetic (no inf/NaN leaks).
    mask = response_mask.to(log_probs.dtype)
    valid = mask != 0
    zeros = torch.zeros_like(log_probs)

    def clean(x: Tensor) -> Tensor:
        return torch.where(valid, x.to(log_probs.dtype), zeros)

    logp = clean(log_probs)
    old = clean(old_log_probs.detach())
    adv = advantages.detach().to(log_probs.dtype)
    adv = clean(adv.unsqueeze(-1).expand(shape) if adv.dim() == 1 else adv)

    # ---- clipped surrogate (+ dual clip).
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    negative = adv < 0
    if clip_ratio_c is not None:
        pg = torch.where(negative, torch.minimum(pg, -adv * clip_ratio_c), pg)

    # ---- rollout correction (TIS).
    tis_weight = None
    if tis_cap is not None:
        rollout = clean(rollout_log_probs.detach())
        tis_log = (old - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        tis_weight = torch.exp(tis_log).clamp(max=tis_cap).detach()
        pg = pg * tis_weight

    token_loss = pg
    ent = None
    if entropy is not None:
        ent = clean(entropy)
        if entropy_coef != 0.0:
            token_loss = token_loss - entropy_coef * ent
    kl_ref = None
    if ref_log_probs is not None:
        ref_diff = (clean(ref_log_probs.detach()) - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_ref = torch.exp(ref_diff) - ref_diff - 1.0
        if kl_coef != 0.0:
            token_loss = token_loss + kl_coef * kl_ref

    loss = aggregate_loss(
        token_loss,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        max_response_length=max_response_length,
    )

    # ---- metrics (detached, masked means over this micro-batch's valid tokens).
    with torch.no_grad():
        count = mask.sum()
        denom = count.clamp(min=1.0)

        def mean(x: Tensor) -> Tensor:
            return (torch.where(valid, x * mask, zeros)).sum() / denom

        def frac(cond: Tensor) -> Tensor:
            return mean((cond & valid).to(log_probs.dtype))

        ratio_d, log_ratio_d = ratio.detach(), log_ratio.detach()
        metrics: dict[str, Tensor] = {
            "token_count": count.detach(),
            "pg_loss": mean(pg.detach()),
            "clipfrac_high": frac((adv > 0) & (ratio_d > hi)),
            "clipfrac_low": frac(negative & (ratio_d < lo)),
            "dual_clipfrac": frac(negative & (ratio_d > clip_ratio_c))
            if clip_ratio_c is not None
            else torch.zeros((), dtype=log_probs.dtype, device=log_probs.device),
            "approx_kl_k1": mean(-log_ratio_d),
            "approx_kl_k3": mean(ratio_d - 1.0 - log_ratio_d),
            "ratio_mean": mean(ratio_d),
            "ratio_max": torch.where(valid, ratio_d, zeros).amax()
            if ratio_d.numel()
            else zeros.sum(),
        }
        if ent is not None:
            metrics["entropy"] = mean(ent.detach())
        if tis_weight is not None:
            metrics["tis_weight_mean"] = mean(tis_weight)
            metrics["tis_weight_min"] = (
                torch.where(valid, tis_weight, torch.full_like(tis_weight, tis_cap)).amin()
                if tis_weight.numel()
                else torch.tensor(tis_cap, dtype=log_probs.dtype, device=log_probs.device)
            )
        if kl_ref is not None:
            metrics["kl_ref"] = mean(kl_ref.detach())
    return loss, metrics
