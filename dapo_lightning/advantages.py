"""Group-relative advantage estimators (outcome rewards, one scalar per response).

Each response ``i`` belongs to a group ``g = g(i)`` (the ``n`` responses sampled for one
prompt). With ``n_g`` responses, group mean ``mu_g = (1/n_g) sum_{j in g} r_j`` and unbiased
group standard deviation ``sigma_g = sqrt(sum_{j in g} (r_j - mu_g)^2 / (n_g - 1))``::

    grpo:                A_i = (r_i - mu_g) / (sigma_g + eps)
    reinforce_baseline:  A_i = (r_i - mu_g) / (sigma + eps),
                         sigma = unbiased std over the whole batch of (r_j - mu_g(j)),
                         the batch of all ranks (the caller passes ``batch_std`` when the
                         batch is split over ranks: see :func:`centered_moments`)
    rloo:                A_i = r_i - (n_g * mu_g - r_i) / (n_g - 1)      (leave-one-out mean)
    dr_grpo:             A_i = r_i - mu_g                                 (Dr. GRPO, no std)

A group whose rewards are all equal gets ``A_i = 0`` exactly under every estimator (it carries
no learning signal; DAPO's dynamic sampling removes such groups before the loss anyway). The
advantage of a response is broadcast over its tokens by the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "reinforce_baseline", "rloo", "dr_grpo")
"""Valid values of ``estimator`` in :func:`compute_advantages`."""


def compute_advantages(
    rewards: Tensor,
    group_index: Tensor,
    estimator: str = "grpo",
    eps: float = 1e-6,
    batch_std: float | Tensor | None = None,
) -> Tensor:
    """Group-relative advantages of ``B`` responses (formulas: module docstring).

    Args:
        rewards: ``[B]`` scalar reward of each response.
        group_index: ``[B]`` integer id of the group (prompt) of each response. Ids may be
            any integers; groups need not be contiguous nor of equal size.
        estimator: One of :data:`ADVANTAGE_ESTIMATORS`.
        eps: Added to the standard deviation of ``grpo`` / ``reinforce_baseline`` (``>= 0``).
        batch_std: ``reinforce_baseline`` only: the std ``sigma`` of the centered rewards over
            the global batch (all ranks); None takes it over ``rewards``.

    Returns:
        ``[B]`` advantages in the rewards' floating dtype (float32 for integer rewards).
        ``grpo`` and ``rloo`` need at least 2 responses per group. For ``reinforce_baseline``
        the batch std of a single response is taken as 0.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"estimator={estimator!r} is not known; valid estimators: {', '.join(ADVANTAGE_ESTIMATORS)}."
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B]; got shape {tuple(rewards.shape)}.")
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index must have the shape of rewards {tuple(rewards.shape)}; "
            f"got {tuple(group_index.shape)}."
        )
    if group_index.is_floating_point() or group_index.is_complex():
        raise TypeError(f"group_index must be an integer tensor; got {group_index.dtype}.")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0; got {eps}.")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # Half precision is widened for the arithmetic and cast back at the end.
    work_dtype = torch.promote_types(out_dtype, torch.float32)
    r = rewards.detach().to(work_dtype)
    if r.numel() == 0:
        return r.to(out_dtype)
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite values at indices {bad}.")

    # Compact group ids to 0..G-1; all per-group statistics by scatter, no loop over groups.
    _, inv = torch.unique(group_index, return_inverse=True)
    num_groups = int(inv.max()) + 1
    counts = torch.zeros(num_groups, dtype=work_dtype, device=r.device).index_add_(
        0, inv, torch.ones_like(r)
    )
    if estimator in ("grpo", "rloo") and bool((counts < 2).any()):
        raise ValueError(
            f"estimator={estimator!r} needs group size >= 2 (responses per prompt), but a group "
            f"has {int(counts.min())} response(s). Sample n >= 2 responses per prompt, or use "
            "estimator='dr_grpo' / 'reinforce_baseline' (which give a lone response advantage 0)."
        )
    sums = torch.zeros_like(counts).index_add_(0, inv, r)
    mean = sums / counts
    centered = r - mean[inv]
    # Zero-variance groups: exactly 0 (r - sum/n may be off by rounding, e.g. 0.1 * 3 / 3).
    g_max = torch.full_like(counts, -torch.inf).scatter_reduce_(0, inv, r, reduce="amax")
    g_min = torch.full_like(counts, torch.inf).scatter_reduce_(0, inv, r, reduce="amin")
    constant = (g_max == g_min)[inv]
    centered = torch.where(constant, torch.zeros_like(centered), centered)

    if estimator == "dr_grpo":
        adv = centered
    elif estimator == "rloo":
        n = counts[inv]
        adv = r - (sums[inv] - r) / (n - 1)
    elif estimator == "grpo":
        sq = torch.zeros_like(counts).index_add_(0, inv, centered * centered)
        std = torch.sqrt(sq / (counts - 1))
        adv = centered / (std[inv] + eps)
    elif batch_std is not None:  # reinforce_baseline, global std given
        adv = centered / (torch.as_tensor(batch_std, dtype=work_dtype) + eps)
    else:  # reinforce_baseline
        std = centered.std() if centered.numel() > 1 else centered.new_zeros(())
        adv = centered / (std + eps)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def centered_moments(rewards: Tensor, group_index: Tensor) -> Tensor:
    """``[count, sum c, sum c^2]`` (float64) of the centered rewards ``c_i = r_i - mu_g(i)``.

    Summed over ranks, they give the global unbiased std that ``reinforce_baseline`` needs::

        sigma = sqrt((sum c^2 - (sum c)^2 / count) / (count - 1))      (0 when count < 2)

    (:func:`std_from_moments`). Constant groups count with ``c = 0``, as in
    :func:`compute_advantages`.
    """
    c = compute_advantages(rewards, group_index, "dr_grpo").double()
    return torch.stack([c.new_tensor(float(c.numel())), c.sum(), (c * c).sum()])


def std_from_moments(moments: Tensor) -> Tensor:
    """The unbiased std from :func:`centered_moments` (summed over ranks)."""
    count, total, squares = moments.double().unbind()
    if count < 2:
        return moments.new_zeros((), dtype=torch.float64)
    return torch.sqrt(((squares - total * total / count) / (count - 1)).clamp(min=0.0))
