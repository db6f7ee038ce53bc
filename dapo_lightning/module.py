"""DAPOModule: the DAPO policy update as a LightningModule with manual optimization.

One ``training_step`` consumes one :class:`~dapo_lightning.batch.RolloutBatch` (a rollout
step) and hands it to :class:`~dapo_lightning.update_loop.UpdateLoop`, the Lightning-free loop
of its ``ppo_epochs * updates_per_epoch`` optimizer updates (epoch -> mini-batch ->
micro-batch; read its module docstring for the loop). This class is the Lightning wiring: it
loads and shards the policy, builds the optimizer, binds them to the loop, hands Lightning's
max-steps limit, logging and step-start copy to it, and talks to the data side only through the
contract of :mod:`dapo_lightning.contract` (a :class:`~dapo_lightning.contract.PolicyHandle`
published after each rollout step; the data's spec and rewind).

Steps: Lightning's ``global_step`` counts optimizer updates; ``policy_version`` counts weight
changes (updates applied, plus rollbacks), the version every rollout is stamped with;
``rollout_step`` counts training steps. Both live in the loop's
:class:`~dapo_lightning.policy_state.PolicyState` (``policy_state``, with the skipped updates
and the entropy weight), their one owner; callbacks change it only through its declared
calls. ``update/*`` metrics are written after every update at ``step = global_step``;
per-rollout-step metrics (``rollout/*``, ``time/*``, ``data/*``, ``reward/*``, ``parity/*``)
once per ``training_step``.

Stops: a stop request inside a rollout step undoes it (the loop's ``honour_stop``) and the step
is generated again on resume (docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.checkpoint.checks import check_checkpoint_fits
from dapo_lightning.checks import check_optimizer_settings, optimizer_error
from dapo_lightning.contract import PolicyHandle, RolloutChannel, rollout_channel
from dapo_lightning.data.sampling.metrics import ValidationMetrics, rollout_step_metrics
from dapo_lightning.hooks import call_dapo_hook, warn_undeclared_dapo_hooks
from dapo_lightning.lightning_internals import optimizer_step_progress
from dapo_lightning.log_step import log_rollout_step, set_logging_step
from dapo_lightning.lora import (
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
from dapo_lightning.lora.settings import LoraSettings
from dapo_lightning.loss import PolicyLossConfig
from dapo_lightning.policy_state import PolicyState
from dapo_lightning.rng_state import GLOBAL_RNGS, collect_rng_states, restore_rng_states
from dapo_lightning.schedules import WarmupConstantLR
from dapo_lightning.step_guard import NonFiniteGuard, StepStart
from dapo_lightning.strategy import ShardingConfig, StrategyAdapter
from dapo_lightning.update import (
    BatchingConfig,
    OptimizerStepConfig,
    StepTensors,
    check_data_settings,
    check_module_settings,
)
from dapo_lightning.update_loop import StepContext, UpdateLoop, batch_log_probs
from dapo_lightning.weights import enable_gradient_checkpointing

__all__ = ["DAPOModule", "default_optimizer"]

# The module's hyper-parameters (saved in checkpoints) hold these as dicts; allow the objects too.
torch.serialization.add_safe_globals([OptimizerStepConfig])


def _as_config(cls: type, value: Any) -> Any:
    """A config group from itself or a dict of its fields (LightningCLI and saved
    hyper-parameters give dicts)."""
    return cls(**value) if isinstance(value, dict) else value


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW at the paper's learning rate 1e-6 (betas 0.9/0.999, weight decay 0.01)."""
    return torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)


def updates_left(trainer: Any) -> float:
    """Optimizer updates before ``trainer.max_steps`` (inf when it is unset).

    A rollout step runs one update per mini-batch, and with ``on_exhausted: train_on_kept``
    their number varies; Lightning checks ``max_steps`` only between training steps, so the
    step's loop stops here itself and ``max_steps`` counts updates exactly. Every rank has the
    same ``global_step``, so all stop at the same update.
    """
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0:
        return math.inf
    return max_steps - trainer.global_step


def rollout_step_values(
    batch: RolloutBatch,
    step: StepTensors,
    version: int,
    seconds: float,
    *,
    state: PolicyState,
    parity_every: int,
    reduce: Callable[[Tensor, str], Tensor],
) -> dict[str, float]:
    """The rollout step's metrics, reduced over ranks (``reduce``); staleness and parity
    against ``version``, the policy version before this step's updates (after them every row
    would look stale); parity every ``parity_every`` rollout steps (0: never) of ``state``'s
    count."""
    check = bool(parity_every) and state.rollout_step % parity_every == 0
    acc = rollout_step_metrics(batch, version, seconds, step.trainer_logp if check else None)
    values = acc.reduce(reduce)
    gen_s = values.get("data/gen_seconds", 0.0)
    values.update(
        {
            "rollout/step": float(state.rollout_step),
            "rollout/tokens_per_second": values.pop("rollout/tokens") / max(seconds + gen_s, 1e-9),
            "time/generation_s": gen_s,
            "update/skipped_total": float(state.skipped_updates),
        }
    )
    return values


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
            optimizer update. Default: linear warm-up over ``optimizer_step.warmup_steps``
            updates, then constant (paper). :class:`~dapo_lightning.schedules.WarmupCosineLR`
            decays.
        loss: The policy loss, objective and advantage estimator
            (:class:`~dapo_lightning.loss.PolicyLossConfig`: clip ratios, aggregation, rollout
            correction, entropy and KL weights; a dict of its fields is accepted).
        batching: Mini-/micro-batches and epochs of each rollout step
            (:class:`~dapo_lightning.update.BatchingConfig`; a dict is accepted).
        optimizer_step: Gradient clipping (paper/verl 1.0), the non-finite guard and the
            default scheduler's warm-up (:class:`~dapo_lightning.update.OptimizerStepConfig`;
            a dict is accepted).
        torch_dtype: Dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``).
            Use the Trainer's ``precision`` for mixed precision.
        gradient_checkpointing: Recompute activations in backward (saves memory, costs a forward).
        parity_check_every: Every k rollout steps, compare the engine's log-probs with the
            trainer's on freshly sampled tokens (``parity/*`` metrics); 0 disables.
        sharding: FSDP2 settings (mixed precision, CPU offload), used when the trainer's
            strategy is ``ModelParallelStrategy`` (:class:`~dapo_lightning.strategy.ShardingConfig`).
        lora: Train LoRA adapters only (:class:`~dapo_lightning.lora.LoraSettings`; a dict of
            its fields is accepted); None trains every weight. Checkpoints then hold the
            adapters and their optimizer state only; the base comes from
            ``model_name_or_path``.

    Example::

        module = DAPOModule("Qwen/Qwen2.5-0.5B", loss=PolicyLossConfig(clip_ratio_high=0.28),
                            batching=BatchingConfig(mini_batch_size=32, micro_batch_size=8))
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
        loss: PolicyLossConfig = PolicyLossConfig(),  # noqa: B008 - a frozen dataclass
        batching: BatchingConfig = BatchingConfig(),  # noqa: B008 - a frozen dataclass
        optimizer_step: OptimizerStepConfig = OptimizerStepConfig(),  # noqa: B008 - frozen
        torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        gradient_checkpointing: bool = False,
        parity_check_every: int = 1,
        sharding: ShardingConfig = ShardingConfig(),  # noqa: B008 - a plain dataclass
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        #: The policy loss (the object; the hyper-parameters hold it as a dict).
        self.loss = _as_config(PolicyLossConfig, loss)
        #: How each rollout step is cut into updates and micro-batches.
        self.batching = _as_config(BatchingConfig, batching)
        #: Clipping, the non-finite guard and warm-up of each optimizer step (not named
        #: ``optimizer_step``: that is a LightningModule hook).
        self.step_config = _as_config(OptimizerStepConfig, optimizer_step)
        self.save_hyperparameters(ignore=["policy", "optimizer", "lr_scheduler"])
        self.hparams["loss"], self.hparams["batching"] = asdict(self.loss), asdict(self.batching)
        self.hparams["optimizer_step"] = asdict(self.step_config)
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
        #: The updates of each rollout step (Lightning-free); it owns the run state.
        self.updater = UpdateLoop(self.loss, self.batching, self.adapter, self.step_config)
        #: The data side (:class:`~dapo_lightning.contract.RolloutChannel`), found in ``setup``.
        self.channel: RolloutChannel | None = None
        #: Why training stopped, when the module ended it (nothing left to train on).
        self.stop_reason: str | None = None
        #: val/acc, val/pass@k, val/response_length (torchmetrics, logged per validation).
        self.val_metrics = ValidationMetrics()
        #: The copy a stop inside a rollout step restores (buffers reused from step to step).
        self.step_start = StepStart()

    @property
    def policy_state(self) -> PolicyState:
        """The run state (version, skipped updates, entropy weight, rollout steps), owned by
        the update loop; callbacks change it through its declared calls
        (:mod:`~dapo_lightning.policy_state`)."""
        return self.updater.state

    @property
    def policy_version(self) -> int:
        """Weight changes so far (the version stamped on rollouts sampled after them)."""
        return self.updater.state.version

    @property
    def rollout_step(self) -> int:
        """Rollout steps (training steps) done so far."""
        return self.updater.state.rollout_step

    @property
    def skipped_updates(self) -> int:
        """Updates skipped for a non-finite gradient norm."""
        return self.updater.state.skipped_updates

    @property
    def nonfinite_guard(self) -> NonFiniteGuard:
        """Counts non-finite updates, holds the pre-step snapshot (:mod:`~dapo_lightning.step_guard`)."""
        return self.updater.nonfinite_guard

    def configure_model(self) -> None:
        """Load the policy (with ``lora``: wrap it with adapters; and, with ``kl_coef > 0``, a
        frozen reference); where the strategy expects it (FSDP2), shard it (each decoder
        layer, then the root)."""
        hp = self.hparams
        if self.policy is None:
            self.policy = load_base_policy(hp.model_name_or_path, hp.torch_dtype, self.lora)
        if self.lora is not None and not is_peft_model(self.policy):
            self.policy = with_adapters(self.policy, self.lora, self.adapter.kind)
        self.adapter.shard_policy(self.policy, self.sharding)
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps modes as they are
        if hp.gradient_checkpointing:
            enable_gradient_checkpointing(self.policy)
        if self.loss.kl_coef > 0 and self.ref_policy is None:
            # Kept outside the module tree: it is neither trained nor checkpointed.
            object.__setattr__(self, "ref_policy", reference_policy(self.policy))

    def setup(self, stage: str) -> None:
        """Find the data side's :class:`~dapo_lightning.contract.RolloutChannel` (None for a
        data module that yields ready batches)."""
        self.channel = rollout_channel(self.trainer)

    def on_fit_start(self) -> None:
        """Check the data's declared spec against the module's settings before any rollout."""
        warn_undeclared_dapo_hooks(self.trainer)
        if self.channel is not None:
            check_data_settings(self.loss, self.batching, self.channel.rollout_spec(), self.policy)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        try:
            optimizer = self.optimizer_factory(params)
        except ValueError as err:  # torch's "Invalid learning rate: -1.0" names no config path
            raise optimizer_error(err, "model.optimizer.init_args") from err
        check_optimizer_settings(optimizer.param_groups, "model.optimizer.init_args")
        if self.lr_scheduler_factory is None:
            warmup = self.step_config.warmup_steps
            scheduler = WarmupConstantLR(optimizer, warmup_steps=warmup)
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
        model = model if model is not None else self.policy
        return batch_log_probs(model, batch, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def publish_policy(self) -> None:
        """The one call that hands the data side the weights to sample with and their version
        (:mod:`~dapo_lightning.contract` says when it is made)."""
        if self.channel is not None:
            self.channel.publish_policy(PolicyHandle(self.policy, self.policy_version))

    def on_train_start(self) -> None:
        """Bind the policy, its optimizer and scheduler to the loop (once per fit, after any
        checkpoint is restored) and publish the start handle."""
        self.updater.bind(self.policy, self.optimizers(), self.lr_schedulers(), self.ref_policy)
        self.publish_policy()

    def on_validation_start(self) -> None:  # also for `validate`, which has no train start
        self.publish_policy()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.publish_policy()  # after each rollout step's updates

    def training_step(
        self, batch: RolloutBatch | EndOfTraining, batch_idx: int
    ) -> dict[str, Tensor] | None:
        """One rollout step's updates; returns its ``advantages`` per row of ``batch`` (the
        callbacks' ``on_train_batch_end`` ``outputs``: ``SampleLog`` writes them)."""
        if isinstance(batch, EndOfTraining):
            self.stop_reason = batch.reason
            rank_zero_info(f"DAPO: stopping: {batch.reason}")
            self.trainer.should_stop = True
            return None
        t_start, version = time.perf_counter(), self.policy_version  # the version it was drawn for
        batch = batch.trim()
        step = self.updater.run(batch, self._step_context())  # counts the rollout step
        values = rollout_step_values(
            batch, step, version, time.perf_counter() - t_start, state=self.policy_state,
            parity_every=self.hparams.parity_check_every, reduce=self.adapter.reduce,
        )  # fmt: skip
        # Lightning logs self.log() values (callbacks', the validation after this step) at its
        # batch counter, which counts rollout steps: with several updates per step, put it at
        # updates done - 1, as with one (update/* are at global_step; plot's x axis is updates).
        log_rollout_step(self.trainer, values, self.global_step - 1)
        set_logging_step(self.trainer, self.global_step - 1)
        return {"advantages": step.advantages.detach().cpu()}

    def _step_context(self) -> StepContext:
        """What the loop needs of Lightning and of the data side for one rollout step."""
        channel = self.channel
        return StepContext(
            train_batch_size=channel.rollout_spec().train_batch_size if channel else None,
            updates_left=lambda: updates_left(self.trainer),
            on_update=self._on_update,
            take_step_start=self._take_step_start,
            rewind=channel.rewind_rollout_batch if channel else StepContext.rewind,
            cores=channel.core_share() if channel else None,
        )

    def _take_step_start(self) -> StepStart:
        """Copy the rollout step's start (:class:`~dapo_lightning.step_guard.StepStart`): the
        optimizer's parameters and state, and everything an update advances."""
        scheduler = self.lr_schedulers()
        stateful = [
            self.policy_state,
            GLOBAL_RNGS,
            optimizer_step_progress(self.trainer),
            *([scheduler] if scheduler is not None else []),
            *self.trainer.callbacks,
        ]
        self.step_start.take(self.optimizers(use_pl_optimizer=False), stateful)
        return self.step_start

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Lightning calls this after a GradScaler's unscale: the loop's norm, clip and checks."""
        self.updater.before_optimizer_step(optimizer)

    def _on_update(self, metrics: dict[str, float]) -> None:
        """After each update: ``update/*`` at ``global_step`` (rank 0), ``on_dapo_update``, publish."""
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(
                    {k if "/" in k else f"update/{k}": v for k, v in metrics.items()},
                    step=self.global_step,
                )
        call_dapo_hook(self.trainer, "on_dapo_update", metrics)
        self.publish_policy()

    def validation_step(self, batch: ScoredRollouts, batch_idx: int) -> None:

        metrics = self.val_metrics.update(batch, batch_idx)  # torchmetrics: synced when computed
        self.log_dict(metrics, on_epoch=True, batch_size=len(batch))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint's ``"dapo"`` entry: the :class:`~dapo_lightning.policy_state.PolicyState`
        keys and ``rng``, the global RNGs (the engine's is in the data module's entry)."""
        checkpoint["dapo"] = {**self.policy_state.state_dict(), "rng": collect_rng_states()}
        if is_peft_model(self.policy):
            keep_adapters_only(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_fits(self, checkpoint)  # another shape: one error line, not 30
        restore_adapter_checkpoint(self, checkpoint)
        state = checkpoint.get("dapo", {})
        self.policy_state.load_state_dict(state)
        if "rng" in state:
            restore_rng_states(state["rng"])

    def save_pretrained(self, path: str) -> None:
        """Write the policy in Hugging Face format (loadable with ``from_pretrained``); with
        LoRA, the merged model (``export_pretrained(..., adapter=True)`` writes the adapters)."""
        policy = merged_model(self.policy) if is_peft_model(self.policy) else self.policy
        policy.save_pretrained(path)
