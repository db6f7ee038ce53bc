"""DAPOModule: the DAPO policy update as a LightningModule with manual optimization.

One ``training_step`` consumes one :class:`~dapo_lightning.batch.RolloutBatch` (a rollout
step) and performs ``ppo_epochs * updates_per_epoch`` optimizer updates on it::

    advantages (group-relative) -> old log-probs (eval mode, no grad)
    for each epoch, for each mini-batch of ``mini_batch_size`` prompts:
        N = all_reduce(response tokens of the mini-batch, over ranks)
        K = all_reduce_max(micro-batches of the mini-batch)  (shorter ranks pad with empty ones)
        for each micro-batch: loss = sum(token losses) * world_size / N ; backward
            (no gradient sync until the last micro-batch where the strategy allows it)
        clip grad norm (after unscaling) -> optimizer.step -> lr_scheduler.step -> zero_grad

so the gradient of an update is exactly that of the token-mean loss over the whole mini-batch,
however it is split over micro-batches and ranks (docs/design.md, invariant 1). The strategy
specifics live in :mod:`dapo_lightning.strategy`, the reductions of metrics in
:mod:`dapo_lightning.metrics`, the loss in :mod:`dapo_lightning.loss`.

Steps: Lightning's ``global_step`` counts optimizer updates; ``policy_version`` counts weight
changes (updates applied, plus rollbacks), the version every rollout is stamped with;
``rollout_step`` counts training steps. ``update/*`` metrics are written after every update at
``step = global_step``; per-rollout-step metrics (``rollout/*``, ``time/*``, ``data/*``,
``reward/*``, ``parity/*``) once per ``training_step``.

Stops: a stop request is checked between micro-batches and before each update after a step's
first; it undoes the rollout step under way (its completed updates included:
:class:`~dapo_lightning.step_guard.StepStart`) and the step is generated again on resume
(docs/design.md, "Stopping and resuming"). A stop before those points lets the step finish.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from dapo_lightning.advantages import (
    advantage_estimator,
    centered_moments,
    compute_advantages,
    std_from_moments,
)
from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.checkpoint import collect_rng_states, restore_rng_states
from dapo_lightning.checks import check_optimizer_settings, optimizer_error
from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.data.metrics import ValidationMetrics, rollout_step_metrics
from dapo_lightning.hooks import call_dapo_hook, warn_undeclared_dapo_hooks
from dapo_lightning.interrupt import raise_stop, request_stop, should_stop, stop_requested
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.lora import (
    LORA_CHECKPOINT_KEY,
    LoraSettings,
    as_lora_settings,
    check_quantize_supported,
    is_peft_model,
    keep_adapters_only,
    load_base_policy,
    merged_model,
    reference_policy,
    restore_adapter_checkpoint,
    with_adapters,
)
from dapo_lightning.loss import LossInputs, PolicyLossConfig
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.policy_loss import policy_loss
from dapo_lightning.schedules import WarmupConstantLR
from dapo_lightning.step_guard import NonFiniteGuard, StepStart, all_finite, nonfinite_step_input
from dapo_lightning.strategy import ShardingConfig, StrategyAdapter, shard_policy
from dapo_lightning.update import (
    LOSS_METRIC_OPS,
    BatchingConfig,
    StepTensors,
    behaviour_log_probs,
    check_data_settings,
    check_module_settings,
    micro_batch,
    micro_batch_rows,
    mini_batch_ranges,
    rows_of_groups,
)
from dapo_lightning.weights import (
    enable_gradient_checkpointing,
    eval_mode,
    has_dropout,
    is_sharded,
)

__all__ = ["DAPOModule", "default_optimizer"]


def _as_config(cls: type, value: Any) -> Any:
    """A config group from itself or a dict of its fields (LightningCLI and saved
    hyper-parameters give dicts)."""
    return cls(**value) if isinstance(value, dict) else value


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW at the paper's learning rate 1e-6 (betas 0.9/0.999, weight decay 0.01)."""
    return torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)


class DAPOModule(LightningModule):
    """The DAPO policy update (Yu et al. 2025) with exact token-level gradient accumulation.

    The sampling temperature and maximum response length come with each batch
    (``RolloutBatch.sampling``): they are the data's settings and are declared only there.

    Args:
        model_name_or_path: Hugging Face model id or local folder of the policy; weights are
            loaded in ``configure_model`` (``trust_remote_code`` is never enabled).
        policy: An already built causal LM to train instead of loading ``model_name_or_path``.
        optimizer: Callable building the optimizer from the parameters (LightningCLI:
            ``class_path`` + ``init_args``). Default AdamW, lr 1e-6 (paper).
        lr_scheduler: Callable building the LR scheduler from the optimizer; stepped once per
            optimizer update. Default: linear warm-up over ``warmup_steps`` updates, then
            constant (paper). :class:`~dapo_lightning.schedules.WarmupCosineLR` decays.
        warmup_steps: Warm-up length of the default scheduler, in optimizer updates.
        loss: The policy loss, objective and advantage estimator
            (:class:`~dapo_lightning.loss.PolicyLossConfig`: clip ratios, aggregation, rollout
            correction, entropy and KL weights; a dict of its fields is accepted).
        batching: Mini-/micro-batches and epochs of each rollout step
            (:class:`~dapo_lightning.update.BatchingConfig`; a dict is accepted).
        gradient_clip_val: Max global gradient norm (paper/verl 1.0); None or 0 disables it.
        torch_dtype: Dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
            Use the Trainer's ``precision`` for mixed precision.
        gradient_checkpointing: Recompute activations in backward (saves memory, costs a forward).
        parity_check_every: Every k rollout steps, compare the engine's log-probs with the
            trainer's on freshly sampled tokens (``parity/*`` metrics); 0 disables.
        skip_nonfinite: Skip an update whose gradient norm is not finite (counted in
            ``update/skipped_nonfinite``) instead of corrupting the weights.
        sharding: FSDP2 settings (mixed precision, CPU offload), used when the trainer's
            strategy is ``ModelParallelStrategy`` (:class:`~dapo_lightning.strategy.ShardingConfig`).
        lora: Train LoRA adapters only (:class:`~dapo_lightning.lora.LoraSettings`; a dict of
            its fields is accepted); None trains every weight. Checkpoints then hold the
            adapters and their optimizer state only; the base comes from
            ``model_name_or_path``.

    Example::

        module = DAPOModule(
            "Qwen/Qwen2.5-0.5B",
            loss=PolicyLossConfig(clip_ratio_high=0.28),
            batching=BatchingConfig(mini_batch_size=32, micro_batch_size=8),
        )
        trainer = Trainer(max_steps=100)
        trainer.fit(module, datamodule=DAPODataModule(...))
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        policy: nn.Module | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        warmup_steps: int = 0,
        loss: PolicyLossConfig = PolicyLossConfig(),  # noqa: B008 - a frozen dataclass
        batching: BatchingConfig = BatchingConfig(),  # noqa: B008 - a frozen dataclass
        gradient_clip_val: float | None = 1.0,
        torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        gradient_checkpointing: bool = False,
        parity_check_every: int = 1,
        skip_nonfinite: bool = True,
        sharding: ShardingConfig = ShardingConfig(),  # noqa: B008 - a plain dataclass
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        #: The policy loss (the object; the hyper-parameters hold it as a dict).
        self.loss = _as_config(PolicyLossConfig, loss)
        #: How each rollout step is cut into updates and micro-batches.
        self.batching = _as_config(BatchingConfig, batching)
        self.save_hyperparameters(ignore=["policy", "optimizer", "lr_scheduler"])
        self.hparams["loss"], self.hparams["batching"] = asdict(self.loss), asdict(self.batching)
        check_module_settings(self.hparams, self.loss, has_policy=policy is not None)
        self.automatic_optimization = False
        #: FSDP2 settings (the object itself: LightningCLI keeps hyper-parameters as dicts).
        self.sharding = sharding
        #: LoRA adapters (the object itself; a dict from LightningCLI becomes one), or None.
        self.lora = as_lora_settings(lora)
        if self.lora is not None:
            check_quantize_supported(self.lora)
            # Checkpoints hold the adapters only; sharded (distributed) loads must not demand
            # the base (single-file loads get it filled in by on_load_checkpoint).
            self.strict_loading = False
        self.policy: nn.Module | None = policy
        self.ref_policy: nn.Module | None = None
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.adapter = StrategyAdapter(self)
        #: Weight of the entropy bonus; callbacks (EntropyScheduler) change it between updates.
        self.entropy_coef = self.loss.entropy_coef
        #: Weight changes so far (the version stamped on rollouts sampled after them).
        self.policy_version = 0
        #: Rollout steps (training steps) done so far.
        self.rollout_step = 0
        #: Updates skipped for a non-finite gradient norm.
        self.skipped_updates = 0
        #: Why training stopped, when the module ended it (nothing left to train on).
        self.stop_reason: str | None = None
        #: val/acc, val/pass@k, val/response_length (torchmetrics, logged per validation).
        self.val_metrics = ValidationMetrics()
        self._step_outcome: tuple[float, bool] = (
            math.nan,
            False,
        )  # set in on_before_optimizer_step

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the policy (with ``lora``: wrap it with adapters; and, with ``kl_coef > 0``, a
        frozen reference); under ``ModelParallelStrategy`` shard it with FSDP2 (each decoder
        layer, then the root)."""
        hp = self.hparams
        if self.policy is None:
            self.policy = load_base_policy(hp.model_name_or_path, hp.torch_dtype, self.lora)
        if self.lora is not None and not is_peft_model(self.policy):
            self.policy = with_adapters(self.policy, self.lora, self.adapter.kind)
        if self.adapter.kind == "fsdp2" and not is_sharded(self.policy):
            shard_policy(self.policy, self.device_mesh, self.sharding)
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps modes as they are
        if hp.gradient_checkpointing:
            enable_gradient_checkpointing(self.policy)
        if self.loss.kl_coef > 0 and self.ref_policy is None:
            # Kept outside the module tree: it is neither trained nor checkpointed.
            object.__setattr__(self, "ref_policy", reference_policy(self.policy))

    def on_fit_start(self) -> None:
        """Check the data's settings against the module's before any rollout is generated."""
        warn_undeclared_dapo_hooks(self.trainer)
        data = self.trainer.datamodule
        if isinstance(data, DAPODataModule):
            check_data_settings(self.loss, self.batching, data, self.policy)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        try:
            optimizer = self.optimizer_factory(params)
        except ValueError as err:  # torch's "Invalid learning rate: -1.0" names no config path
            raise optimizer_error(err, "model.optimizer.init_args") from err
        check_optimizer_settings(optimizer.param_groups, "model.optimizer.init_args")
        if self.lr_scheduler_factory is None:
            scheduler = WarmupConstantLR(optimizer, warmup_steps=self.hparams.warmup_steps)
        else:
            scheduler = self.lr_scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def forward_log_probs(
        self,
        batch: RolloutBatch,
        *,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        model: nn.Module | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, T]`` log-probabilities (and entropies) of ``batch``'s response tokens at the
        temperature the batch was sampled with."""
        return response_log_probs(
            model if model is not None else self.policy,
            batch.input_ids,
            batch.attention_mask,
            batch.response_width,
            temperature=batch.sampling.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    # ------------------------------------------------------------------ the DAPO step
    def mini_batches(self, num_local_groups: int) -> list[range]:
        """This rank's mini-batches of one epoch (:func:`~dapo_lightning.update.mini_batch_ranges`;
        the full batch size is the data's ``dynamic_sampling.train_batch_size``)."""
        world = self.adapter.world_size
        config = getattr(getattr(self._trainer, "datamodule", None), "dynamic_sampling", None)
        full = config.train_batch_size // world if config is not None else num_local_groups
        return mini_batch_ranges(num_local_groups, self.batching.mini_batch_size, world, full)

    def updates_left(self) -> float:
        """Optimizer updates before ``trainer.max_steps`` (inf when it is unset).

        A rollout step runs one update per mini-batch, and with ``on_exhausted: train_on_kept``
        their number varies; Lightning checks ``max_steps`` only between training steps, so the
        step's loop stops here itself and ``max_steps`` counts updates exactly. Every rank has the
        same ``global_step``, so all stop at the same update.
        """
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return math.inf
        return max_steps - self.trainer.global_step

    def training_step(self, batch: RolloutBatch | EndOfTraining, batch_idx: int) -> None:
        if isinstance(batch, EndOfTraining):
            self.stop_reason = batch.reason
            rank_zero_info(f"DAPO: stopping: {batch.reason}")
            self.trainer.should_stop = True
            return
        t_start, version = time.perf_counter(), self.policy_version  # the version it was drawn for
        self._step_updates = 0  # updates of this rollout step completed (a stop undoes them)
        batch = batch.trim()
        step = self._step_tensors(batch)
        self._take_step_start(batch)
        for _ in range(self.batching.ppo_epochs):
            for groups in self.mini_batches(batch.num_groups):
                if self.updates_left() <= 0:  # trainer.max_steps reached inside this step
                    break
                if self._step_updates:  # before the first, a stop waits for its micro-batches
                    self._honour_stop()
                metrics = self._update(batch, rows_of_groups(groups, batch.group_size), step)
                self._log_update(metrics)
                call_dapo_hook(self.trainer, "on_dapo_update", metrics)
        self.rollout_step += 1
        self._log_rollout_step(batch, step, version, time.perf_counter() - t_start)
        # Lightning logs self.log() values (rollout/*, the validation after this step) at its
        # batch counter, which counts rollout steps: with several updates per step, put it at
        # updates done - 1, as with one (update/* are at global_step; plot's x axis is updates).
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.global_step - 1

    def _step_tensors(self, batch: RolloutBatch) -> StepTensors:
        """Advantages, old log-probs (skipped when the only update's forward gives them) and
        the stale-sample correction of this rollout step."""
        stale = batch.sample_version < self.policy_version
        exact_old = (
            len(self.mini_batches(batch.num_groups)) > 1
            or self.batching.ppo_epochs > 1
            or bool(stale.any())
            or has_dropout(self.policy)
        )
        old = self._old_log_probs(batch) if exact_old else None
        return StepTensors(
            advantages=self._advantages(batch),
            old_log_probs=old,
            behaviour=behaviour_log_probs(batch, old, stale, self.loss.rollout_correction),
            parity_logp=torch.zeros_like(batch.rollout_log_probs, dtype=self._logp_dtype()),
        )

    def _advantages(self, batch: RolloutBatch) -> Tensor:
        estimator = self.loss.advantage_estimator
        batch_std = None
        needs_std = advantage_estimator(estimator).traits["needs_batch_std"]
        if needs_std and self.adapter.world_size > 1:
            moments = centered_moments(batch.reward, batch.group_index)
            batch_std = std_from_moments(self.adapter.reduce(moments, "sum"))
        return compute_advantages(
            batch.reward, batch.group_index, estimator, batch_std=batch_std
        ).to(self.device)

    def _logp_dtype(self) -> torch.dtype:
        """Log-probs are float32, or float64 for a float64 policy (exact reference tests)."""
        dtype = next(self.policy.parameters()).dtype
        return torch.float64 if dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def _old_log_probs(self, batch: RolloutBatch) -> Tensor:
        """Log-probs of the policy before this step's updates, in eval mode (dropout off, as
        the engine samples)."""
        out = torch.zeros_like(batch.rollout_log_probs, dtype=self._logp_dtype())
        with eval_mode(self.policy):
            for rows in self._micro_batches(batch, list(range(batch.batch_size))):
                micro = micro_batch(batch, rows)
                logp, _ = self.forward_log_probs(micro)
                if rows:
                    out[rows, : micro.response_width] = logp
        return out

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """Micro-batches of ``rows`` (by length, under the limits), padded with empty ones to
        the most any rank has: FSDP syncs in every backward, so the counts must match."""
        cut = self.batching
        lengths = batch.attention_mask[rows].sum(-1)
        local = micro_batch_rows(lengths, cut.micro_batch_size, cut.max_tokens_per_micro_batch)
        local = [[rows[j] for j in chunk] for chunk in local]
        most = int(self.adapter.reduce(torch.tensor([float(len(local))]), "max").item())
        return local + [[]] * (most - len(local))

    def _update(self, batch: RolloutBatch, rows: list[int], step: StepTensors) -> dict[str, float]:
        """One optimizer update on the mini-batch ``rows`` of ``batch`` (this rank's share)."""
        local = torch.tensor(
            [float(batch.response_mask[rows].sum()), float(len(rows))], dtype=torch.float64
        )
        # seq-* modes divide by every row of the mini-batch, fully masked (overlong-filtered)
        # ones included, as verl's trainer does (its global_batch_size = mini-batch x n)
        tokens, seqs = self.adapter.reduce(local, "sum").tolist()
        acc = MetricAccumulator()
        if tokens == 0:  # the same on every rank: no forward, no step
            return self._finish_update(acc, tokens, stepped=False, skipped_empty=True)
        micro_batches = self._micro_batches(batch, rows)
        acc.add("micro_batches", float(len(micro_batches)), op="max")
        acc.add("empty_micro_batches", float(sum(not m for m in micro_batches)), op="sum")
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        for i, idx in enumerate(micro_batches):
            loss, m = self._micro_loss(batch, idx, step, tokens, seqs)
            last = i == len(micro_batches) - 1
            self.adapter.backward(loss * self.adapter.grad_average_factor, last=last)
            acc.add_all(m, LOSS_METRIC_OPS, weight=float(m["token_count"]))
            acc.add("loss", float(loss.detach()), op="sum")
            if not last:
                self._honour_stop()
        acc.add("lr", float(optimizer.param_groups[0]["lr"]), op="max")  # the rate it uses
        optimizer.step()  # -> on_before_optimizer_step: norm, clip, skip decision
        grad_norm, skipped = self._step_outcome
        skipped = skipped or self._undo_if_nonfinite()
        optimizer.zero_grad(set_to_none=True)
        if self.hparams.skip_nonfinite:
            self.nonfinite_guard.record(skipped, self.nonfinite_guard.last_reason)
        if skipped:
            self.skipped_updates += 1
        else:
            scheduler.step()
            self.policy_version += 1
        self._step_updates = getattr(self, "_step_updates", 0) + 1
        return self._finish_update(acc, tokens, stepped=not skipped, grad_norm=grad_norm)

    def _take_step_start(self, batch: RolloutBatch) -> None:
        """Copy the rollout step's start (:class:`~dapo_lightning.step_guard.StepStart`) when
        it has more than one update, so that a stop after some of them can undo them all
        (DeepSpeed steps inside its engine: none is taken, such a step finishes)."""
        updates = self.batching.ppo_epochs * len(self.mini_batches(batch.num_groups))
        if updates < 2 or self.adapter.kind == "deepspeed":
            self._step_start = None
            return
        scheduler = self.lr_schedulers()
        counters = SimpleNamespace(
            state_dict=self._dapo_state, load_state_dict=self._load_dapo_state
        )
        stateful = [
            counters,
            self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress,
            *([scheduler] if scheduler is not None else []),
            *self.trainer.callbacks,
        ]
        self._step_start = self.__dict__.get("_step_start") or StepStart()
        self._step_start.take(self.optimizers(use_pl_optimizer=False), stateful)

    def _honour_stop(self) -> None:
        """A stop request (on any rank) inside a rollout step, checked before each update after
        the first and between micro-batches: drop the partial update's gradients, undo the
        step's completed updates (its :class:`~dapo_lightning.step_guard.StepStart`), put the
        data module back to the step's start (its rollouts are generated again on resume) and raise
        :class:`~dapo_lightning.interrupt.StopRequested`. Where no start was taken (DeepSpeed)
        a step that has completed an update finishes."""
        if not self.adapter.any_rank(should_stop()):
            return
        start, done = self.__dict__.get("_step_start"), getattr(self, "_step_updates", 0)
        if done and start is None:
            return
        self.optimizers().zero_grad(set_to_none=True)
        if done:
            start.restore()
            self._step_updates = 0
        rewind = getattr(self._trainer.datamodule, "rewind_rollout_batch", None)
        if callable(rewind):
            rewind()
        if stop_requested() is None:
            request_stop("stop requested on another rank")
        raise_stop()

    def _micro_loss(
        self, batch: RolloutBatch, idx: list[int], step: StepTensors, tokens: float, seqs: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's share of the mini-batch loss (global normalisers ``tokens``,
        ``seqs``: the loss shares of all micro-batches of all ranks sum to the loss)."""
        micro = micro_batch(batch, idx)
        width = micro.response_width
        logp, entropy = self.forward_log_probs(
            micro, with_entropy=True, entropy_grad=self.entropy_coef != 0
        )

        def rows_of(t: Tensor) -> Tensor:
            return t[idx, :width].to(logp.dtype) if idx else torch.zeros_like(logp)

        if step.old_log_probs is None:
            old = logp.detach()
            if idx:
                step.parity_logp[idx, :width] = old.to(step.parity_logp.dtype)
        else:
            old = rows_of(step.old_log_probs)
        ref_logp = None
        if self.loss.kl_coef > 0 and self.ref_policy is not None:
            with torch.no_grad():
                ref_logp, _ = self.forward_log_probs(micro, model=self.ref_policy)
        config = replace(self.loss, entropy_coef=self.entropy_coef)
        if step.behaviour is not None:
            config = replace(config, rollout_correction=step.behaviour[1])
        inputs = LossInputs.build(
            logp,
            old,
            step.advantages[idx] if idx else torch.zeros(1, device=logp.device),
            micro.response_mask,
            rollout_log_probs=rows_of(step.behaviour[0]) if step.behaviour is not None else None,
            entropy=entropy,
            ref_log_probs=ref_logp,
            global_token_count=max(tokens, 1.0),
            global_seq_count=max(seqs, 1.0),
            max_response_length=batch.sampling.max_tokens,
        )
        return policy_loss(inputs, config)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Gradient norm and clipping (gradients are unscaled here under ``16-mixed``); a
        non-finite norm, clip value or optimizer setting drops the gradients so the step leaves
        the weights as they are; otherwise the step is snapshot so that it can be undone
        (:mod:`dapo_lightning.step_guard`)."""
        clip = self.hparams.gradient_clip_val
        norm = self.adapter.clip_grad_norm(clip)
        known = not (math.isnan(norm) and self.adapter.kind == "deepspeed")
        skipped = bool(self.hparams.skip_nonfinite and known and not math.isfinite(norm))
        guard = self.nonfinite_guard
        guard.last_reason = f"gradient norm {norm}" if skipped else ""
        if self.hparams.skip_nonfinite and not skipped and self.adapter.kind != "deepspeed":
            bad = nonfinite_step_input(optimizer.param_groups, clip)
            skipped, guard.last_reason = bad is not None, f"the step would use {bad}"
            if not skipped:
                guard.snapshot.take(optimizer)
        if skipped:
            optimizer.zero_grad(set_to_none=True)
        self._step_outcome = (norm, skipped)

    @property
    def nonfinite_guard(self) -> NonFiniteGuard:
        """Counts non-finite updates, holds the pre-step snapshot (:mod:`~dapo_lightning.step_guard`)."""
        guard = self.__dict__.get("_nonfinite_guard")
        if guard is None:
            guard = self.__dict__["_nonfinite_guard"] = NonFiniteGuard()
        return guard

    def _undo_if_nonfinite(self) -> bool:
        """After a step: when a parameter is not finite (on any rank), put the snapshot back
        (parameters and optimizer state as before the step) and return True."""
        if not self.hparams.skip_nonfinite or self.adapter.kind == "deepspeed":
            return False
        params = [p for p in self.policy.parameters() if p.requires_grad]
        bad = self.adapter.any_rank(not all_finite(params))
        if bad:
            self.nonfinite_guard.snapshot.restore()
            self.nonfinite_guard.last_reason = "the step left non-finite weights (undone)"
        return bad

    def _finish_update(
        self,
        acc: MetricAccumulator,
        tokens: float,
        *,
        stepped: bool,
        grad_norm: float = math.nan,
        skipped_empty: bool = False,
    ) -> dict[str, float]:
        metrics = acc.reduce(self.adapter.reduce)
        ds_norm = self.adapter.deepspeed_grad_norm()
        metrics.pop("token_count", None)  # == tokens
        metrics.update(
            grad_norm=float(ds_norm if ds_norm is not None else grad_norm),
            entropy_coef=float(self.entropy_coef),
            tokens=float(tokens),
            skipped_nonfinite=float(not stepped and not skipped_empty),
            skipped_empty=float(skipped_empty),
        )
        return metrics

    def _log_update(self, metrics: dict[str, float]) -> None:
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(
                    {k if "/" in k else f"update/{k}": v for k, v in metrics.items()},
                    step=self.global_step,
                )

    def _log_rollout_step(
        self, batch: RolloutBatch, step: StepTensors, version: int, seconds: float
    ) -> None:
        """Logs the step's metrics; staleness and parity against ``version``, the policy version
        before this step's updates (after them every row would look stale)."""
        every = self.hparams.parity_check_every
        check = bool(every) and self.rollout_step % every == 0
        acc = rollout_step_metrics(batch, version, seconds, step.trainer_logp if check else None)
        values = acc.reduce(self.adapter.reduce)
        gen_s = values.get("data/gen_seconds", 0.0)
        values.update(
            {
                "rollout/step": float(self.rollout_step),
                "rollout/tokens_per_second": values.pop("rollout/tokens")
                / max(seconds + gen_s, 1e-9),
                "time/generation_s": gen_s,
                "update/skipped_total": float(self.skipped_updates),
            }
        )
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=max(batch.batch_size, 1))

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: ScoredRollouts, batch_idx: int) -> None:

        metrics = self.val_metrics.update(batch, batch_idx)  # torchmetrics: synced when computed
        self.log_dict(metrics, on_epoch=True, batch_size=len(batch))

    # ------------------------------------------------------------------ checkpoints
    def _dapo_state(self) -> dict[str, Any]:
        """The module's counters and the global RNGs (a checkpoint's ``"dapo"`` entry)."""
        return {
            "policy_version": self.policy_version,
            "rollout_step": self.rollout_step,
            "skipped_updates": self.skipped_updates,
            "entropy_coef": self.entropy_coef,
            "rng": collect_rng_states(),  # global RNGs (the engine's is in the data module)
        }

    def _load_dapo_state(self, state: dict[str, Any]) -> None:
        self.policy_version = int(state.get("policy_version", 0))
        self.rollout_step = int(state.get("rollout_step", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.entropy_coef = float(state.get("entropy_coef", self.entropy_coef))
        if "rng" in state:
            restore_rng_states(state["rng"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dapo"] = self._dapo_state()
        if is_peft_model(self.policy):
            keep_adapters_only(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dapo", {})
        restore_adapter_checkpoint(self, checkpoint, state.get(LORA_CHECKPOINT_KEY))
        self._load_dapo_state(state)

    def save_pretrained(self, path: str) -> None:
        """Write the policy in Hugging Face format (loadable with ``from_pretrained``); with
        LoRA, the merged model (``export_pretrained(..., adapter=True)`` writes the adapters)."""
        policy = merged_model(self.policy) if is_peft_model(self.policy) else self.policy
        policy.save_pretrained(path)
