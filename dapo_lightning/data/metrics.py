"""Validation metrics of sampled-and-scored held-out prompts."""

from __future__ import annotations

import torch

from dapo_lightning.data.batch import ScoredRollouts


def validation_metrics(rollouts: ScoredRollouts) -> dict[str, float]:
    """Accuracy, pass@k and mean response length of groups of ``k`` samples per prompt.

    With ``acc[i]`` in {0, 1} and groups ``g`` of ``k`` responses::

        val/acc             = mean_i acc[i]                   (avg@k)
        val/pass@k          = mean_g max_{i in g} acc[i]
        val/response_length = mean_i len(response_i)

    ``k`` is the size of the first group (all groups have the same size).
    """
    if len(rollouts) == 0:
        raise ValueError("validation_metrics got no rollouts.")
    g = rollouts.group_index.long()
    num_groups = int(g.max()) + 1
    k = int((g == g[0]).sum())
    acc = rollouts.acc.float()
    best = torch.zeros(num_groups).scatter_reduce(0, g, acc, "amax", include_self=False)
    return {
        "val/acc": float(acc.mean()),
        f"val/pass@{k}": float(best.mean()),
        "val/response_length": float(rollouts.response_length.float().mean()),
    }
