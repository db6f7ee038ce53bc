"""The non-finite update guard: an optimizer step never leaves NaN / inf weights behind.

Around every optimizer step of :class:`~dapo_lightning.module.DAPOModule` (with
``skip_nonfinite``):

1. **Before** (``on_before_optimizer_step``, after the gradient norm and the clip): the step is
   skipped when the gradient norm is not finite (as before) or when one of the numbers the step
   uses is not: the clip value, or any hyper-parameter of the optimizer's param groups (a NaN
   learning rate set by a scheduler or a callback turns every weight into NaN with a finite
   gradient). :func:`nonfinite_step_input` names it. Otherwise :class:`StepSnapshot` copies the
   trainable parameters and their optimizer state into buffers kept between steps.
2. **After**: one check of the parameters, :func:`all_finite` (the extremes of every
   parameter, stacked: NaN propagates through them and they cannot overflow); when it fails
   (a step that overflowed, e.g. an ``eps=0`` Adam dividing 0 by 0), the snapshot is put back:
   parameters and optimizer state exactly as before the step.

Either way the update counts as skipped (``update/skipped_nonfinite``), the learning-rate
scheduler does not advance, and :class:`NonFiniteGuard` stops the run after
``max_in_a_row`` (5) such updates in a row with :class:`NonFiniteUpdatesError` (the CLI: one
line, exit 1). Checkpoints are refused from non-finite weights or optimizer state anyway
(:class:`~dapo_lightning.checkpoint.io.AtomicCheckpointIO`), and a checkpoint holding them is
not resumed from (:func:`~dapo_lightning.checkpoint.checks.verify_checkpoint`).

Cost (one copy of the trainable parameters and their optimizer state per step, plus one read
of the parameters): ``benchmarks/RESULTS.md`` ("Non-finite update guard"). Under several ranks
the after-check is reduced over them (FSDP2 ranks each hold a shard); DeepSpeed steps inside its
engine and is not guarded here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "NonFiniteGuard",
    "NonFiniteUpdatesError",
    "StepSnapshot",
    "StepStart",
    "all_finite",
    "nonfinite_step_input",
]


class NonFiniteUpdatesError(RuntimeError):
    """Several updates in a row would have left non-finite weights; the run stops."""


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True when every element of ``tensors`` is finite: the extremes of every tensor are
    (NaN propagates through a min and a max; neither can overflow), one device sync.

    The extremes are ``min_i`` and ``max_i`` of each tensor (``aminmax``) on a CPU, where it
    is vectorised and ``_foreach_norm(ord=inf)`` is not (135M parameters: 69 ms against 370 ms
    on one Sapphire Rapids core; ``benchmarks/nonfinite_guard.py``), and ``||t_i||_inf`` (one
    fused ``_foreach_norm`` kernel for all of them) on an accelerator."""
    local = [_local(t).detach() for t in tensors if t.numel()]
    if not local:
        return True
    if local[0].device.type == "cpu":
        extremes = [x for t in local for x in torch.aminmax(t)]
    else:
        extremes = list(torch._foreach_norm(local, math.inf))
    return bool(torch.isfinite(torch.stack([x.float() for x in extremes])).all())


def _numbers(value: Any) -> Iterable[float]:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)
    elif isinstance(value, Tensor) and value.numel() == 1:
        yield float(value)


def nonfinite_step_input(
    param_groups: Iterable[dict[str, Any]], clip_value: float | None
) -> str | None:
    """``"name=value"`` of the first non-finite number a step would use (the clip value, or a
    param group's ``lr``, ``betas``, ``weight_decay``, ...), or None when all are finite."""
    if clip_value is not None and not math.isfinite(clip_value):
        return f"gradient_clip_val={clip_value}"
    for group in param_groups:
        for key, value in group.items():
            if key != "params" and any(not math.isfinite(x) for x in _numbers(value)):
                return f"{key}={value}"
    return None


class StepSnapshot:
    """The trainable parameters and their optimizer state, copied before a step so that the
    step can be undone exactly. The buffers are allocated once and reused."""

    def __init__(self) -> None:
        self._params: list[Tensor] = []
        self._param_bufs: list[Tensor] = []
        self._state: dict[int, dict[str, Any]] = {}
        self._optimizer: Any = None

    def take(self, optimizer: Any, *, every_param: bool = False) -> None:
        """Copy every parameter of ``optimizer`` that has a gradient (``every_param``: every
        parameter, as before a rollout step's first backward), and its state."""
        params = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if every_param or p.grad is not None
        ]
        local = [_local(p).detach() for p in params]
        if len(self._param_bufs) != len(local) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self._param_bufs, local)
        ):
            self._param_bufs = [torch.empty_like(t) for t in local]
        if local:
            torch._foreach_copy_(self._param_bufs, local)
        self._params, self._optimizer = params, optimizer
        old, self._state = self._state, {}
        for i, p in enumerate(params):
            state = optimizer.state.get(p)
            if not state:
                continue
            saved = {}
            for key, value in state.items():
                if isinstance(value, Tensor):
                    buf = old.get(i, {}).get(key)
                    src = _local(value).detach()
                    if (
                        not isinstance(buf, Tensor)
                        or buf.shape != src.shape
                        or buf.dtype != src.dtype
                    ):
                        buf = torch.empty_like(src)
                    buf.copy_(src)
                    saved[key] = buf
                else:
                    saved[key] = value
            self._state[i] = saved

    def restore(self) -> None:
        """Put back what :meth:`take` copied (parameters, optimizer state; state the step
        created for a parameter that had none is removed)."""
        if self._params:
            torch._foreach_copy_([_local(p).detach() for p in self._params], self._param_bufs)
        for i, p in enumerate(self._params):
            saved = self._state.get(i)
            if saved is None:
                self._optimizer.state.pop(p, None)
                continue
            state = self._optimizer.state[p]
            for key, value in saved.items():
                if isinstance(value, Tensor) and isinstance(state.get(key), Tensor):
                    _local(state[key]).copy_(value)
                else:
                    state[key] = value.clone() if isinstance(value, Tensor) else value


class StepStart:
    """A rollout step's start, so that a stop after some of its updates can undo them all
    exactly: the trainable parameters and their optimizer state (:class:`StepSnapshot`), the
    optimizer's hyper-parameters (a scheduler writes the learning rate into them), and the
    ``state_dict()`` of everything else an update advances (the learning-rate scheduler,
    Lightning's optimizer-step counter, callbacks, the module's counters and RNGs), each put
    back with its own ``load_state_dict``. The partial step is then dropped as one stopped
    before its first update is: its rollouts are generated again on resume.

    Cost: one copy of the parameters and their optimizer state per rollout step with more
    than one update (the guard's pre-step copy is another; not benchmarked yet).
    """

    def __init__(self) -> None:
        self.params = StepSnapshot()
        self._optimizer: Any = None
        self._hyper: list[dict[str, Any]] = []
        self._states: list[tuple[Any, Any]] = []

    def take(self, optimizer: Any, stateful: Iterable[Any]) -> None:
        """Copy ``optimizer``'s parameters, state and hyper-parameters, and the state dict of
        each object of ``stateful`` (those with an empty one hold nothing to put back)."""
        self.params.take(optimizer, every_param=True)
        self._optimizer = optimizer
        self._hyper = [
            copy.deepcopy({k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups
        ]
        self._states = [(obj, copy.deepcopy(s)) for obj in stateful if (s := obj.state_dict())]

    def restore(self) -> None:
        """Put back what :meth:`take` copied."""
        self.params.restore()
        for group, hyper in zip(self._optimizer.param_groups, self._hyper):
            group.update(copy.deepcopy(hyper))
        for obj, state in self._states:
            obj.load_state_dict(copy.deepcopy(state))


class NonFiniteGuard:
    """Counts updates undone or skipped for a non-finite value and stops a run of them.

    Args:
        max_in_a_row: Updates in a row that may be non-finite before
            :class:`NonFiniteUpdatesError`; a finite update resets the count. The default, 5,
            lets a :class:`~dapo_lightning.callbacks.CollapseDetector` (its ``nonfinite``
            detector: 3 in a row) stop the run cleanly first where one is configured.
    """

    def __init__(self, max_in_a_row: int = 5) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.snapshot = StepSnapshot()
        self.last_reason = ""

    def record(self, nonfinite: bool, reason: str = "") -> None:
        """Count one update; raise when ``max_in_a_row`` were non-finite in a row."""
        if not nonfinite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.last_reason = reason
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteUpdatesError(
                f"{self.in_a_row} updates in a row were not finite (last: {reason}); each was "
                "skipped or undone, so the weights are those of the last finite update. Look for "
                "a NaN / inf setting (learning rate, clip value), a reward or loss that explodes, "
                "or too high a learning rate."
            )
