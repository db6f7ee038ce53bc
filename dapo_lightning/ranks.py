"""Reductions over data-parallel ranks: the one helper every part of the library uses.

:func:`reduce_over_ranks` goes through the Lightning strategy when one is given (its
``reduce``: the strategy knows its process group and device) and through
``torch.distributed`` when only a process group is up (the rollout producer without a
trainer); without either it is the identity. :func:`sum_over_ranks` is the same for a list of
integer flags (the producer's lockstep flags), :func:`gather_objects` collects one picklable
object per rank (the data module's per-rank state).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RankOp", "gather_objects", "reduce_over_ranks", "sum_over_group", "sum_over_ranks"]

RankOp = Literal["sum", "max", "min"]


def _process_group_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reduce_over_ranks(tensor: Tensor, op: RankOp = "sum", strategy: Any = None) -> Tensor:
    """``op`` of ``tensor`` over ranks, as a new tensor on ``tensor``'s device.

    Args:
        tensor: This rank's values (any shape; every rank passes the same shape).
        op: ``"sum"``, ``"max"`` or ``"min"``.
        strategy: A Lightning strategy (``trainer.strategy``); None uses the default
            ``torch.distributed`` process group when one is initialised.

    Example::

        tokens = reduce_over_ranks(torch.tensor([n_tokens]), "sum", trainer.strategy)
    """
    if op not in ("sum", "max", "min"):
        raise ValueError(f"reduce_over_ranks: op must be 'sum', 'max' or 'min', got {op!r}.")
    if strategy is not None:
        # Lightning's single-device strategies have no world_size (Trainer.world_size reads it so)
        if getattr(strategy, "world_size", 1) == 1:
            return tensor.clone()
        out = strategy.reduce(tensor.to(strategy.root_device).clone(), reduce_op=op)
        return out.to(tensor.device)
    if _process_group_world() == 1:
        return tensor.clone()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    out = tensor.to(device).clone()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, op.upper()))
    return out.to(tensor.device)


def sum_over_ranks(flags: list[int], strategy: Any = None) -> list[int]:
    """Integer ``flags`` summed over ranks (:func:`reduce_over_ranks`)."""
    return reduce_over_ranks(torch.tensor(flags, dtype=torch.long), "sum", strategy).tolist()


def sum_over_group(flags: list[int], group: Any) -> list[int]:
    """Integer ``flags`` summed over the ranks of the process group ``group`` (a gloo group:
    the tensors stay on the CPU)."""
    out = torch.tensor(flags, dtype=torch.long)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    world = _process_group_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out
