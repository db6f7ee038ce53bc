"""A user's policy objective, registered from outside the library.

tests/test_objectives.py selects it through the real CLI by its dotted path
(``--model.init_args.loss.objective _user_objective.scaled_reinforce``; the test puts ``tests/``
on ``PYTHONPATH``) and checks the metric it emits reached metrics.csv.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from dapo_lightning import LossInputs, PolicyLossConfig, register_policy_objective


@register_policy_objective("scaled_reinforce", params={"scale": 1.0})
def scaled_reinforce(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: ``pg_t = -scale * A_t * logp_t``; metric ``user_scale`` = ``scale``."""
    pg = -params["scale"] * inputs.advantages * inputs.log_probs
    return pg, {"user_scale": inputs.log_probs.new_tensor(params["scale"])}


@register_policy_objective("rank_zero_metric")
def rank_zero_metric(
    inputs: LossInputs, config: PolicyLossConfig, params: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with a metric that rank 0 alone adds (the bug tests/test_module.py makes on
    purpose: the update's metric reduce must name it, not abort in a collective)."""
    import torch.distributed as dist

    metrics = {}
    if dist.is_initialized() and dist.get_rank() == 0:
        metrics["rank0_only"] = inputs.log_probs.new_tensor(1.0)
    return -inputs.advantages * inputs.log_probs, metrics
