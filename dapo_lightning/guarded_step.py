"""One optimizer step with its checks (:class:`GuardedStep`), and what it did (:class:`StepOutcome`).

    before the step (inside the strategy's step, after a GradScaler's unscale):
        gradient norm and clip; a non-finite norm, clip value or optimizer setting drops the
        gradients (the step leaves the weights as they are); else the weights and the optimizer
        state are snapshot (NonFiniteGuard)
    optimizer.step
    after the step: non-finite weights on any rank -> the snapshot is put back (skipped)

The checks are :mod:`dapo_lightning.step_guard`'s; this module runs them in that order around a
strategy's step and reports one :class:`StepOutcome` per step: reset before it, so a strategy
whose step never ran the checks is an error, never the previous step's outcome.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from dapo_lightning.step_guard import NonFiniteGuard, all_finite, nonfinite_step_input
from dapo_lightning.strategy import StrategyAdapter
from dapo_lightning.update import OptimizerStepConfig


@dataclass(frozen=True)
class StepOutcome:
    """What the last optimizer step did: the gradient norm before clipping (``nan`` where the
    strategy clips inside its step: DeepSpeed), and whether it was skipped (a non-finite norm
    or step input, or non-finite weights after it: the weights stay as they were)."""

    grad_norm: float
    skipped: bool


class GuardedStep:
    """Optimizer steps with the gradient norm, the clip and the non-finite guard.

    Args:
        ranks: The strategy's answers (the norm over shards, any rank's verdict, whether the
            strategy steps inside its engine).
        config: Clipping and whether non-finite steps are skipped.
    """

    def __init__(self, ranks: StrategyAdapter, config: OptimizerStepConfig) -> None:
        self.ranks, self.config = ranks, config
        #: Counts non-finite updates, holds the pre-step snapshot.
        self.guard = NonFiniteGuard()
        #: The step under way's outcome: None until :meth:`before` ran for it.
        self.outcome: StepOutcome | None = None

    def step(self, optimizer: Any, policy: nn.Module, before: Callable[[Any], None]) -> StepOutcome:
        """One step of ``optimizer`` through the strategy, ``before(optimizer)`` (which calls
        :meth:`before`) inside it; the step is undone where it left non-finite weights, the
        gradients are zeroed, and the guard records the outcome."""
        self.outcome = None
        self.ranks.optimizer_step(optimizer, before)
        if self.outcome is None:
            raise RuntimeError(
                "the optimizer step ran without before_optimizer_step (the gradient norm, "
                "clipping and the non-finite check): a strategy must call it inside the step"
            )
        skipped = self.outcome.skipped or self.undo_if_nonfinite(policy)
        optimizer.zero_grad(set_to_none=True)
        if self.config.skip_nonfinite:
            self.guard.record(skipped, self.guard.last_reason)
        return StepOutcome(self.outcome.grad_norm, skipped)

    def before(self, optimizer: Any, params: list[nn.Parameter]) -> None:
        """Gradient norm and clipping; a non-finite norm, clip value or optimizer setting drops
        the gradients so the step leaves the weights as they are; otherwise the step is
        snapshot so that it can be undone (:mod:`dapo_lightning.step_guard`)."""
        clip, guarded = self.config.gradient_clip_val, self.config.skip_nonfinite
        norm = self.ranks.clip_grad_norm(params, clip)
        known = not (math.isnan(norm) and self.ranks.steps_in_engine)
        skipped = bool(guarded and known and not math.isfinite(norm))
        guard = self.guard
        guard.last_reason = f"gradient norm {norm}" if skipped else ""
        if guarded and not skipped and not self.ranks.steps_in_engine:
            bad = nonfinite_step_input(optimizer.param_groups, clip)
            skipped, guard.last_reason = bad is not None, f"the step would use {bad}"
            if not skipped:
                guard.snapshot.take(optimizer)
        if skipped:
            optimizer.zero_grad(set_to_none=True)
        self.outcome = StepOutcome(grad_norm=norm, skipped=skipped)

    def undo_if_nonfinite(self, policy: nn.Module) -> bool:
        """After a step: when a parameter is not finite (on any rank), put the snapshot back
        (parameters and optimizer state as before the step) and return True."""
        if not self.config.skip_nonfinite or self.ranks.steps_in_engine:
            return False
        params = [p for p in policy.parameters() if p.requires_grad]
        bad = self.ranks.any_rank(not all_finite(params))
        if bad:
            self.guard.snapshot.restore()
            self.guard.last_reason = "the step left non-finite weights (undone)"
        return bad
