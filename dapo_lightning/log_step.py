"""The step Lightning logs ``self.log`` values at: the one place that sets it.

Lightning logs ``LightningModule.log`` values (and a validation's) at its fit loop's count of
stepped batches. A DAPO batch is a rollout step of several optimizer updates, while the
``update/*`` metrics, ``dapo-lightning plot`` and the benchmarks count updates; so the library
moves that counter to "updates done - 1" (the convention "updates done = step + 1" of every
logged row): after each rollout step (``DAPOModule``), for the validation before any update
(``ValidateAtStart``: -1) and for a ``validate`` of a checkpoint (the CLI). Lightning keeps the
counter in a private attribute; :func:`set_logging_step` is the only code that moves it
(through :func:`~dapo_lightning.lightning_internals.set_batches_that_stepped`).

A rollout step's own values (``rollout/*``, ``data/*``, ``time/*``: about 50 names) do not go
through ``self.log``: Lightning's bookkeeping costs about 0.3 ms a name (a ``_ResultMetric`` per
name, moved to the device on every call), 20 ms of a 0.2 s quickstart rollout step (9% of the
run, measured with a timer around ``LightningModule.log``). :func:`log_rollout_step` writes them
to the loggers as one row, at the same step and under the same ``log_every_n_steps`` rule, and
into ``trainer.callback_metrics``, where monitors and the progress bar read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dapo_lightning.lightning_internals import set_batches_that_stepped


def set_logging_step(trainer: Any, step: int) -> None:
    """Make Lightning log the next ``self.log`` values (and validations) at ``step``."""
    set_batches_that_stepped(trainer, step)


def log_rollout_step(trainer: Any, values: Mapping[str, float], step: int) -> None:
    """Log one rollout step's ``values`` at ``step`` (updates done - 1): one row to every
    logger (with ``epoch``, as Lightning adds it) when Lightning would log this step
    (``step + 1`` a multiple of ``trainer.log_every_n_steps``, or the run stopping), and
    every value into ``trainer.callback_metrics`` (for ``EarlyStopping``, ``ModelCheckpoint``
    monitors and the progress bar), as ``self.log(..., on_step=True, on_epoch=False)`` would."""
    floats = {k: float(v) for k, v in values.items()}
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in floats.items()})
    every = trainer.log_every_n_steps
    if not trainer.loggers or not every or ((step + 1) % every and not trainer.should_stop):
        return
    row = {**floats, "epoch": trainer.current_epoch}
    for logger in trainer.loggers:
        logger.log_metrics(row, step=step)
        logger.save()
