"""Operations on groups of scored rollouts (pure; no producer state): concatenating rounds,
replacing rows, a group's best value, the dynamic-sampling filter's variance test and its
decision per row, the group size of a set of groups."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.rollout.base import SamplingConfig


def concat_rollouts(parts: Sequence[ScoredRollouts]) -> ScoredRollouts:
    """Concatenate rollouts; group ids are renumbered so groups stay distinct and contiguous."""
    if not parts:
        raise ValueError("nothing to concatenate.")
    group_index, offset = [], 0
    for p in parts:
        if len(p):
            group_index.append(p.group_index + offset)
            offset += p.num_groups
    keys = set().union(*(p.extra.keys() for p in parts))
    return ScoredRollouts(
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        response_ids=[x for p in parts for x in p.response_ids],
        rollout_log_probs=[x for p in parts for x in p.rollout_log_probs],
        finish_reason=[x for p in parts for x in p.finish_reason],
        group_index=torch.cat(group_index) if group_index else torch.zeros(0, dtype=torch.long),
        prompt_uid=[x for p in parts for x in p.prompt_uid],
        score=torch.cat([p.score for p in parts]),
        acc=torch.cat([p.acc for p in parts]),
        sampling=parts[0].sampling,
        policy_version=max(p.policy_version for p in parts),
        reward=torch.cat([p.reward for p in parts]),
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        extra={k: [x for p in parts for x in p.extra.get(k, [None] * len(p))] for k in keys},
        token_mask=None
        if all(p.token_mask is None for p in parts)
        else [m for p in parts for m in p.token_masks()],
        tool_calls=None
        if all(p.tool_calls is None for p in parts)
        else [c for p in parts for c in (p.tool_calls or [0] * len(p))],
        batch_index=max(p.batch_index for p in parts),
    )


def replace_rows(
    rollouts: ScoredRollouts, rows: Sequence[int], other: ScoredRollouts
) -> ScoredRollouts:
    """``rollouts`` with row ``rows[i]`` replaced by row ``i`` of ``other`` (every per-row
    field but ``group_index``: the row stays in its group)."""
    if len(rows) != len(other):
        raise ValueError(f"{len(rows)} rows to replace by {len(other)} rows.")
    out = rollouts.select(list(range(len(rollouts))))
    tensors = ("score", "acc", "reward", "loss_mask")
    lists = ("prompt_ids", "response_ids", "rollout_log_probs", "finish_reason", "prompt_uid")
    index = torch.as_tensor(list(rows), dtype=torch.long)
    for name in tensors:
        getattr(out, name)[index] = getattr(other, name).to(getattr(out, name).dtype)
    for name in lists:
        for row, value in zip(rows, getattr(other, name)):
            getattr(out, name)[row] = value
    for key in set(out.extra) | set(other.extra):
        column = out.extra.setdefault(key, [None] * len(out))
        for row, value in zip(rows, other.extra.get(key, [None] * len(other))):
            column[row] = value
    if out.token_mask is not None or other.token_mask is not None:
        out.token_mask = out.token_masks()
        for row, mask in zip(rows, other.token_masks()):
            out.token_mask[row] = mask
    if out.tool_calls is not None or other.tool_calls is not None:
        out.tool_calls = list(out.tool_calls or [0] * len(out))
        for row, calls in zip(rows, other.tool_calls or [0] * len(other)):
            out.tool_calls[row] = calls
    return out


def group_max(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """``[num_groups]`` float: ``max_{i in g} values[i]`` for each group ``g`` (0 for a group
    without rows)."""
    return torch.zeros(num_groups).scatter_reduce(
        0, group_index.long(), values.float(), "amax", include_self=False
    )


def group_has_variance(values: Tensor, group_index: Tensor) -> Tensor:
    """``[G]`` bool: True where the group's values are not all equal (std > 0 <=> max > min)."""
    num_groups = int(group_index.max()) + 1 if len(group_index) else 0
    v = values.float()
    hi = torch.full((num_groups,), -torch.inf).scatter_reduce(0, group_index, v, "amax")
    lo = torch.full((num_groups,), torch.inf).scatter_reduce(0, group_index, v, "amin")
    return hi > lo


def filter_decisions(
    values: Tensor, group_index: Tensor, keep_group: Tensor, metric: str
) -> list[str]:
    """Per row, its group's filter decision: ``"kept"``, or ``"dropped: <metric> all <v>"``
    where the group's ``values`` (of the filter ``metric``) are all ``v``."""
    keep, vals = keep_group.tolist(), values.float().tolist()
    return [
        "kept" if keep[g] else f"dropped: {metric} all {v:g}"
        for g, v in zip(group_index.tolist(), vals)
    ]


def group_sizes(group_index: Tensor) -> set[int]:
    """The distinct sizes of the groups of ``group_index`` (empty for no rows)."""
    if not len(group_index):
        return set()
    return set(torch.bincount(group_index.long()).tolist()) - {0}


def empty_rollouts(sampling: SamplingConfig) -> ScoredRollouts:
    """No rollouts (a rank that kept no group)."""
    return ScoredRollouts(
        prompt_ids=[], response_ids=[], rollout_log_probs=[], finish_reason=[],
        group_index=torch.zeros(0, dtype=torch.long), prompt_uid=[], score=torch.zeros(0),
        acc=torch.zeros(0), sampling=sampling,
    )  # fmt: skip
