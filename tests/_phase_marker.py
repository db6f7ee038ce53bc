"""A test-only callback the CLI loads by class path (``tests/`` on ``PYTHONPATH``): it appends
``<global_step> <batch_idx>`` to ``marker`` at the start of every validation batch, so a test
can send a signal while the run is validating."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class ValidationMarker(Callback):
    """Appends one line per validation batch to ``marker`` (a test fixture)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        with open(self.marker, "a") as f:
            f.write(f"{trainer.global_step} {batch_idx}\n")
