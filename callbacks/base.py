"""The two DAPO hooks, declared once: :class:`DAPOCallback` and its dispatcher.

Lightning calls its own hooks on every callback; a DAPO run has two more moments a callback
may act on, and the library calls them through :func:`call_dapo_hook` on every callback of the
trainer that is a :class:`DAPOCallback`:

* ``on_rollouts_scored(trainer, pl_module, rollouts)``: after a generation round is scored,
  before the dynamic-sampling filter (reward shaping, loss masks; see docs/design.md, "One
  training step, as data"). Called on every rank for its own rollouts; do not log here.
* ``on_dapo_update(trainer, pl_module, metrics)``: after every optimizer update, with that
  update's metrics (reduced over ranks, names without the ``update/`` prefix).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback

from dapo_lightning.data.batch import ScoredRollouts

#: The hooks :func:`call_dapo_hook` dispatches.
DAPO_HOOKS = ("on_rollouts_scored", "on_dapo_update")


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
