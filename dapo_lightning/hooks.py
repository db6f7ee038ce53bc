"""The three DAPO hooks, declared once: :class:`DAPOCallback` and its dispatcher.

Lightning calls its own hooks on every callback; a DAPO run has three more moments a callback
may act on, and the library calls them through :func:`call_dapo_hook` on every callback of the
trainer that is a :class:`DAPOCallback` (exported as ``dapo_lightning.callbacks.DAPOCallback``;
this module is the library core's, so the module and the data module need nothing from
``dapo_lightning.callbacks``):

* ``on_rollouts_scored(trainer, pl_module, rollouts)``: after a generation round is scored,
  before the dynamic-sampling filter (reward shaping, loss masks; see docs/design.md, "One
  training step, as data"). Called on every rank for its own rollouts; do not log here.
* ``on_rollouts_discarded(trainer, pl_module, batch_index)``: the rounds scored for batch
  ``batch_index`` and later batches were thrown away (a stop or an error during their
  generation, or a stop that undid the step training them): they will be generated and scored
  again, so whatever a callback counted of them in ``on_rollouts_scored`` is dropped here
  (:class:`~dapo_lightning.callbacks.round_counts.RoundCounts.discard`). Called on every rank,
  possibly from the rollout thread.
* ``on_dapo_update(trainer, pl_module, metrics)``: after every optimizer update, with that
  update's metrics (reduced over ranks, names without the ``update/`` prefix).

A plain Lightning ``Callback`` that defines one of these methods without subclassing
:class:`DAPOCallback` is not called: the dispatcher goes by the declared type, not by method
names, so an unrelated callback's method of the same name is never invoked with DAPO
arguments. It is not dropped silently either: :func:`warn_undeclared_dapo_hooks` (run at fit
start by the module and the data module) warns once per trainer, naming the callback and the
hook, and says to subclass :class:`DAPOCallback`.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from dapo_lightning.batch import ScoredRollouts

#: The hooks :func:`call_dapo_hook` dispatches.
DAPO_HOOKS = ("on_rollouts_scored", "on_rollouts_discarded", "on_dapo_update")


class DAPOCallback(Callback):
    """A Lightning ``Callback`` that also receives the DAPO hooks (no-ops by default).

    Example::

        class CountAnswerLines(DAPOCallback):
            def on_rollouts_scored(self, trainer, pl_module, rollouts):
                self.seen = sum("Answer:" in t for t in rollouts.extra.get("text", []))
    """

    def on_rollouts_scored(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: ScoredRollouts
    ) -> None:
        """Shape ``rollouts.reward`` / ``rollouts.loss_mask`` in place before the filter."""

    def on_rollouts_discarded(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_index: int
    ) -> None:
        """Forget what ``on_rollouts_scored`` counted of batch ``batch_index`` and later ones
        (``rollouts.batch_index``): they are generated and scored again."""

    def on_dapo_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]
    ) -> None:
        """React to one optimizer update (``metrics``: that update's ``update/*`` values)."""


def call_dapo_hook(trainer: pl.Trainer | None, hook: str, *args: Any) -> None:
    """Call ``hook(trainer, trainer.lightning_module, *args)`` on the trainer's DAPO callbacks.

    Raises:
        ValueError: ``hook`` is not one of :data:`DAPO_HOOKS`.
    """
    if hook not in DAPO_HOOKS:
        raise ValueError(f"unknown DAPO hook {hook!r}: one of {DAPO_HOOKS}.")
    if trainer is None:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, DAPOCallback):
            getattr(callback, hook)(trainer, trainer.lightning_module, *args)


# Trainers already checked by warn_undeclared_dapo_hooks (the module and the data module both
# call it at fit start; one warning per trainer).
_CHECKED: weakref.WeakSet[pl.Trainer] = weakref.WeakSet()


def undeclared_dapo_hooks(callbacks: list[Callback]) -> list[tuple[str, str]]:
    """``(callback class name, hook)`` for each DAPO hook a callback defines without being a
    :class:`DAPOCallback` (so :func:`call_dapo_hook` will not call it)."""
    return [
        (type(cb).__name__, hook)
        for cb in callbacks
        if not isinstance(cb, DAPOCallback)
        for hook in DAPO_HOOKS
        if callable(getattr(cb, hook, None))
    ]


def warn_undeclared_dapo_hooks(trainer: pl.Trainer | None) -> None:
    """Warn (once per trainer, on rank 0) about callbacks whose DAPO hooks will not be called
    because they do not subclass :class:`DAPOCallback`."""
    if trainer is None or trainer in _CHECKED:
        return
    _CHECKED.add(trainer)
    for name, hook in undeclared_dapo_hooks(trainer.callbacks):
        rank_zero_warn(
            f"callback {name} defines {hook}() but is a plain Lightning Callback: DAPO hooks are "
            f"called only on DAPOCallback subclasses, so it will never run. Fix: subclass "
            "dapo_lightning.callbacks.DAPOCallback.",
            category=UserWarning,
        )
