"""A test callback that records the update of every checkpoint a fit saves (periodic, final, on
a signal), one line per save, in the file named by ``DAPO_TEST_SAVES`` (rank 0 only).

Appended to a real command line, as a user would add a callback:
``--trainer.callbacks+=_save_recorder.SaveRecorder`` (``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import Callback


class SaveRecorder(Callback):
    """Records ``trainer.global_step`` each time a checkpoint is made: in :attr:`updates`, and
    appended to ``$DAPO_TEST_SAVES`` when set (a fit in another process)."""

    def __init__(self) -> None:
        self.updates: list[int] = []

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        self.updates.append(trainer.global_step)
        path = os.environ.get("DAPO_TEST_SAVES")
        if path and trainer.is_global_zero:
            with open(path, "a") as out:
                out.write(f"{trainer.global_step}\n")


def saved_updates(path: str | os.PathLike) -> list[int]:
    """The updates :class:`SaveRecorder` wrote to ``path``, in order."""
    return [int(line) for line in open(path).read().split()]
