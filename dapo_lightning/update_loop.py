"""The DAPO update of one rollout step, without Lightning (read it top to bottom).

:meth:`UpdateLoop.run` performs ``ppo_epochs * updates_per_epoch`` optimizer updates on one
:class:`~dapo_lightning.batch.RolloutBatch`::

    advantages (group-relative) -> old log-probs (eval mode, no grad) -> stale correction
    start copy of the step (a stop after some of its updates undoes them all)
    for each epoch, for each mini-batch of ``mini_batch_size`` prompts:
        N = all_reduce(response tokens of the mini-batch, over ranks); N == 0: no step
        K = all_reduce_max(micro-batches of the mini-batch)  (shorter ranks pad with empty ones)
        for each micro-batch: loss = sum(token losses) * world_size / N ; backward
            (no gradient sync until the last micro-batch where the strategy allows it)
        before the step: gradient norm, clip, non-finite checks (a bad one drops the gradients)
        optimizer.step -> a step that left non-finite weights is undone
        lr_scheduler.step, state.version += 1 -> metrics -> on_update

so the gradient of an update is exactly that of the token-mean loss over the whole mini-batch,
however it is split over micro-batches and ranks (docs/design.md, invariant 1). Everything the
distributed set-up decides goes through ``ranks`` (:class:`~dapo_lightning.strategy.StrategyAdapter`:
``StrategyAdapter(None)`` is one process without a trainer); everything the caller wires in
(the max-steps limit, logging, the step's start copy, the data's rewind, the update's share
of the cores) comes in a :class:`StepContext`. ``DAPOModule`` is the Lightning caller.

Stops: a stop request is checked between micro-batches and before each update after a step's
first; it undoes the rollout step under way (its completed updates included:
:class:`~dapo_lightning.step_guard.StepStart`), rewinds the data side and raises
:class:`~dapo_lightning.interrupt.StopRequested` (docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from dapo_lightning.advantages import (
    advantage_estimator,
    centered_moments,
    compute_advantages,
    std_from_moments,
)
from dapo_lightning.batch import RolloutBatch
from dapo_lightning.contract import CoreShare
from dapo_lightning.guarded_step import GuardedStep
from dapo_lightning.interrupt import raise_stop, request_stop, should_stop, stop_requested
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.loss import LossInputs, PolicyLossConfig
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.policy_loss import policy_loss
from dapo_lightning.policy_state import PolicyState
from dapo_lightning.shared_prompts import shared_prompt_log_probs
from dapo_lightning.step_guard import StepStart
from dapo_lightning.strategy import StrategyAdapter
from dapo_lightning.trace import phase
from dapo_lightning.update import (
    LOSS_METRIC_OPS,
    BatchingConfig,
    OptimizerStepConfig,
    StepTensors,
    behaviour_log_probs,
    micro_batch,
    micro_batch_rows,
    mini_batch_ranges,
    rows_of_groups,
)
from dapo_lightning.weights import eval_mode, has_dropout


def _no_limit() -> float:
    return math.inf


def _ignore(metrics: dict[str, float]) -> None:
    return None


def _no_start() -> StepStart | None:
    return None


def _nothing() -> None:
    return None


@dataclass
class StepContext:
    """What one rollout step's loop asks of its caller; the defaults run it alone.

    Args:
        train_batch_size: Prompts of a full rollout step over all ranks (the data's
            :class:`~dapo_lightning.contract.RolloutSpec`): a short batch is spread over the
            same number of updates. None: the batch is full.
        updates_left: Optimizer updates the run may still make (``trainer.max_steps``).
        on_update: Receives each update's metrics (reduced over ranks).
        take_step_start: Copies the step's start (:class:`~dapo_lightning.step_guard.StepStart`)
            and returns it; called only for steps of more than one update.
        rewind: Puts the data side back to before this step's rollouts (on a stop).
        cores: The update's share of the cores while the data side generates beside it (the
            data's :meth:`~dapo_lightning.contract.RolloutChannel.core_share`, one-step-off);
            None: the update keeps its threads.
    """

    train_batch_size: int | None = None
    updates_left: Callable[[], float] = _no_limit
    on_update: Callable[[dict[str, float]], None] = _ignore
    take_step_start: Callable[[], StepStart | None] = _no_start
    rewind: Callable[[], None] = _nothing
    cores: CoreShare | None = None

    def fit_threads(self) -> None:
        """Before each micro-batch: the update's threads for now (:attr:`cores`; nothing
        without a share)."""
        if self.cores is not None:
            self.cores.fit_update()


def batch_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` log-probabilities (and entropies) of ``batch``'s response tokens under
    ``model`` at the temperature the batch was sampled with (``share_prompts``: each distinct
    prompt run once)."""
    args = (model, batch.input_ids, batch.attention_mask, batch.response_width)
    kwargs = dict(
        temperature=batch.sampling.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
    )
    shared = shared_prompt_log_probs(*args, **kwargs) if share_prompts else None
    return shared if shared is not None else response_log_probs(*args, **kwargs)


def shares_prompts(batching: BatchingConfig, ranks: StrategyAdapter) -> bool:
    """Whether micro-batches run each shared prompt once (:class:`BatchingConfig`): in one
    process or under DDP (tested there); under FSDP and DeepSpeed, whose hooks wrap each
    forward, every row runs whole (not tested with two forwards per backward)."""
    return batching.share_prompts and ranks.kind in ("single", "ddp")


def rank_micro_batches(
    batch: RolloutBatch, rows: list[int], batching: BatchingConfig, ranks: StrategyAdapter
) -> list[list[int]]:
    """This rank's micro-batches of ``rows`` of ``batch`` (by length, under ``batching``'s
    limits, a group's rows together where prompts are shared), padded with empty ones to the
    most any rank has: FSDP syncs in every backward, so the counts must match."""
    lengths = batch.attention_mask[rows].sum(-1)
    groups = batch.group_index[rows] if shares_prompts(batching, ranks) else None
    size, tokens = batching.micro_batch_size, batching.max_tokens_per_micro_batch
    local = [[rows[j] for j in chunk] for chunk in micro_batch_rows(lengths, size, tokens, groups)]
    most = int(ranks.reduce(torch.tensor([float(len(local))]), "max").item())
    return local + [[]] * (most - len(local))


class UpdateLoop:
    """The policy updates of each rollout step (see the module docstring).

    Args:
        loss: The policy loss, objective and advantage estimator.
        batching: How each rollout step is cut into updates and micro-batches.
        ranks: The strategy's answers (``StrategyAdapter(None)``: one process, no trainer).
        step_config: Clipping, warm-up and the non-finite guard of each optimizer step.

    Call :meth:`bind` with the policy and its optimizer before :meth:`run`.
    """

    def __init__(
        self,
        loss: PolicyLossConfig,
        batching: BatchingConfig,
        ranks: StrategyAdapter,
        step_config: OptimizerStepConfig,
    ) -> None:
        self.loss, self.batching, self.ranks, self.step_config = loss, batching, ranks, step_config
        #: The trained policy, its optimizer and LR scheduler, the frozen KL reference.
        self.policy: nn.Module | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.ref_policy: nn.Module | None = None
        #: The run state it advances (version, skipped updates, rollout steps) and the entropy
        #: weight it trains with (callbacks set it between updates): its one owner.
        self.state = PolicyState(entropy_coef=loss.entropy_coef)
        #: Each optimizer step with its checks; its guard counts the non-finite updates.
        self.stepper = GuardedStep(ranks, step_config)
        self.nonfinite_guard = self.stepper.guard
        #: This step's start copy (None: not taken, the step finishes on a stop) and updates.
        self.step_start: StepStart | None = None
        self.step_updates = 0
        self.context = StepContext()

    def bind(
        self,
        policy: nn.Module,
        optimizer: Any = None,
        scheduler: Any = None,
        ref_policy: nn.Module | None = None,
    ) -> None:
        """The modules and optimizer the next :meth:`run` trains."""
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.ref_policy = ref_policy

    # ------------------------------------------------------------------ one rollout step
    @phase("update")
    def run(self, batch: RolloutBatch, context: StepContext | None = None) -> StepTensors:
        """All updates of one rollout step on ``batch`` (trimmed), then one more rollout step
        counted in :attr:`state`; returns what the updates shared."""
        self.context = context if context is not None else StepContext()
        self.step_updates = 0
        step = self.step_tensors(batch)
        updates = self.batching.ppo_epochs * len(self.mini_batches(batch.num_groups))
        take = updates >= 2 and not self.ranks.steps_in_engine  # DeepSpeed steps in its engine
        self.step_start = self.context.take_step_start() if take else None
        for _ in range(self.batching.ppo_epochs):
            for groups in self.mini_batches(batch.num_groups):
                if self.context.updates_left() <= 0:  # trainer.max_steps reached in this step
                    break
                if self.step_updates:  # before the first, a stop waits for its micro-batches
                    self.honour_stop()
                metrics = self.update(batch, rows_of_groups(groups, batch.group_size), step)
                self.context.on_update(metrics)
        self.state.rollout_step += 1
        return step

    def mini_batches(self, num_local_groups: int) -> list[range]:
        """This rank's mini-batches of one epoch (:func:`~dapo_lightning.update.mini_batch_ranges`)."""
        world = self.ranks.world_size
        full = self.context.train_batch_size
        full = full // world if full is not None else num_local_groups
        return mini_batch_ranges(num_local_groups, self.batching.mini_batch_size, world, full)

    def step_tensors(self, batch: RolloutBatch) -> StepTensors:
        """Advantages, old log-probs (skipped when the only update's forward gives them) and
        the stale-sample correction of this rollout step."""
        demonstrated = batch.demonstrated  # no engine sampled them
        stale = (batch.sample_version < self.state.version) & ~demonstrated
        # over all ranks: a rank-local choice runs other collectives and metrics on each rank
        any_stale, any_demonstrated = self.ranks.any_ranks([stale.any(), demonstrated.any()])
        exact_old = len(self.mini_batches(batch.num_groups)) > 1 or self.batching.ppo_epochs > 1
        if exact_old or any_stale or any_demonstrated or has_dropout(self.policy):
            old = self.old_log_probs(batch)
            if self.loss.rollout_correction.stale_old == "engine":
                old = torch.where(stale[:, None], batch.rollout_log_probs.to(old.dtype), old)
        else:
            old = None
        return StepTensors(
            advantages=self.advantages(batch),
            old_log_probs=old,
            behaviour=behaviour_log_probs(
                batch, old, stale, self.loss.rollout_correction, stale_on_any_rank=any_stale
            ),
            parity_logp=torch.zeros_like(batch.rollout_log_probs, dtype=self.logp_dtype()),
        )

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """Group-relative advantages (a batch std over all ranks where the estimator needs it)."""
        estimator = self.loss.advantage_estimator
        batch_std = None
        needs_std = advantage_estimator(estimator).traits["needs_batch_std"]
        if needs_std and self.ranks.world_size > 1:
            moments = centered_moments(batch.reward, batch.group_index)
            batch_std = std_from_moments(self.ranks.reduce(moments, "sum"))
        return compute_advantages(
            batch.reward, batch.group_index, estimator, batch_std=batch_std
        ).to(batch.input_ids.device)

    def logp_dtype(self) -> torch.dtype:
        """Log-probs are float32, or float64 for a float64 policy (exact reference tests)."""
        dtype = next(self.policy.parameters()).dtype
        return torch.float64 if dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def old_log_probs(self, batch: RolloutBatch) -> Tensor:
        """Log-probs of the policy before this step's updates, in eval mode (dropout off, as
        the engine samples)."""
        out = torch.zeros_like(batch.rollout_log_probs, dtype=self.logp_dtype())
        share = shares_prompts(self.batching, self.ranks)
        every_row = list(range(batch.batch_size))
        with eval_mode(self.policy):
            for rows in rank_micro_batches(batch, every_row, self.batching, self.ranks):
                self.context.fit_threads()
                micro = micro_batch(batch, rows)
                logp, _ = batch_log_probs(self.policy, micro, share_prompts=share)
                if rows:
                    out[rows, : micro.response_width] = logp
        return out

    # ------------------------------------------------------------------ one update
    def update(self, batch: RolloutBatch, rows: list[int], step: StepTensors) -> dict[str, float]:
        """One optimizer update on the mini-batch ``rows`` of ``batch`` (this rank's share)."""
        local = torch.tensor(
            [float(batch.response_mask[rows].sum()), float(len(rows))], dtype=torch.float64
        )
        # seq-* modes divide by every row of the mini-batch, fully masked (overlong-filtered)
        # ones included, as verl's trainer does (its global_batch_size = mini-batch x n)
        tokens, seqs = self.ranks.reduce(local, "sum").tolist()
        acc = MetricAccumulator()
        if tokens == 0:  # the same on every rank: no forward, no step
            return self.finish_update(acc, tokens, stepped=False, skipped_empty=True)
        micro_batches = rank_micro_batches(batch, rows, self.batching, self.ranks)
        acc.add("micro_batches", float(len(micro_batches)), op="max")
        acc.add("empty_micro_batches", float(sum(not m for m in micro_batches)), op="sum")
        for i, idx in enumerate(micro_batches):
            self.context.fit_threads()  # the rollout thread's cores once it is idle (one-step-off)
            loss, m, logp = self.micro_loss(batch, idx, step, tokens, seqs)
            if step.old_log_probs is None and idx:  # the update's forward gave the old ones
                step.parity_logp[idx, : logp.shape[1]] = logp.to(step.parity_logp.dtype)
            last = i == len(micro_batches) - 1
            self.ranks.backward(loss * self.ranks.grad_average_factor, last=last)
            acc.add_all(m, LOSS_METRIC_OPS, weight=float(m["token_count"]))
            acc.add("loss", float(loss.detach()), op="sum")
            if not last:
                self.honour_stop()
        acc.add("lr", float(self.optimizer.param_groups[0]["lr"]), op="max")  # the rate it uses
        outcome = self.stepper.step(self.optimizer, self.policy, self.before_optimizer_step)
        grad_norm, skipped = outcome.grad_norm, outcome.skipped
        if skipped:
            self.state.skipped_updates += 1
        else:
            self.scheduler.step()
            self.state.version += 1
        self.step_updates += 1
        return self.finish_update(acc, tokens, stepped=not skipped, grad_norm=grad_norm)

    def micro_loss(
        self, batch: RolloutBatch, idx: list[int], step: StepTensors, tokens: float, seqs: float
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """This micro-batch's share of the mini-batch loss (global normalisers ``tokens``,
        ``seqs``: the loss shares of all micro-batches of all ranks sum to the loss), its
        metrics, and the trainer's log-probs of its rows (detached, ``[len(idx), width]``)."""
        micro = micro_batch(batch, idx)
        width = micro.response_width
        share = shares_prompts(self.batching, self.ranks)
        logp, entropy = batch_log_probs(
            self.policy,
            micro,
            with_entropy=True,
            entropy_grad=self.state.entropy_coef != 0,
            share_prompts=share,
        )

        def rows_of(t: Tensor) -> Tensor:
            return t[idx, :width].to(logp.dtype) if idx else torch.zeros_like(logp)

        old = logp.detach() if step.old_log_probs is None else rows_of(step.old_log_probs)
        ref_logp = None
        if self.loss.kl_coef > 0 and self.ref_policy is not None:
            with torch.no_grad():
                ref_logp, _ = batch_log_probs(self.ref_policy, micro, share_prompts=share)
        config = replace(self.loss, entropy_coef=self.state.entropy_coef)
        behaviour = step.behaviour
        if behaviour is not None:
            config = replace(config, rollout_correction=behaviour.correction)
        inputs = LossInputs.build(
            logp,
            old,
            step.advantages[idx] if idx else torch.zeros(1, device=logp.device),
            micro.response_mask,
            rollout_log_probs=rows_of(behaviour.log_probs) if behaviour is not None else None,
            entropy=entropy,
            ref_log_probs=ref_logp,
            global_token_count=max(tokens, 1.0),
            global_seq_count=max(seqs, 1.0),
            max_response_length=batch.sampling.max_tokens,
        )
        loss, metrics = policy_loss(inputs, config)
        return loss, metrics, logp.detach()

    def before_optimizer_step(self, optimizer: Any) -> None:
        """The step's checks, right before it (:meth:`GuardedStep.before`: Lightning calls
        this from the module's ``on_before_optimizer_step``)."""
        self.stepper.before(optimizer, list(self.policy.parameters()))

    def honour_stop(self) -> None:
        """A stop request (on any rank) inside a rollout step, checked before each update after
        the first and between micro-batches: drop the partial update's gradients, undo the
        step's completed updates (its start copy), rewind the data side (the step's rollouts
        are generated again on resume) and raise
        :class:`~dapo_lightning.interrupt.StopRequested`. Where no start was taken (DeepSpeed)
        a step that has completed an update finishes."""
        if not self.ranks.any_rank(should_stop()):
            return
        start, done = self.step_start, self.step_updates
        if done and start is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if done:
            start.restore()
            self.step_updates = 0
        self.context.rewind()
        if stop_requested() is None:
            request_stop("stop requested on another rank")
        raise_stop()

    def finish_update(
        self,
        acc: MetricAccumulator,
        tokens: float,
        *,
        stepped: bool,
        grad_norm: float = math.nan,
        skipped_empty: bool = False,
    ) -> dict[str, float]:
        """The update's metrics, reduced over ranks (names without the ``update/`` prefix)."""
        metrics = acc.reduce(self.ranks.reduce)
        after = self.ranks.grad_norm_after_step()
        metrics.pop("token_count", None)  # == tokens
        metrics.update(
            grad_norm=float(after if after is not None else grad_norm),
            entropy_coef=float(self.state.entropy_coef),
            tokens=float(tokens),
            skipped_nonfinite=float(not stepped and not skipped_empty),
            skipped_empty=float(skipped_empty),
        )
        return metrics
