"""Metrics of rollouts: validation (held-out prompts) and one training rollout step."""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.producer import STAT_OPS
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.rollout.parity import logprob_parity


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


def rollout_step_metrics(
    batch: RolloutBatch,
    policy_version: int,
    update_seconds: float,
    trainer_logp: Tensor | None = None,
) -> MetricAccumulator:
    """This rank's metrics of one rollout step, each with its reduce op (see
    :mod:`dapo_lightning.metrics`); reduce them over ranks, then log.

    Per response, weighted by this rank's responses: ``rollout/reward_mean`` (shaped),
    ``rollout/score_mean`` (raw), ``rollout/acc``, ``rollout/response_length_mean``,
    ``rollout/truncation_rate``, ``data/staleness_mean`` (policy versions behind the current
    one); maxima ``rollout/response_length_max``, ``data/staleness_max``, ``time/update_s``;
    ``data/stale_token_frac`` weighted by tokens; ``rollout/tokens`` summed; the producer's
    statistics with :data:`~dapo_lightning.data.producer.STAT_OPS`. With ``trainer_logp``,
    ``parity/*`` (:func:`~dapo_lightning.rollout.parity.logprob_parity` on the tokens sampled
    by the current version) weighted by those tokens.
    """
    acc = MetricAccumulator()
    rows = float(batch.batch_size)
    lengths = batch.response_length.float()
    staleness = (policy_version - batch.sample_version).float()
    stale = staleness > 0
    for name, values in (
        ("rollout/reward_mean", batch.reward),
        ("rollout/score_mean", batch.score),
        ("rollout/acc", batch.acc),
        ("rollout/response_length_mean", lengths),
        ("rollout/truncation_rate", batch.truncated.float()),
        ("data/staleness_mean", staleness),
    ):
        acc.add(name, float(values.mean()) if rows else 0.0, weight=rows)
    acc.add("rollout/response_length_max", float(lengths.max()) if rows else 0.0, op="max")
    acc.add("data/staleness_max", float(staleness.max()) if rows else 0.0, op="max")
    tokens = float(batch.response_mask.sum())
    stale_tokens = float((batch.response_mask * stale[:, None]).sum())
    acc.add("data/stale_token_frac", stale_tokens / max(tokens, 1.0), weight=tokens)
    acc.add("rollout/tokens", float(lengths.sum()), op="sum")
    acc.add("time/update_s", update_seconds, op="max")
    for key in sorted(batch.stats):
        acc.add(key, float(batch.stats[key]), op=STAT_OPS.get(key, "mean"))
    if trainer_logp is not None:
        fresh = batch.response_mask * (~stale)[:, None].float()
        parity = logprob_parity(trainer_logp, batch.rollout_log_probs, fresh)
        weight = parity.pop("parity/tokens")
        for key, value in parity.items():
            acc.add(key, value, op="max" if key.endswith("_max") else "mean", weight=weight)
    return acc
