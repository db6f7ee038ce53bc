"""DAPOModule: the DAPO policy update as a LightningModule with manual optimization.

One ``training_step`` consumes one :class:`~dapo_lightning.data.batch.RolloutBatch` (a rollout
step) and performs ``ppo_epochs * updates_per_epoch`` optimizer updates on it::

    advantages (group-relative) -> old log-probs (no grad)
    for each epoch, for each mini-batch of ``mini_batch_size`` prompts:
        N = all_reduce(response tokens of the mini-batch, over ranks)
        for each micro-batch: loss = sum(token losses) * world_size / N ; backward
            (no gradient sync until the last micro-batch)
        clip grad norm -> optimizer.step -> lr_scheduler.step -> zero_grad

so the gradient of an update is exactly that of the token-mean loss over the whole mini-batch,
however it is split over micro-batches and ranks (DESIGN.md invariant 1).

Steps and logging: Lightning's ``global_step`` counts *optimizer updates*. With the paper's setting
(512 prompts per rollout step, mini-batches of 32) that is 16 updates per rollout step, so
``trainer.max_steps = rollout_steps * train_batch_size / mini_batch_size * ppo_epochs``. The module
keeps ``rollout_step`` (training steps done) beside it. Per-update metrics (``update/*``) are written
to the loggers at ``step = global_step`` after each update; per-rollout-step metrics (``rollout/*``,
``time/*``, ``data/*``, ``parity/*``) are logged once per ``training_step`` with ``self.log``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from dapo_lightning.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.loss import LOSS_AGG_MODES, compute_policy_loss
from dapo_lightning.schedules import WarmupConstantLR

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW at the paper's learning rate 1e-6 (betas 0.9/0.999, weight decay 0.01)."""
    return torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)


def split_groups(num_groups: int, groups_per_chunk: int) -> list[range]:
    """Consecutive ranges of group ids of size ``groups_per_chunk`` covering ``num_groups``."""
    return [
        range(i, min(i + groups_per_chunk, num_groups))
        for i in range(0, num_groups, groups_per_chunk)
    ]


def micro_batch_rows(
    lengths: Tensor, max_rows: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Split row indices into micro-batches of at most ``max_rows`` rows and, when
    ``max_tokens`` is set, at most ``max_tokens`` padded tokens (rows x longest row).

    Rows are first sorted by length so each micro-batch pads little; a single row longer
    than ``max_tokens`` gets a micro-batch of its own.
    """
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
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


def deepspeed_backward(engine: Any, loss: Tensor, last: bool) -> None:
    """Backward of one micro-batch through a DeepSpeed engine.

    The loss is already this micro-batch's share of the global token-mean, so DeepSpeed must
    neither divide it by its accumulation steps (``scale_wrt_gas=False``) nor reduce / step
    before the last micro-batch (the accumulation boundary is set explicitly, since the
    number of micro-batches varies with the token budget).
    """
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss, scale_wrt_gas=False)


class DAPOModule(LightningModule):
    """The DAPO policy update (Yu et al. 2025) with exact token-level gradient accumulation.

    Args:
        model_name_or_path: Hugging Face model id or local folder of the policy; weights are loaded
            in ``configure_model`` (``trust_remote_code`` is never enabled).
        policy: An already built causal LM to train instead of loading ``model_name_or_path``.
        optimizer: Callable building the optimizer from the parameters (LightningCLI: ``class_path``
            + ``init_args``). Default AdamW, lr 1e-6 (paper).
        lr_scheduler: Callable building the LR scheduler from the optimizer; stepped once per
            optimizer update. Default: linear warm-up over ``warmup_steps`` updates, then constant
            (paper). :class:`~dapo_lightning.schedules.WarmupCosineLR` gives cosine decay.
        warmup_steps: Warm-up length of the default scheduler, in optimizer updates.
        clip_ratio_low: epsilon_low of clip-higher (paper 0.2).
        clip_ratio_high: epsilon_high of clip-higher (paper 0.28; 0.2 is symmetric PPO/GRPO).
        clip_ratio_c: Dual-clip constant c > 1 capping the loss of negative-advantage tokens; None off.
        loss_agg_mode: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO), ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` (Dr. GRPO).
        advantage_estimator: ``grpo``, ``reinforce_baseline``, ``rloo`` or ``dr_grpo``.
        mini_batch_size: Prompts (groups) per optimizer update, over all ranks. None: the whole
            rollout batch in one update (then old log-probs need no extra forward).
        micro_batch_size: Sequences per forward/backward on one rank.
        max_tokens_per_micro_batch: Optional cap on padded tokens per micro-batch (rows are sorted
            by length and packed greedily under it).
        ppo_epochs: Passes over each rollout batch.
        gradient_clip_val: Max global gradient norm (paper/verl 1.0); None or 0 disables clipping.
        entropy_coef: Weight of the entropy bonus (``EntropyScheduler`` sets it); 0 in the paper.
        kl_coef: Weight of the k3 KL penalty to the initial policy; 0 (paper) loads no reference model.
        temperature: Sampling temperature of the rollouts; log-probs are taken at the same temperature.
        max_response_length: Max response tokens; needed by ``seq-mean-token-sum-norm``.
        tis_cap: Cap of the truncated importance-sampling weight ``min(pi_old / pi_rollout, cap)``
            correcting engine/trainer mismatch and stale groups; None disables it.
        torch_dtype: Dtype the policy is loaded in (``float32``, ``bfloat16``, ``float16``). Use
            the Trainer's ``precision`` for mixed precision.
        gradient_checkpointing: Recompute activations in backward (saves memory, costs a forward).
        parity_check_every: Every k rollout steps, compare the engine's log-probs with the trainer's
            on freshly sampled tokens (``parity/*`` metrics); 0 disables.
        skip_nonfinite: Skip an update whose loss or gradient norm is not finite (counted in
            ``update/skipped``) instead of corrupting the weights.

    Example::

        module = DAPOModule("Qwen/Qwen2.5-0.5B", mini_batch_size=32, micro_batch_size=8)
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
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.28,
        clip_ratio_c: float | None = None,
        loss_agg_mode: Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ] = "token-mean",
        advantage_estimator: Literal["grpo", "reinforce_baseline", "rloo", "dr_grpo"] = "grpo",
        mini_batch_size: int | None = None,
        micro_batch_size: int = 8,
        max_tokens_per_micro_batch: int | None = None,
        ppo_epochs: int = 1,
        gradient_clip_val: float | None = 1.0,
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        temperature: float = 1.0,
        max_response_length: int | None = None,
        tis_cap: float | None = None,
        torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        gradient_checkpointing: bool = False,
        parity_check_every: int = 1,
        skip_nonfinite: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["policy", "optimizer", "lr_scheduler"])
        if model_name_or_path is None and policy is None:
            raise ValueError(
                "DAPOModule needs a policy: set `model_name_or_path` (a Hugging Face id or folder) "
                "or pass `policy=` a causal LM."
            )
        if not 0.0 <= clip_ratio_low < 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}.")
        if clip_ratio_high < clip_ratio_low:
            raise ValueError(
                f"clip_ratio_high ({clip_ratio_high}) < clip_ratio_low ({clip_ratio_low}): "
                "clip-higher needs eps_high >= eps_low (paper: 0.28 and 0.2)."
            )
        if clip_ratio_c is not None and clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or null to disable), got {clip_ratio_c}.")
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}."
            )
        if advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, "
                f"got {advantage_estimator!r}."
            )
        if loss_agg_mode == "seq-mean-token-sum-norm" and not max_response_length:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs `max_response_length` "
                "(link it from data.max_response_length)."
            )
        for name, value in (("micro_batch_size", micro_batch_size), ("ppo_epochs", ppo_epochs)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if mini_batch_size is not None and mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1 (or null), got {mini_batch_size}.")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or null to disable), got {tis_cap}.")
        self.automatic_optimization = False
        self.policy: nn.Module | None = policy
        self.ref_policy: nn.Module | None = None
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        #: Weight of the entropy bonus; callbacks (EntropyScheduler) change it between updates.
        self.entropy_coef = entropy_coef
        #: Optimizer updates applied so far (the version stamped on rollouts sampled after them).
        self.policy_version = 0
        #: Rollout steps (training steps) done so far.
        self.rollout_step = 0
        #: Updates skipped for a non-finite loss or gradient norm.
        self.skipped_updates = 0

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the policy (and, with ``kl_coef > 0``, a frozen reference copy)."""
        if self.policy is None:
            from transformers import AutoModelForCausalLM

            try:
                self.policy = AutoModelForCausalLM.from_pretrained(
                    self.hparams.model_name_or_path,
                    dtype=_DTYPES[self.hparams.torch_dtype],
                    trust_remote_code=False,
                )
            except OSError as err:
                raise FileNotFoundError(
                    f"model.model_name_or_path={self.hparams.model_name_or_path!r} could not be "
                    f"loaded ({err}). Give an existing folder written by save_pretrained or a hub id "
                    "(with network access)."
                ) from err
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps modes as they are
        if self.hparams.gradient_checkpointing and hasattr(
            self.policy, "gradient_checkpointing_enable"
        ):
            self.policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            if hasattr(self.policy, "config"):
                self.policy.config.use_cache = False
        if self.hparams.kl_coef > 0 and self.ref_policy is None:
            import copy

            ref = copy.deepcopy(self.policy).eval()
            ref.requires_grad_(False)
            # Kept outside the module tree: it is neither trained nor checkpointed.
            object.__setattr__(self, "ref_policy", ref)

    def on_fit_start(self) -> None:
        """Check the data settings against the model's before any rollout is generated."""
        self.check_data_compatible(getattr(self.trainer, "datamodule", None))

    def check_data_compatible(self, data: Any) -> None:
        """Raise a clear error for data settings this module cannot train on (up front, so no
        generation is wasted). ``data`` is read duck-typed: ``n``, ``train_batch_size``,
        ``max_prompt_length``, ``max_response_length`` where present."""
        if data is None:
            return
        hp = self.hparams
        n = getattr(data, "n", None)
        if n is not None and n < 2 and hp.advantage_estimator in ("grpo", "rloo"):
            raise ValueError(
                f"data.n={n} with model.advantage_estimator={hp.advantage_estimator!r}: a group of "
                "one response has no std / no other responses to compare with. Fix: set data.n "
                ">= 2 (paper 16), or advantage_estimator 'dr_grpo' / 'reinforce_baseline'."
            )
        batch = getattr(data, "train_batch_size", None)
        mini = hp.mini_batch_size
        if isinstance(batch, int) and mini is not None and batch % mini:
            raise ValueError(
                f"model.mini_batch_size={mini} does not divide data.train_batch_size={batch} "
                "(prompts per rollout step): fix: choose a divisor of train_batch_size, or null "
                "for one update per rollout step."
            )
        prompt_len = getattr(data, "max_prompt_length", None)
        response_len = getattr(data, "max_response_length", None)
        context = getattr(getattr(self.policy, "config", None), "max_position_embeddings", None)
        if (
            isinstance(context, int)
            and isinstance(prompt_len, int)
            and isinstance(response_len, int)
            and prompt_len + response_len > context
        ):
            raise ValueError(
                f"data.max_prompt_length={prompt_len} + data.max_response_length={response_len} "
                f"= {prompt_len + response_len} tokens exceeds the model's context "
                f"(max_position_embeddings={context}). Fix: lower max_prompt_length or "
                "max_response_length so that their sum fits the context."
            )

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
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
        """``[B, T]`` log-probabilities (and entropies) of ``batch``'s response tokens."""
        return response_log_probs(
            model if model is not None else self.policy,
            batch.input_ids,
            batch.attention_mask,
            batch.response_width,
            temperature=self.hparams.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    # ------------------------------------------------------------------ helpers
    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def _all_reduce_sum(self, value: Tensor) -> Tensor:
        if self.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value.clone(), reduce_op="sum")

    def _all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1 or not values:
            return values
        keys = sorted(values)
        stacked = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        stacked = self.trainer.strategy.reduce(stacked, reduce_op="mean")
        return dict(zip(keys, stacked.tolist()))

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on every micro-batch but the last one.

        FSDP synchronises every micro-batch (its ``no_sync`` would keep unsharded gradients,
        defeating the sharding; the sum is exact either way). DeepSpeed is told where the
        accumulation boundary is in :meth:`_backward`.
        """
        strategy = self.trainer.strategy
        if last or self.world_size == 1 or not hasattr(strategy, "block_backward_sync"):
            return contextlib.nullcontext()
        if type(strategy).__name__.startswith("FSDP"):
            return contextlib.nullcontext()
        return strategy.block_backward_sync()

    def _deepspeed_engine(self) -> Any:
        strategy = self.trainer.strategy
        return (
            getattr(strategy, "deepspeed_engine", None)
            if "DeepSpeed" in type(strategy).__name__
            else None
        )

    def _backward(self, loss: Tensor, last: bool) -> None:
        engine = self._deepspeed_engine()
        if engine is not None:
            deepspeed_backward(engine, loss, last)
            return
        with self._no_sync(last):
            self.manual_backward(loss)

    def _clip_grad_norm(self) -> Tensor:
        max_norm = self.hparams.gradient_clip_val or float("inf")
        engine = self._deepspeed_engine()
        if engine is not None:  # DeepSpeed clips inside step() (config: gradient_clipping)
            norm = engine.get_global_grad_norm()
            return torch.tensor(float("nan") if norm is None else float(norm))
        wrapped = self.trainer.strategy.model
        if hasattr(wrapped, "clip_grad_norm_") and type(wrapped).__name__.startswith(
            "FullyShardedDataParallel"
        ):
            return wrapped.clip_grad_norm_(max_norm).detach().float().cpu()
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
        return norm.detach().float().cpu()

    def _call_update_hooks(self, metrics: dict[str, float]) -> None:
        for callback in self.trainer.callbacks:
            hook = getattr(callback, "on_dapo_update", None)
            if hook is not None:
                hook(self.trainer, self, metrics)

    def _log_update(self, metrics: dict[str, float]) -> None:
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(
                    {f"update/{k}": v for k, v in metrics.items()}, step=self.global_step
                )

    # ------------------------------------------------------------------ the DAPO step
    def updates_per_epoch(self, num_local_groups: int) -> list[range]:
        """Mini-batches (as ranges of local group ids) of one epoch over the rollout batch."""
        mini = self.hparams.mini_batch_size
        if mini is None:
            return [range(num_local_groups)]
        world = self.world_size
        if mini % world:
            raise ValueError(
                f"model.mini_batch_size={mini} prompts must be divisible by the world size "
                f"({world}): each rank takes mini_batch_size / world_size prompts per update."
            )
        local = mini // world
        if num_local_groups % local:
            raise ValueError(
                f"model.mini_batch_size={mini} does not divide the rollout batch "
                f"({num_local_groups * world} prompts): choose a divisor of data.train_batch_size."
            )
        return split_groups(num_local_groups, local)

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        t_start = time.perf_counter()
        batch = batch.trim()
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        advantages = compute_advantages(
            batch.reward, batch.group_index, self.hparams.advantage_estimator
        ).to(self.device)
        mini_batches = self.updates_per_epoch(batch.num_groups)
        single_update = len(mini_batches) == 1 and self.hparams.ppo_epochs == 1
        # With one update per rollout batch the old policy *is* the current one: the old
        # log-probs are the detached log-probs of the update's own forward (no extra pass).
        old_log_probs = None if single_update else self._old_log_probs(batch)
        parity_logp = torch.zeros_like(batch.rollout_log_probs)

        for _ in range(self.hparams.ppo_epochs):
            for groups in mini_batches:
                rows = torch.cat(
                    [(batch.group_index == g).nonzero().flatten() for g in groups]
                ).tolist()
                metrics = self._update(
                    batch, rows, advantages, old_log_probs, parity_logp, optimizer, scheduler
                )
                self.policy_version += 1
                self._log_update(metrics)
                self._call_update_hooks(metrics)

        if old_log_probs is not None:
            parity_logp = old_log_probs
        self.rollout_step += 1
        self._log_rollout_step(batch, parity_logp, time.perf_counter() - t_start)

    @torch.no_grad()
    def _old_log_probs(self, batch: RolloutBatch) -> Tensor:
        out = torch.zeros_like(batch.rollout_log_probs)
        lengths = batch.attention_mask.sum(-1)
        for rows in micro_batch_rows(
            lengths, self.hparams.micro_batch_size, self.hparams.max_tokens_per_micro_batch
        ):
            micro = batch.select(rows).trim()
            logp, _ = self.forward_log_probs(micro)
            out[rows, : micro.response_width] = logp
        return out

    def _update(
        self,
        batch: RolloutBatch,
        rows: list[int],
        advantages: Tensor,
        old_log_probs: Tensor | None,
        parity_logp: Tensor,
        optimizer: Any,
        scheduler: Any,
    ) -> dict[str, float]:
        """One optimizer update on the mini-batch ``rows`` of ``batch`` (this rank's share)."""
        hp = self.hparams
        mask = batch.response_mask[rows]
        world = self.world_size
        local_counts = torch.tensor(
            [mask.sum().item(), (mask.sum(-1) > 0).sum().item(), float(len(rows))],
            dtype=torch.float64,
            device=self.device,
        )
        global_tokens, global_seqs, global_rows = self._all_reduce_sum(local_counts).tolist()
        if hp.loss_agg_mode == "seq-mean-token-sum-norm":
            global_seqs = global_rows  # Dr. GRPO divides by a constant: every row counts
        want_entropy = self.entropy_coef != 0
        sums: dict[str, float] = {}
        total_loss = 0.0
        micro_rows = micro_batch_rows(
            batch.attention_mask[rows].sum(-1), hp.micro_batch_size, hp.max_tokens_per_micro_batch
        )
        for i, local in enumerate(micro_rows):
            idx = [rows[j] for j in local]
            micro = batch.select(idx).trim()
            width = micro.response_width
            logp, entropy = self.forward_log_probs(
                micro, with_entropy=True, entropy_grad=want_entropy
            )
            old = logp.detach() if old_log_probs is None else old_log_probs[idx, :width]
            if old_log_probs is None:
                parity_logp[idx, :width] = old
            ref_logp = None
            if hp.kl_coef > 0 and self.ref_policy is not None:
                with torch.no_grad():
                    ref_logp, _ = self.forward_log_probs(micro, model=self.ref_policy)
            loss, m = compute_policy_loss(
                logp,
                old,
                advantages[idx],
                micro.response_mask,
                clip_ratio_low=hp.clip_ratio_low,
                clip_ratio_high=hp.clip_ratio_high,
                clip_ratio_c=hp.clip_ratio_c,
                loss_agg_mode=hp.loss_agg_mode,
                global_token_count=max(global_tokens, 1.0),
                global_seq_count=max(global_seqs, 1.0),
                max_response_length=hp.max_response_length,
                rollout_log_probs=micro.rollout_log_probs if hp.tis_cap else None,
                tis_cap=hp.tis_cap,
                entropy=entropy,
                entropy_coef=self.entropy_coef,
                ref_log_probs=ref_logp,
                kl_coef=hp.kl_coef,
            )
            # DDP averages gradients over ranks; the loss is a share of a global sum.
            self._backward(loss * world, last=i == len(micro_rows) - 1)
            total_loss += float(loss.detach())
            tokens = float(micro.response_mask.sum())
            for key, value in m.items():
                if key.endswith("_max") or key.endswith("_min"):
                    prev = sums.get(key)
                    op = max if key.endswith("_max") else min
                    sums[key] = float(value) if prev is None else op(prev, float(value))
                elif key != "token_count":
                    sums[key] = sums.get(key, 0.0) + float(value) * tokens
            sums["_tokens"] = sums.get("_tokens", 0.0) + tokens

        grad_norm = self._clip_grad_norm()
        loss_total = self._all_reduce_sum(torch.tensor(total_loss, device=self.device)).item()
        finite = math.isfinite(loss_total) and bool(torch.isfinite(grad_norm).all())
        skipped = hp.skip_nonfinite and not finite
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this update uses
        if skipped:
            self.skipped_updates += 1
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        tokens = sums.pop("_tokens", 0.0)
        metrics = {
            k: (v if k.endswith(("_max", "_min")) else v / max(tokens, 1.0))
            for k, v in sums.items()
        }
        metrics = self._all_reduce_mean(metrics)
        metrics.update(
            loss=loss_total,
            grad_norm=float(grad_norm),
            lr=lr,
            entropy_coef=float(self.entropy_coef),
            tokens=float(global_tokens),
            skipped_nonfinite=float(skipped),
            update=float(self.policy_version + 1),
        )
        metrics.setdefault("kl_k3", metrics.get("approx_kl_k3", 0.0))
        return metrics

    def _log_rollout_step(self, batch: RolloutBatch, trainer_logp: Tensor, seconds: float) -> None:
        fresh = batch.sample_version == batch.policy_version
        lengths = batch.response_length.float()
        tokens = float(lengths.sum())
        gen_seconds = float(batch.stats.get("gen_seconds", 0.0))
        values = {
            "rollout/step": float(self.rollout_step),
            "rollout/reward_mean": float(batch.reward.mean()),
            "rollout/score_mean": float(batch.score.mean()),
            "rollout/acc": float(batch.acc.mean()),
            "rollout/response_length_mean": float(lengths.mean()),
            "rollout/truncation_rate": float(batch.truncated.float().mean()),
            "rollout/tokens_per_second": tokens / max(seconds + gen_seconds, 1e-9),
            "time/update_s": seconds,
            "time/generation_s": gen_seconds,
            "update/skipped_total": float(self.skipped_updates),
        }
        for key, value in batch.stats.items():
            values[f"data/{key}"] = float(value)
        every = self.hparams.parity_check_every
        if every and self.rollout_step % every == 0 and bool(fresh.any()):
            from dapo_lightning.rollout.parity import logprob_parity

            mask = batch.response_mask * fresh[:, None].float()
            for key, value in logprob_parity(trainer_logp, batch.rollout_log_probs, mask).items():
                values[key] = float(value)
        self.log_dict(
            values, on_step=True, on_epoch=False, sync_dist=True, batch_size=batch.batch_size
        )
        self.log(
            "rollout/response_length_max",
            float(lengths.max()),
            on_step=True,
            on_epoch=False,
            sync_dist=True,
            reduce_fx="max",
            batch_size=batch.batch_size,
        )

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: ScoredRollouts, batch_idx: int) -> None:
        from dapo_lightning.data import validation_metrics

        metrics = validation_metrics(batch)
        self.log_dict(metrics, on_epoch=True, sync_dist=True, batch_size=len(batch))

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from dapo_lightning.checkpoint import collect_rng_states

        checkpoint["dapo"] = {
            "policy_version": self.policy_version,
            "rollout_step": self.rollout_step,
            "skipped_updates": self.skipped_updates,
            "entropy_coef": self.entropy_coef,
            "rng": collect_rng_states(),  # global RNGs (the engine's is in the data module)
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dapo", {})
        self.policy_version = int(state.get("policy_version", 0))
        self.rollout_step = int(state.get("rollout_step", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.entropy_coef = float(state.get("entropy_coef", self.entropy_coef))
        if "rng" in state:
            from dapo_lightning.checkpoint import restore_rng_states

            restore_rng_states(state["rng"])

    def named_checkpoint_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors under checkpoint (``save_pretrained``) names, tied weights
        included: what a rollout engine must receive (see DESIGN.md's tied-embedding trap)."""
        yield from self.policy.state_dict().items()

    def save_pretrained(self, path: str) -> None:
        """Write the policy in Hugging Face format (loadable with ``from_pretrained``)."""
        self.policy.save_pretrained(path)
