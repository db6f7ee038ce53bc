"""The parts of one DAPO update that need no Lightning: how a rollout batch is cut into
mini-batches and micro-batches, which log-probs correct stale samples, and the checks of the
module's and the data's settings (docs/design.md, "One training step"). Loading the policy,
eval mode and frozen copies are in :mod:`dapo_lightning.weights`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from dapo_lightning.advantages import advantage_estimator
from dapo_lightning.batch import RolloutBatch
from dapo_lightning.checks import ConfigError, check_count, check_finite
from dapo_lightning.contract import RolloutSpec
from dapo_lightning.loss import LOSS_PATH, PolicyLossConfig
from dapo_lightning.metrics import ReduceOp
from dapo_lightning.objectives import objective_params, policy_objective
from dapo_lightning.rollout_correction import TRL_METRICS, RolloutCorrection, token_truncation

#: How each metric of :func:`~dapo_lightning.policy_loss.policy_loss` is reduced (default:
#: token-weighted mean).
LOSS_METRIC_OPS: dict[str, ReduceOp] = {
    "ratio_max": "max",
    "tis_weight_min": "min",
    "token_count": "sum",
    TRL_METRICS[1]: "max",
    TRL_METRICS[2]: "min",
    TRL_METRICS[4]: "max",
}


#: Where the module's settings are in a config: ``model.init_args.*`` (``model.*`` on the
#: command line too), named ``model.*`` in errors as the data's are ``data.*`` (the loss's:
#: ``loss.LOSS_PATH``, ``model.loss``).
MODEL_PATH = "model"
BATCHING_PATH = f"{MODEL_PATH}.batching"
OPTIMIZER_STEP_PATH = f"{MODEL_PATH}.optimizer_step"


@dataclass(frozen=True)
class BatchingConfig:
    """How each rollout step is cut into optimizer updates and forward/backward passes
    (YAML ``model.init_args.batching.*``).

    Args:
        mini_batch_size: Prompts (groups) per optimizer update, over all ranks; None: the whole
            rollout batch in one update. Must divide ``train_batch_size`` and be divisible by
            the world size.
        micro_batch_size: Sequences per forward/backward on one rank (>= 1).
        max_tokens_per_micro_batch: Optional cap (>= 1) on padded tokens per micro-batch (rows
            sorted by length and packed greedily under it).
        ppo_epochs: Passes over each rollout batch (>= 1).
        share_prompts: Run a prompt once for all rows of a micro-batch that share it (a
            group's samples), then each row's response against its keys and values
            (:func:`~dapo_lightning.shared_prompts.shared_prompt_log_probs`): the same log-probs and
            gradients for fewer tokens. In one process or under DDP, without gradient
            checkpointing; under FSDP and DeepSpeed every row runs whole (not tested there).
    """

    mini_batch_size: int | None = None
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: int | None = None
    ppo_epochs: int = 1
    share_prompts: bool = True

    def __post_init__(self) -> None:
        path = BATCHING_PATH
        check_count(
            f"{path}.mini_batch_size", self.mini_batch_size, 1,
            "prompts per optimizer update; null: one update per rollout step", none_ok=True,
        )  # fmt: skip
        check_count(
            f"{path}.micro_batch_size", self.micro_batch_size, 1, "sequences per forward/backward"
        )
        check_count(
            f"{path}.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1,
            "padded tokens per micro-batch; null: no cap", none_ok=True,
        )  # fmt: skip
        check_count(f"{path}.ppo_epochs", self.ppo_epochs, 1, "passes over each rollout batch")


_CLIP_FIX = "Give the max gradient norm (paper 1.0), or 0 / null for no clipping."


@dataclass(frozen=True)
class OptimizerStepConfig:
    """What each optimizer update does around ``optimizer.step()`` (YAML
    ``model.init_args.optimizer_step.*``).

    Args:
        gradient_clip_val: Max global gradient norm (paper/verl 1.0); None or 0 disables it.
        skip_nonfinite: Skip an update whose gradient norm is not finite (counted in
            ``update/skipped_nonfinite``), and undo one that leaves non-finite weights, instead
            of corrupting the weights.
        warmup_steps: Warm-up length of the default LR scheduler, in optimizer updates
            (linear, then constant: the paper's schedule).
    """

    gradient_clip_val: float | None = 1.0
    skip_nonfinite: bool = True
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        path, clip = OPTIMIZER_STEP_PATH, self.gradient_clip_val
        check_finite(f"{path}.gradient_clip_val", clip, _CLIP_FIX, none_ok=True)
        if clip is not None and not clip >= 0:
            raise ConfigError(
                f"{path}.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}; "
                "a negative norm bound would flip the gradient."
            )
        check_count(f"{path}.warmup_steps", self.warmup_steps, 0, "optimizer updates")


def split_groups(num_groups: int, parts: int) -> list[range]:
    """``parts`` consecutive ranges of group ids covering ``num_groups`` as evenly as possible
    (the first ``num_groups % parts`` get one more; some are empty when groups are fewer)."""
    base, extra = divmod(num_groups, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


def micro_batch_rows(
    lengths: Tensor, max_rows: int, max_tokens: int | None = None, groups: Tensor | None = None
) -> list[list[int]]:
    """Split row indices into micro-batches of at most ``max_rows`` rows and, when
    ``max_tokens`` is set, at most ``max_tokens`` padded tokens (rows x longest row).

    Rows are first sorted by length so each micro-batch pads little; a single row longer
    than ``max_tokens`` gets a micro-batch of its own. With ``groups`` (a group id per row),
    a group's rows stay together, groups ordered by their longest row: micro-batches then hold
    few distinct prompts (:attr:`BatchingConfig.share_prompts`).
    """
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    if groups is not None:
        rank: dict[int, int] = {}
        for i in order:  # a group's place is its longest row's
            rank.setdefault(int(groups[i]), len(rank))
        order.sort(key=lambda i: rank[int(groups[i])])  # stable: by length inside a group
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = int(lengths[i])
        new_longest = max(longest, length)
        too_many_tokens = max_tokens is not None and new_longest * (len(current) + 1) > max_tokens
        if current and (len(current) >= max_rows or too_many_tokens):
            chunks.append(current)
            current, new_longest = [], length
        current.append(i)
        longest = new_longest
    if current:
        chunks.append(current)
    return chunks


def mini_batch_ranges(
    num_local_groups: int, mini_batch_size: int | None, world_size: int, full_groups: int
) -> list[range]:
    """Mini-batches (ranges of local group ids) of one epoch: one per optimizer update.

    Each rank takes ``mini_batch_size / world_size`` groups per update, so a full batch of
    ``full_groups`` local groups makes ``full_groups / (mini_batch_size / world_size)``
    updates. A short batch (dynamic sampling ran out of rounds) spreads the groups it has over
    the same number of updates, so every rank makes the same updates (some maybe empty).

    Raises:
        ValueError: ``mini_batch_size`` does not split over the ranks or the batch.
    """
    if mini_batch_size is None:
        return [range(num_local_groups)]
    if mini_batch_size % world_size:
        raise ValueError(
            f"{BATCHING_PATH}.mini_batch_size={mini_batch_size} prompts must be divisible by the "
            f"world size ({world_size}): each rank takes mini_batch_size / world_size per update."
        )
    local = mini_batch_size // world_size
    if full_groups % local:
        raise ValueError(
            f"{BATCHING_PATH}.mini_batch_size={mini_batch_size} does not divide the rollout batch "
            f"({full_groups * world_size} prompts): choose a divisor of train_batch_size."
        )
    return split_groups(num_local_groups, full_groups // local)


def rows_of_groups(groups: range, group_size: int) -> list[int]:
    """Row indices of the groups ``groups`` (groups are contiguous blocks of ``group_size``)."""
    return list(range(groups.start * group_size, groups.stop * group_size))


def micro_batch(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """Rows ``rows`` of ``batch``, trimmed; no rows give one fully masked row (it joins the
    collectives of a rank with fewer micro-batches and contributes nothing)."""
    if rows:
        return batch.select(rows).trim()
    if batch.batch_size:
        pad = batch.select([0]).trim()
        pad.response_mask = torch.zeros_like(pad.response_mask)
        return pad
    return batch.padding_row()


class Behaviour(NamedTuple):
    """The behaviour policy a rollout correction weighs against
    (:mod:`~dapo_lightning.rollout_correction`): ``w_t = f(exp(old_t - log_probs_t))``."""

    #: ``[B, T]``: the log-probs the correction weight divides by.
    log_probs: Tensor
    #: The correction applied with them.
    correction: RolloutCorrection


def behaviour_log_probs(
    batch: RolloutBatch,
    old: Tensor | None,
    stale: Tensor,
    correction: RolloutCorrection,
    *,
    stale_on_any_rank: bool | None = None,
) -> Behaviour | None:
    """The :class:`Behaviour` of this rollout step: the log-probs the correction weight divides
    by and the correction (:mod:`~dapo_lightning.rollout_correction`).

    With a correction mode: the engine's log-probs on every row. Else with ``stale_tis_cap``:
    token truncation against the engine's on stale rows (sampled by an older policy version)
    and ``old`` on fresh ones, whose weight is then exactly 1. None when nothing is corrected.
    A demonstration's row (``batch.demonstrated``: nothing sampled it) takes ``old`` either
    way: its weight is 1.

    ``stale_on_any_rank`` is whether any rank holds a stale sampled row (None: this rank's
    ``stale``): a rank without one then corrects too, every weight exactly 1, so that every
    rank computes and reduces the same correction metrics (a rank-local decision made the
    ranks reduce metric vectors of different lengths: issue 53).
    """
    engine = batch.rollout_log_probs
    demonstrated = batch.demonstrated
    if bool(demonstrated.any()):
        if old is None:
            raise ValueError(
                "demonstrated rows need the old log-probs (step_tensors computes them)."
            )
        engine = torch.where(demonstrated[:, None], old.to(engine.dtype), engine)
    if correction.enabled:
        return Behaviour(engine, correction)
    cap = correction.stale_tis_cap
    stale = stale & ~demonstrated
    if stale_on_any_rank is None:
        stale_on_any_rank = bool(stale.any())
    if cap is None or not stale_on_any_rank or old is None:
        return None
    rows = torch.where(stale[:, None], engine.to(old.dtype), old)
    return Behaviour(rows, token_truncation(cap))


@dataclass
class StepTensors:
    """What every update of one rollout step shares.

    Args:
        advantages: ``[B]`` per response.
        old_log_probs: ``[B, T]`` of the policy before the step (None: one update per step,
            where the old policy is the current one and the update's own forward gives them).
        behaviour: Rollout correction (:func:`behaviour_log_probs`), or None.
        parity_logp: ``[B, T]`` filled with the trainer's log-probs when ``old_log_probs`` is
            None (compared with the engine's).
    """

    advantages: Tensor
    old_log_probs: Tensor | None
    behaviour: Behaviour | None
    parity_logp: Tensor

    @property
    def trainer_logp(self) -> Tensor:
        """The trainer's log-probs of the sampled tokens before the step's updates."""
        return self.old_log_probs if self.old_log_probs is not None else self.parity_logp


def check_module_settings(hp: Any, loss: PolicyLossConfig, *, has_policy: bool) -> None:
    """Raise a ValueError naming the field and the fix for an invalid module setting (the
    config groups validate their own fields; here: the names they refer to, and the rest)."""
    if hp.model_name_or_path is None and not has_policy:
        raise ValueError(
            "DAPOModule needs a policy: set `model_name_or_path` (a Hugging Face id or folder) "
            "or pass `policy=` a causal LM."
        )
    objective_params(policy_objective(loss.objective), loss.objective_kwargs)
    advantage_estimator(loss.advantage_estimator)
    check_count(
        f"{MODEL_PATH}.parity_check_every", hp.parity_check_every, 0, "rollout steps; 0: off"
    )


def check_data_settings(
    loss: PolicyLossConfig, batching: BatchingConfig, spec: RolloutSpec, policy: nn.Module | None
) -> None:
    """Raise a clear error for data settings this module cannot train on (before any generation
    is wasted). ``spec`` is what the data side declares its batches will be."""
    context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    longest = spec.max_prompt_length + spec.max_response_tokens
    if isinstance(context, int) and longest > context:
        raise ConfigError(
            f"data.prompts.max_prompt_length={spec.max_prompt_length} + data.sampling.max_tokens="
            f"{spec.max_response_tokens} = {longest} tokens exceeds the model's context "
            f"(max_position_embeddings={context}). Fix: lower prompts.max_prompt_length or "
            "sampling.max_tokens so that their sum fits the context."
        )
    least = advantage_estimator(loss.advantage_estimator).traits["min_group_size"]
    if spec.group_size < least:
        raise ConfigError(
            f"data.dynamic_sampling.n={spec.group_size} with {LOSS_PATH}.advantage_estimator="
            f"{loss.advantage_estimator!r}, which needs {least} responses per prompt (a group of "
            "one has no std / no other responses to compare with). Fix: n >= 2 (paper 16), or "
            "advantage_estimator 'dr_grpo' / 'reinforce_baseline'."
        )
    mini = batching.mini_batch_size
    if mini is not None and spec.train_batch_size % mini:
        raise ConfigError(
            f"{BATCHING_PATH}.mini_batch_size={mini} does not divide data.dynamic_sampling."
            f"train_batch_size={spec.train_batch_size} (prompts per rollout step). Fix: choose "
            "a divisor of train_batch_size, or null for one update per rollout step (on the "
            "command line: --model.init_args.batching '{\"mini_batch_size\": null}'; "
            "jsonargparse refuses --model.init_args.batching.mini_batch_size null)."
        )
