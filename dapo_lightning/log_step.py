"""The step Lightning logs ``self.log`` values at: the one place that sets it.

Lightning logs ``LightningModule.log`` values (and a validation's) at its fit loop's count of
stepped batches. A DAPO batch is a rollout step of several optimizer updates, while the
``update/*`` metrics, ``dapo-lightning plot`` and the benchmarks count updates; so the library
moves that counter to "updates done - 1" (the convention "updates done = step + 1" of every
logged row): after each rollout step (``DAPOModule``), for the validation before any update
(``ValidateAtStart``: -1) and for a ``validate`` of a checkpoint (the CLI). Lightning keeps the
counter in a private attribute; :func:`set_logging_step` is the only code that writes it.
"""

from __future__ import annotations

from typing import Any


def set_logging_step(trainer: Any, step: int) -> None:
    """Make Lightning log the next ``self.log`` values (and validations) at ``step``."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step
