"""Reductions over data-parallel ranks: the one helper every part of the library uses.

:func:`reduce_over_ranks` goes through the Lightning strategy when one is given (its
``reduce``: the strategy knows its process group and device) and through
``torch.distributed`` when only a process group is up (the rollout producer without a
trainer); without either it is the identity. :func:`sum_over_ranks` is the same for a list of
integer flags (the producer's lockstep flags), :func:`gather_objects` collects one picklable
object per rank (the data module's per-rank state).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "RankOp",
    "gather_objects",
    "lost_rank",
    "lost_rank_message",
    "reduce_over_ranks",
    "sum_over_group",
    "sum_over_ranks",
]

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


#: What gloo / NCCL say when the process at the other end of a collective is gone.
LOST_PEER_PHRASES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
)


def lost_rank(
    error: BaseException, rank: int | None = None, world: int | None = None
) -> str | None:
    """``"rank R lost rank S of 2"`` for a collective that failed because another rank's process
    is gone (killed, crashed, out of memory): with 2 ranks it names the other one, else the
    peer's address from the error. None for any other error. ``rank`` / ``world`` default to
    this process's in the default process group."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(p in text for p in LOST_PEER_PHRASES):
        return None
    if rank is None and _process_group_world() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2 and rank is not None:
        who = f"rank {1 - rank} of 2"
    else:
        peer = re.search(r"\[([^\]]+)\]:(\d+)", text)
        who = f"the rank at {peer.group(1)}:{peer.group(2)}" if peer else "another rank"
    return f"{f'rank {rank}' if rank is not None else 'this rank'} lost {who}"


def lost_rank_message(error: BaseException) -> str | None:
    """:func:`lost_rank` with what happened and what to do, as one line (None: another error)."""
    lost = lost_rank(error)
    if lost is None:
        return None
    return (
        f"{lost}: its connection closed in a collective (the process died, was killed or ran "
        "out of memory), so this rank stopped too. Resume with --ckpt_path auto from the last "
        "checkpoint."
    )
