"""StepCheckpoint: Lightning's ``ModelCheckpoint`` whose ``every_n_train_steps`` counts optimizer
updates that come several to a rollout step.

``ModelCheckpoint`` saves after a batch only when ``trainer.global_step`` *is* a multiple of
``every_n_train_steps``. A DAPO rollout step makes several updates (one per mini-batch), so the
count can step over a multiple (2 updates a step, every 3: 2, 4, 6 saves at 6 only), and one step
with an odd count (fewer groups kept: ``on_exhausted: train_on_kept``) shifts every later count
off the multiples of an even N: no periodic checkpoint again. :class:`StepCheckpoint` also saves
when a rollout step's updates pass a multiple without landing on one (:func:`skipped_a_save`),
at the point ``ModelCheckpoint`` saves (after every other callback's ``on_train_batch_end``:
Lightning runs checkpoint callbacks last). :class:`~dapo_lightning.callbacks.RunGuard` makes each
plain ``ModelCheckpoint`` of a fit one (:func:`save_stepped_over_multiples`), so a YAML naming
Lightning's class gets it; its checkpoint state keeps ``ModelCheckpoint``'s key.

A save between two rollout steps (a stop at a step's end, the end of the fit) is written in the
batch-counter form of these end-of-batch saves
(:func:`~dapo_lightning.lightning_internals.as_batch_end_state`, applied by the guard), so
that a resume from it counts rollout steps, and validates, as a resume from a periodic save
does.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


def skipped_a_save(before: int, after: int, every: int) -> bool:
    """Whether updates ``before`` -> ``after`` (one rollout step) passed a multiple of ``every``
    without stopping on one: ``every >= 1``, ``after % every != 0`` and
    ``after // every > before // every``."""
    return every >= 1 and after % every != 0 and after // every > before // every


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves when a rollout step steps over a multiple of
    ``every_n_train_steps`` (module docstring); everything else is ``ModelCheckpoint``'s."""

    _step_at_batch_start = 0

    @property
    @override
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key: checkpoints load into either class."""
        return super().state_key.replace(type(self).__qualname__, "ModelCheckpoint", 1)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        before, every = self._step_at_batch_start, self._every_n_train_steps
        if not skipped_a_save(before, trainer.global_step, every):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # as ModelCheckpoint does
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


def save_stepped_over_multiples(trainer: pl.Trainer) -> None:
    """Make every plain ``ModelCheckpoint`` of ``trainer`` a :class:`StepCheckpoint` (its class
    swapped in place; a subclass of the user's own is left as it is)."""
    for callback in trainer.callbacks:
        if type(callback) is ModelCheckpoint:
            callback.__class__ = StepCheckpoint
