"""ValidateAtStart: one real validation before the first update, logged at step 0.

Lightning's pre-training validation (``num_sanity_val_steps``) is a sanity check: its metrics
are thrown away, so the untrained model's score never reaches the logs. This callback runs the
trainer's own validation loop once at ``on_train_start`` instead, exactly as a periodic
validation would run it, so the untrained ``val/*`` lands in ``metrics.csv`` (and
``EarlyStopping`` / ``ModelCheckpoint`` see it like any other validation).

Its row has ``step`` -1: Lightning logs a validation at the step of the update before it
(``global_step - 1``: the validation after update 1 is logged at step 0), so the validation
before any update is at -1 and "updates done = step + 1" holds for every ``val/*`` row (the
convention of ``dapo_lightning.plot`` and the benchmarks). It runs on a fresh start only: a
resumed run's step-0 score is already in its logs. The global RNG states are put back
afterwards (as Lightning does around its sanity check), so adding the callback does not change
the training trajectory; the rollout engine's own generator advances as it would for a sanity
check (see docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from dapo_lightning.lightning_internals import run_validation_loop
from dapo_lightning.log_step import set_logging_step


class ValidateAtStart(Callback):
    """Validate once before training starts, logged at step -1 (use with
    ``num_sanity_val_steps: 0``).

    Example::

        trainer = Trainer(num_sanity_val_steps=0, callbacks=[ValidateAtStart()])
    """

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > 0 or not trainer.enable_validation:
            return
        set_logging_step(trainer, -1)  # see the module docstring
        try:
            with isolate_rng():
                run_validation_loop(trainer)  # as the training loop runs a periodic one
        finally:
            set_logging_step(trainer, 0)
