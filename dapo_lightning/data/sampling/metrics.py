"""Metrics of rollouts: validation (held-out prompts) and one training rollout step.

One metric system per purpose:

* validation: :class:`ValidationMetrics`, ``torchmetrics`` metrics the module logs through
  Lightning (Lightning computes, syncs over ranks and resets them once per validation);
  :func:`validation_metrics` is their formula on one batch;
* a training rollout step: :func:`rollout_step_metrics` fills the step's
  :class:`~dapo_lightning.metrics.MetricAccumulator` (every metric with its reduce op; the
  producer's statistics with the op :class:`~dapo_lightning.data.sampling.step_stats.StepStats`
  declares), reduced over ranks in three collectives and logged once per step.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import MeanMetric

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.sampling.groups import group_max
from dapo_lightning.data.sampling.step_stats import rank_op
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.rollout.parity import logprob_parity


def validation_metrics(rollouts: ScoredRollouts) -> dict[str, float]:
    """Accuracy, pass@k and mean response length of groups of ``k`` samples per prompt.

    With ``acc[i]`` in {0, 1} and groups ``g`` of ``k`` responses::

        val/acc             = mean_i acc[i]                   (avg@k)
        val/pass@k          = mean_g max_{i in g} acc[i]
        val/response_length = mean_i len(response_i)
        val/tool_use_frac   = mean_i [tool_calls[i] > 0]     (multi-turn episodes only)

    ``k`` is the size of the first group (all groups have the same size).
    """
    if len(rollouts) == 0:
        raise ValueError("validation_metrics got no rollouts.")
    g = rollouts.group_index.long()
    num_groups = int(g.max()) + 1
    k = int((g == g[0]).sum())
    acc = rollouts.acc.float()
    best = group_max(acc, g, num_groups)
    out = {
        "val/acc": float(acc.mean()),
        f"val/pass@{k}": float(best.mean()),
        "val/response_length": float(rollouts.response_length.float().mean()),
    }
    if rollouts.tool_calls is not None:
        out["val/tool_use_frac"] = sum(c > 0 for c in rollouts.tool_calls) / len(rollouts)
    return out


class ValidationMetrics(torch.nn.Module):
    """``val/acc``, ``val/pass@k``, ``val/response_length`` (and with episodes
    ``val/tool_use_frac``) as ``torchmetrics`` metrics.

    Each is a :class:`~torchmetrics.MeanMetric` of the batches' :func:`validation_metrics`
    weighted by their response counts: over a validation (every batch of every rank)::

        val/x = sum_b x_b * responses_b / sum_b responses_b

    (for ``val/acc`` that is the mean over all responses, for ``val/pass@k`` over all groups).
    The module keeps one as an attribute and logs what :meth:`update` returns with
    ``log_dict(..., on_epoch=True)``; Lightning then calls ``compute`` at the end of the
    validation (torchmetrics sums the weighted values and the weights over ranks) and resets
    them. On one rank the value is bit for bit what logging the per-batch floats with
    ``batch_size=len(batch)`` gave (the same float32 sums in the same order).
    """

    def __init__(self) -> None:
        super().__init__()
        self.acc = MeanMetric()
        self.pass_at_k = MeanMetric()
        self.response_length = MeanMetric()
        self.tool_use = MeanMetric()  # episodes only

    def update(self, rollouts: ScoredRollouts, batch_idx: int) -> dict[str, MeanMetric]:
        """Add one validation batch (the first, ``batch_idx`` 0, starts a fresh validation);
        returns the metrics by logged name, for ``log_dict``."""
        if batch_idx == 0:  # an interrupted validation leaves nothing behind
            for metric in (self.acc, self.pass_at_k, self.response_length, self.tool_use):
                metric.reset()
        values = validation_metrics(rollouts)
        pass_name = next(k for k in values if k.startswith("val/pass@"))
        weight = float(len(rollouts))
        self.acc.update(values["val/acc"], weight)
        self.pass_at_k.update(values[pass_name], weight)
        self.response_length.update(values["val/response_length"], weight)
        out = {
            "val/acc": self.acc,
            pass_name: self.pass_at_k,
            "val/response_length": self.response_length,
        }
        if "val/tool_use_frac" in values:
            self.tool_use.update(values["val/tool_use_frac"], weight)
            out["val/tool_use_frac"] = self.tool_use
        return out


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
    statistics with the op each declares
    (:func:`~dapo_lightning.data.sampling.step_stats.rank_op`). With ``trainer_logp``,
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
        acc.add(key, float(batch.stats[key]), op=rank_op(key))
    if trainer_logp is not None:
        sampled = ~batch.demonstrated  # demonstrations apart
        fresh = batch.response_mask * (~stale & sampled)[:, None].float()
        parity = logprob_parity(trainer_logp, batch.rollout_log_probs, fresh)
        weight = parity.pop("parity/tokens")
        for key, value in parity.items():
            acc.add(key, value, op="max" if key.endswith("_max") else "mean", weight=weight)
    return acc
