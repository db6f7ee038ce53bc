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

Each estimator is registered by name behind one fixed signature (``register_advantage_estimator``,
like the policy objectives)::

    estimator(rewards [B] (float32/64), groups: GroupStats, eps: float, batch_std: Tensor | None)
        -> advantages [B]

A group whose rewards are all equal gets ``A_i = 0`` exactly under every estimator (it carries
no learning signal; DAPO's dynamic sampling removes such groups before the loss anyway). The
advantage of a response is broadcast over its tokens by the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dapo_lightning.loss import LOSS_PATH
from dapo_lightning.registry import Entry, Registry


@dataclass(frozen=True)
class GroupStats:
    """Per-response group statistics of ``B`` rewards ``r`` (all ``[B]`` unless said).

    Args:
        index: Compact group id ``g(i)`` in ``0..G-1``.
        counts: ``[G]`` responses per group ``n_g``.
        sums: ``[G]`` reward sums ``sum_{j in g} r_j``.
        centered: ``r_i - mu_g(i)``, exactly 0 in constant groups.
        constant: True where the response's group has a single reward value.
    """

    index: Tensor
    counts: Tensor
    sums: Tensor
    centered: Tensor
    constant: Tensor


AdvantageEstimator = Callable[[Tensor, GroupStats, float, "Tensor | None"], Tensor]

ADVANTAGE_ESTIMATOR_REGISTRY: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", f"{LOSS_PATH}.advantage_estimator", "register_advantage_estimator"
)
"""The registered advantage estimators."""


def register_advantage_estimator(
    name: str, *, min_group_size: int = 1, needs_batch_std: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator (signature: module docstring). ``min_group_size``:
    the fewest responses per prompt it accepts; ``needs_batch_std``: it reads ``batch_std``, the
    std of the centered rewards over all ranks (the module all-reduces it)."""
    return ADVANTAGE_ESTIMATOR_REGISTRY.register(
        name, min_group_size=min_group_size, needs_batch_std=needs_batch_std
    )


def advantage_estimator(name: str) -> Entry[AdvantageEstimator]:
    """The estimator registered as ``name`` (or at a dotted import path)."""
    return ADVANTAGE_ESTIMATOR_REGISTRY.get(name)


def group_statistics(r: Tensor, group_index: Tensor) -> GroupStats:
    """:class:`GroupStats` of the rewards ``r`` by scatter (no loop over groups)."""
    _, inv = torch.unique(group_index, return_inverse=True)
    num_groups = int(inv.max()) + 1
    counts = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones_like(r)
    )
    sums = torch.zeros_like(counts).index_add_(0, inv, r)
    centered = r - (sums / counts)[inv]
    # Zero-variance groups: exactly 0 (r - sum/n may be off by rounding, e.g. 0.1 * 3 / 3).
    g_max = torch.full_like(counts, -torch.inf).scatter_reduce_(0, inv, r, reduce="amax")
    g_min = torch.full_like(counts, torch.inf).scatter_reduce_(0, inv, r, reduce="amin")
    constant = (g_max == g_min)[inv]
    centered = torch.where(constant, torch.zeros_like(centered), centered)
    return GroupStats(inv, counts, sums, centered, constant)


@register_advantage_estimator("grpo", min_group_size=2)
def grpo_advantages(r: Tensor, groups: GroupStats, eps: float, batch_std: Tensor | None) -> Tensor:
    """``A_i = (r_i - mu_g) / (sigma_g + eps)``, ``sigma_g`` the unbiased group std."""
    c = groups.centered
    sq = torch.zeros_like(groups.counts).index_add_(0, groups.index, c * c)
    std = torch.sqrt(sq / (groups.counts - 1))
    return c / (std[groups.index] + eps)


@register_advantage_estimator("reinforce_baseline", needs_batch_std=True)
def reinforce_baseline_advantages(
    r: Tensor, groups: GroupStats, eps: float, batch_std: Tensor | None
) -> Tensor:
    """``A_i = (r_i - mu_g) / (sigma + eps)``, ``sigma`` the unbiased std of the centered rewards
    over the whole batch (``batch_std`` when given, else over ``r``; 0 for one response)."""
    c = groups.centered
    if batch_std is not None:
        return c / (torch.as_tensor(batch_std, dtype=c.dtype) + eps)
    std = c.std() if c.numel() > 1 else c.new_zeros(())
    return c / (std + eps)


@register_advantage_estimator("rloo", min_group_size=2)
def rloo_advantages(r: Tensor, groups: GroupStats, eps: float, batch_std: Tensor | None) -> Tensor:
    """``A_i = r_i - (n_g mu_g - r_i) / (n_g - 1)`` (the leave-one-out mean as baseline)."""
    n = groups.counts[groups.index]
    return r - (groups.sums[groups.index] - r) / (n - 1)


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(
    r: Tensor, groups: GroupStats, eps: float, batch_std: Tensor | None
) -> Tensor:
    """``A_i = r_i - mu_g`` (Dr. GRPO: no std normalisation)."""
    return groups.centered


ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(ADVANTAGE_ESTIMATOR_REGISTRY.names())
"""The built-in estimators (a user's registered ones are valid too)."""


def _check_rewards(rewards: Tensor, group_index: Tensor, eps: float) -> None:
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
        estimator: A registered estimator (:data:`ADVANTAGE_ESTIMATORS` or a user's).
        eps: Added to the standard deviation of ``grpo`` / ``reinforce_baseline`` (``>= 0``).
        batch_std: ``reinforce_baseline`` only: the std ``sigma`` of the centered rewards over
            the global batch (all ranks); None takes it over ``rewards``.

    Returns:
        ``[B]`` advantages in the rewards' floating dtype (float32 for integer rewards), exactly
        0 in constant groups. ``grpo`` and ``rloo`` need at least 2 responses per group.
    """
    entry = advantage_estimator(estimator)
    _check_rewards(rewards, group_index, eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # Half precision is widened for the arithmetic and cast back at the end.
    r = rewards.detach().to(torch.promote_types(out_dtype, torch.float32))
    if r.numel() == 0:
        return r.to(out_dtype)
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite values at indices {bad}.")
    groups = group_statistics(r, group_index)
    least = entry.traits["min_group_size"]
    if bool((groups.counts < least).any()):
        raise ValueError(
            f"estimator={estimator!r} needs group size >= {least} (responses per prompt), but a "
            f"group has {int(groups.counts.min())} response(s). Sample n >= {least} responses per "
            "prompt, or use estimator='dr_grpo' / 'reinforce_baseline' (which give a lone "
            "response advantage 0)."
        )
    batch = None if batch_std is None else torch.as_tensor(batch_std, dtype=r.dtype)
    adv = entry.fn(r, groups, eps, batch)
    adv = torch.where(groups.constant, torch.zeros_like(adv), adv)
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
