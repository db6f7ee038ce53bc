"""A CPU copy of the training state that can be restored bit-exactly: :class:`TrainingSnapshot`.

:class:`~dapo_lightning.callbacks.collapse.CollapseDetector` rolls a collapsing run back to
the last healthy snapshot. A snapshot holds the policy weights, the optimizer state and the
LR-scheduler state, copied to CPU and sharing no storage with the live objects, so training
on after a restore never changes the snapshot.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def cpu_copy(obj: Any) -> Any:
    """Deep copy of nested dicts / lists / tuples with every tensor cloned to CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def scale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply the learning rate by ``factor``, in the optimizer and in the scheduler.

    The scheduler's ``base_lrs`` are scaled too, so its later steps keep the new scale.

    Example::

        scale_lr(optimizer, scheduler, 0.5)  # every param group's lr halves, for good
    """
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    if scheduler is None:
        return
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@dataclass
class TrainingSnapshot:
    """CPU copies of a module's weights, its optimizer's and its scheduler's state.

    Args:
        policy: ``module.state_dict()``, on CPU.
        optimizer: ``optimizer.state_dict()`` on CPU, or None (no optimizer).
        scheduler: ``scheduler.state_dict()``, or None (no scheduler).

    Example::

        snap = TrainingSnapshot.take(model, optimizer, scheduler)
        ...  # train on; it goes wrong
        snap.restore(model, optimizer, scheduler, lr_scale=0.5)
    """

    policy: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None

    @classmethod
    def take(
        cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> TrainingSnapshot:
        """Copy the current state of ``module``, ``optimizer`` and ``scheduler`` to CPU."""
        return cls(
            policy=cpu_copy(module.state_dict()),
            optimizer=cpu_copy(optimizer.state_dict()) if optimizer is not None else None,
            scheduler=cpu_copy(scheduler.state_dict()) if scheduler is not None else None,
        )

    def restore(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        lr_scale: float = 1.0,
    ) -> None:
        """Load the snapshot back bit-exactly, then multiply the learning rate by ``lr_scale``.

        The snapshot stays unchanged: the optimizer and scheduler get fresh copies, because
        ``load_state_dict`` may keep the given tensors as its live state.

        Raises:
            ValueError: ``lr_scale`` is not in (0, 1].
        """
        if not 0 < lr_scale <= 1:
            raise ValueError(f"lr_scale must be in (0, 1], got {lr_scale}.")
        module.load_state_dict(self.policy)
        if optimizer is not None and self.optimizer is not None:
            optimizer.load_state_dict(cpu_copy(self.optimizer))
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(cpu_copy(self.scheduler))
        if optimizer is not None and lr_scale != 1.0:
            scale_lr(optimizer, scheduler, lr_scale)

    def state_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (for checkpoints)."""
        return {"policy": self.policy, "optimizer": self.optimizer, "scheduler": self.scheduler}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TrainingSnapshot:
        """Rebuild a snapshot saved with :meth:`state_dict` (copied to CPU)."""
        state = cpu_copy(state)
        return cls(state["policy"], state.get("optimizer"), state.get("scheduler"))
