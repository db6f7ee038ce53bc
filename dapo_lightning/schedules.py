"""Learning-rate schedules stepped once per optimizer update."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_constant_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier: ``(step + 1) / warmup_steps`` during warm-up, then 1 (the paper's schedule)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up, then ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2``
    with ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1]."""
    if step < warmup_steps:
        return warmup_constant_factor(step, warmup_steps)
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupConstantLR(LambdaLR):
    """Linear warm-up over ``warmup_steps`` optimizer updates, then constant.

    Args:
        optimizer: The wrapped optimizer.
        warmup_steps: Optimizer updates of linear warm-up (the paper warms up over 20 rollout steps,
            i.e. ``20 * updates_per_rollout_step`` updates).
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, lambda s: warmup_constant_factor(s, warmup_steps))


class WarmupCosineLR(LambdaLR):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at ``total_steps``.

    Args:
        optimizer: The wrapped optimizer.
        warmup_steps: Optimizer updates of linear warm-up.
        total_steps: Optimizer update at which the decay reaches its floor.
        min_lr_ratio: Final LR as a fraction of the peak LR.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 0,
        total_steps: int = 1000,
        min_lr_ratio: float = 0.1,
    ) -> None:
        if total_steps <= warmup_steps:
            raise ValueError(
                f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})."
            )
        super().__init__(
            optimizer, lambda s: warmup_cosine_factor(s, warmup_steps, total_steps, min_lr_ratio)
        )
