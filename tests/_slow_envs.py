"""Environments whose constructor is slow, loaded by class path in CLI fits
(tests/test_envs_slow.py, issue 63 item 4): one slow everywhere, one slow once the fit runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dapo_lightning.envs import StepResult


class SlowInit:
    """Takes ``sleep_s`` seconds to build (a tool server that does not answer)."""

    def __init__(self, sleep_s: float = 600.0) -> None:
        time.sleep(sleep_s)

    def reset(self, record: Any) -> None:
        pass

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)


class SlowInitOnceFitting(SlowInit):
    """Builds at once until the fit runs (the stop handlers are installed), then takes
    ``sleep_s`` seconds, with ``marker`` written first (the test sends its signal then; only
    the timing is arranged). Reads the interrupt module's private ``_active`` flag: a test
    helper's way to tell "the fit runs" from the checks before it."""

    def __init__(self, marker: str, sleep_s: float = 600.0) -> None:
        from dapo_lightning import interrupt

        if interrupt._active:
            Path(marker).write_text("building")
            time.sleep(sleep_s)
