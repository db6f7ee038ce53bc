"""A DAPOModule subclass for tests/test_cli.py, given to the CLI by ``class_path``.

Importable from the CLI subprocess because the test puts ``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_lightning import DAPOModule


class TracingDAPOModule(DAPOModule):
    """DAPOModule that appends one line per training step to ``trace_file`` and logs ``trace/steps``.

    Args:
        trace_file: File the subclass writes to (proves the subclass, not the base, ran).
        **kwargs: DAPOModule arguments.
    """

    def __init__(self, trace_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace_file = trace_file
        self.traced_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.traced_steps += 1
        with open(Path(self.trace_file), "a") as f:
            f.write(f"step {self.traced_steps} groups {batch.num_groups}\n")
        self.log("trace/steps", float(self.traced_steps), on_step=True, on_epoch=False)
