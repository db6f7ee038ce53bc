"""What the DAPO update asks of the trainer's strategy, answered once per strategy.

The update loop (docs/design.md, "One training step, as data") needs five things from the
distributed set-up: a sum / max / min over ranks, rank agreement on a decision, a backward
that syncs gradients only on the last micro-batch where the strategy allows it, a gradient
norm (and clipping) over however the parameters are laid out, and the factor that undoes the
strategy's gradient averaging. :class:`StrategyAdapter` answers them for:

=================  =======================================  ===============================
strategy           backward of micro-batch k of K          gradient norm / clip
=================  =======================================  ===============================
single device      ``manual_backward``                      ``clip_grad_norm_``
DDP                no sync until k = K (``no_sync``)        ``clip_grad_norm_``
FSDP2 (Lightning   syncs every micro-batch (reduce-         ``clip_grad_norm_`` on DTensors,
ModelParallel)     scatter keeps gradients sharded)         ``full_tensor()`` of the norm
FSDP1              syncs every micro-batch                  ``FSDP.clip_grad_norm_``
DeepSpeed          engine backward, accumulation boundary   inside ``engine.step()``
                   at k = K, ``scale_wrt_gas=False``        (config ``gradient_clipping``)
=================  =======================================  ===============================

Every multi-rank strategy *averages* gradients over the data-parallel ranks while the loss of
a micro-batch is its share of a global *sum*, so the module multiplies each loss by
:attr:`StrategyAdapter.grad_average_factor` before backward. With ``16-mixed`` the gradient
norm is taken in the module's ``on_before_optimizer_step``, which Lightning calls after the
GradScaler unscaled the gradients, so clipping sees true gradients.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from torch import Tensor
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from dapo_lightning.lightning_internals import attached_trainer
from dapo_lightning.ranks import reduce_over_ranks
from dapo_lightning.weights import is_sharded

StrategyKind = Literal["single", "ddp", "fsdp1", "fsdp2", "deepspeed"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ShardingConfig:
    """How the policy is sharded with FSDP2 (``fully_shard``) under Lightning's
    ``ModelParallelStrategy``: each decoder layer is one unit, the root (embeddings, final
    norm, LM head) another.

    Args:
        param_dtype: Dtype parameters are all-gathered in and compute runs in (FSDP2 mixed
            precision; the sharded master weights keep their dtype); None: no cast.
        reduce_dtype: Dtype of the gradient reduce-scatter; None: ``param_dtype``.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``; the optimizer steps on the CPU).
        reshard_after_forward: Free gathered parameters after each layer's forward (less
            memory, one more all-gather in backward).
    """

    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True


# The module's hyper-parameters (saved in checkpoints) hold it: allow it in weights_only loads.
torch.serialization.add_safe_globals([ShardingConfig])


def decoder_layers(policy: torch.nn.Module) -> list[torch.nn.Module]:
    """The policy's repeated blocks: modules whose class is in HF's ``_no_split_modules``.

    Raises:
        ValueError: the model names no such class, or none is found.
    """
    names = set(getattr(policy, "_no_split_modules", None) or [])
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(policy).__name__} to shard (no module of "
            f"a class in _no_split_modules={sorted(names)}): shard the policy yourself in a "
            "DAPOModule subclass's configure_model."
        )
    return layers


def shard_policy(policy: torch.nn.Module, device_mesh: Any, config: ShardingConfig) -> None:
    """``fully_shard`` every decoder layer, then the root, over the data-parallel dimension of
    ``device_mesh`` (Lightning's ``ModelParallelStrategy`` mesh, or a 1-D mesh).

    Raises:
        ValueError: the mesh has a tensor-parallel dimension larger than 1.
    """
    names = device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "ModelParallelStrategy(tensor_parallel_size > 1): the DAPO update shards the "
            "policy over data-parallel ranks only (FSDP2). Fix: tensor_parallel_size=1; "
            "tensor parallelism belongs to the vLLM engine (engine_kwargs)."
        )
    mesh = device_mesh["data_parallel"] if "data_parallel" in names else device_mesh

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
    if config.param_dtype is not None or config.reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dtypes.get(config.param_dtype),
            reduce_dtype=dtypes.get(config.reduce_dtype or config.param_dtype),
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(policy):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)


def strategy_kind(strategy: Strategy | None) -> StrategyKind:
    """Which row of the module docstring's table ``strategy`` is."""
    if isinstance(strategy, DeepSpeedStrategy):  # a DDPStrategy subclass: test it first
        return "deepspeed"
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp1"
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    return "single"


def deepspeed_backward(engine: Any, loss: Tensor, last: bool) -> None:
    """Backward of one micro-batch through a DeepSpeed engine.

    The loss is already this micro-batch's share of the global token-mean, so DeepSpeed must
    neither divide it by its accumulation steps (``scale_wrt_gas=False``) nor reduce / step
    before the last micro-batch (the boundary is set explicitly: the number of micro-batches
    varies with the token budget).
    """
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss, scale_wrt_gas=False)


def grad_norm(parameters: Iterable[Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients of ``parameters``, clipped to ``max_norm`` when set.

    ``total = sqrt(sum_p ||g_p||^2)``; with ``max_norm``, every gradient is scaled by
    ``min(1, max_norm / (total + 1e-6))``. DTensor (FSDP2) gradients give a DTensor norm,
    which is gathered. Returns ``total`` before clipping (``inf`` / ``nan`` when not finite).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm else math.inf, error_if_nonfinite=False, foreach=None
    )
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


class StrategyAdapter:
    """The update loop's view of ``module.trainer.strategy`` (see the module docstring): what
    differs between strategies is answered here, as capabilities, never by the caller testing
    :attr:`kind`.

    Args:
        module: The LightningModule whose trainer's strategy is adapted; None (or a module not
            attached to a trainer): one process, plain ``backward`` and ``optimizer.step``.
    """

    def __init__(self, module: LightningModule | None) -> None:
        self.module = module

    @property
    def trainer(self) -> Any:
        """The trainer the module is attached to; None without one."""
        return attached_trainer(self.module) if self.module is not None else None

    @property
    def strategy(self) -> Strategy | None:
        return self.trainer.strategy if self.trainer is not None else None

    @property
    def kind(self) -> StrategyKind:
        return strategy_kind(self.strategy)

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (the ranks that see different data)."""
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def grad_average_factor(self) -> float:
        """What each micro-batch loss is multiplied by to undo the ranks' gradient averaging."""
        return float(self.world_size)

    @property
    def steps_in_engine(self) -> bool:
        """True when the strategy clips and steps inside its own engine (DeepSpeed): the norm is
        known only after the step, and a step cannot be snapshot or undone from outside."""
        return self.kind == "deepspeed"

    def shard_policy(self, policy: torch.nn.Module, sharding: ShardingConfig) -> None:
        """Shard ``policy`` in place where the strategy expects the module to do it (FSDP2:
        :func:`shard_policy` over the module's device mesh); no-op elsewhere or when sharded."""
        if self.kind == "fsdp2" and not is_sharded(policy):
            shard_policy(policy, self.module.device_mesh, sharding)

    def reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """``op`` (``"sum"``, ``"max"``, ``"min"``) of ``tensor`` over ranks (a new tensor)."""
        if self.world_size == 1:
            return tensor.clone()
        return reduce_over_ranks(tensor, op, self.strategy)

    def any_rank(self, decision: bool) -> bool:
        """True when ``decision`` is True on any rank."""
        return self.any_ranks([decision])[0]

    def any_ranks(self, decisions: list[bool]) -> list[bool]:
        """Each of ``decisions`` True when it is True on any rank (one collective for all)."""
        flags = torch.tensor([float(d) for d in decisions], dtype=torch.float64)
        return [bool(x) for x in self.reduce(flags, "max").tolist()]

    def backward(self, loss: Tensor, last: bool) -> None:
        """Backward of one micro-batch; gradients sync on the ``last`` one where allowed."""
        if self.trainer is None:
            loss.backward()
            return
        kind = self.kind
        if kind == "deepspeed":
            deepspeed_backward(self.strategy.deepspeed_engine, loss, last)
            return
        no_sync = kind == "ddp" and not last and self.world_size > 1
        with self.strategy.block_backward_sync() if no_sync else contextlib.nullcontext():
            self.module.manual_backward(loss)

    def optimizer_step(self, optimizer: Any, before_step: Callable[[Any], None]) -> None:
        """One optimizer step with ``before_step(optimizer)`` (norm, clip, checks) right before
        it. Under a trainer, Lightning's optimizer runs the precision plugin, which unscales the
        gradients and calls the module's ``on_before_optimizer_step``; the module calls
        ``before_step`` there. Without one, this calls it, then steps."""
        if self.trainer is None:
            before_step(optimizer)
        optimizer.step()

    def clip_grad_norm(self, parameters: Iterable[Tensor], max_norm: float | None) -> float:
        """Gradient norm of ``parameters`` before clipping, clipped to ``max_norm`` (None or 0:
        no clipping).

        DeepSpeed clips inside ``engine.step()``; its norm is read after the step
        (:meth:`grad_norm_after_step`) and this returns ``nan`` (not finite means "not known").
        """
        kind = self.kind
        if kind == "deepspeed":
            return math.nan
        if kind == "fsdp1":
            wrapped = self.strategy.model
            return float(wrapped.clip_grad_norm_(max_norm if max_norm else math.inf))
        return grad_norm(parameters, max_norm)

    def grad_norm_after_step(self) -> float | None:
        """The norm of the last step where the strategy takes it inside the step (DeepSpeed);
        None elsewhere (:meth:`clip_grad_norm` gave it before the step)."""
        if not self.steps_in_engine:
            return None
        norm = self.strategy.deepspeed_engine.get_global_grad_norm()
        return math.nan if norm is None else float(norm)
