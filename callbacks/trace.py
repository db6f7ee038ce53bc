"""PhaseTrace: a Chrome trace of the run's phases on every thread, written at the end of fit.

The phases are the library's :func:`~dapo_lightning.trace.phase` marks: ``rollout``,
``update``, ``weight push``, ``validation``, ``wait for batch``. Open the file in
https://ui.perfetto.dev or ``chrome://tracing``: with ``pipeline: one_step_off`` the rollout
thread's spans run under the main thread's updates; with ``sync`` they take turns.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from dapo_lightning.trace import PhaseRecorder


class PhaseTrace(Callback):
    """Record the phases of ``fit`` and write them as a Chrome trace JSON.

    Args:
        filename: The file, under the logger's folder (``trainer.log_dir``, else
            ``default_root_dir``); rank ``r > 0`` of a multi-process run writes
            ``<stem>.rank<r>.json`` beside it.

    Example::

        trainer = Trainer(callbacks=[PhaseTrace()])   # -> logs/version_0/phase_trace.json
    """

    def __init__(self, filename: str = "phase_trace.json") -> None:
        if not filename or Path(filename).name != filename:
            raise ValueError(f"PhaseTrace.filename must be a file name, got {filename!r}")
        self.filename = filename
        self.recorder: PhaseRecorder | None = None
        #: Where the last trace was written.
        self.path: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.recorder is None:
            self.recorder = PhaseRecorder().__enter__()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._finish(trainer)  # the spans up to the failure are written too

    def _finish(self, trainer: pl.Trainer) -> None:
        """Stop recording and write the trace (once)."""
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return
        recorder.__exit__(None, None, None)
        name = Path(self.filename)
        if trainer.global_rank > 0:
            name = name.with_name(f"{name.stem}.rank{trainer.global_rank}{name.suffix}")
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        self.path = recorder.write(folder / name)
        rank_zero_info(f"PhaseTrace: {len(recorder.events)} spans written to {self.path}")
