"""Test-only pieces of issue 53's hostile-input catalogue, loaded by class path in CLI fits
(tests/test_hostile_inputs.py): environments that fail in every episode (``reset`` raises,
``step`` returns a ``str``, ``step`` sleeps past ``call_timeout_s``) and a callback that
presses Ctrl-C twice at once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from dapo_lightning.callbacks import DAPOCallback

from dapo_lightning import DAPODataModule
from dapo_lightning.envs import StepResult


class ResetRaises:
    """``reset`` raises in every episode."""

    def reset(self, record: Any) -> None:
        raise RuntimeError("tool server down")

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)


class StepReturnsStr:
    """``step`` returns a ``str``, not a ``StepResult``."""

    def reset(self, record: Any) -> None:
        pass

    def step(self, text: str) -> StepResult:
        return "not a step result"  # type: ignore[return-value]


class StepSleeps:
    """``step`` sleeps ``sleep_s`` (past ``call_timeout_s``) in every episode."""

    def __init__(self, sleep_s: float = 5.0) -> None:
        self.sleep_s = sleep_s

    def reset(self, record: Any) -> None:
        pass

    def step(self, text: str) -> StepResult:
        time.sleep(self.sleep_s)
        return StepResult(done=True)


class CtrlCTwice(DAPOCallback):
    """Sends this process two SIGINTs at once at the start of rollout step ``at_batch`` (a
    user pressing Ctrl-C twice while the fit runs: the second arrives inside ``fit``)."""

    def __init__(self, at_batch: int = 1) -> None:
        self.at_batch = at_batch

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.at_batch:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handlers run here


class SigtermInSetup(DAPODataModule):
    """The data module, with a SIGTERM to this process at the start of its ``setup`` (after the
    Trainer was built, before the :class:`~dapo_lightning.callbacks.RunGuard` guards the fit:
    a stop while the engine starts)."""

    def setup(self, stage: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)  # the handler runs here
        super().setup(stage)
