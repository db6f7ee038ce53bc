"""Callbacks that send this process real signals at arranged moments of a CLI fit
(tests/test_interrupt_cli.py, issue 63 item 1): only the timing is arranged, the signals and
their handling are real."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from dapo_lightning.callbacks import DAPOCallback


class MoreSignalsDuringTheSave(DAPOCallback):
    """A SIGTERM once rollouts are scored after update ``after`` (the producer then stops
    between rounds: the stop goes through the guard's exception path), then, inside the stop's
    save, a second SIGTERM, 50 ms later a third, and a Ctrl-C (what a launcher sending SIGTERM
    every 20-50 ms does)."""

    def __init__(self, after: int = 1) -> None:
        self.after = after
        self.sent = False

    def on_rollouts_scored(self, trainer: Any, pl_module: Any, rollouts: Any) -> None:
        if not self.sent and trainer.global_step >= self.after:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        from dapo_lightning.interrupt import stop_requested

        if stop_requested() is None:
            return
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # each handler runs here, inside the save
