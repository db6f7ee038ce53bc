"""Test-only pieces the CLI loads by class path in tests/test_envs_fit.py: a callback that
records what each training step's batch holds, an environment that fails on purpose, and
one whose methods are its tools."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dapo_lightning.callbacks import DAPOCallback

from dapo_lightning.batch import RolloutBatch
from dapo_lightning.envs import StepResult, ToolEnvironment


class EpisodeRecorder(DAPOCallback):
    """Writes ``episodes.json`` into the run directory: per step, the batch's response tokens
    (attention), loss tokens (response_mask), sampled tokens (response_length); per update,
    its token count N."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.updates: list[float] = []

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(batch, RolloutBatch):
            resp = batch.attention_mask[:, batch.prompt_width :]
            self.steps.append(
                {
                    "response_tokens": float(resp.sum()),
                    "loss_tokens": float(batch.response_mask.sum()),
                    "sampled_tokens": float(batch.response_length.sum()),
                    "rows": batch.batch_size,
                }
            )

    def on_dapo_update(self, trainer: Any, pl_module: Any, metrics: dict[str, float]) -> None:
        self.updates.append(float(metrics["tokens"]))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        out = Path(trainer.default_root_dir) / "episodes.json"
        out.write_text(json.dumps({"steps": self.steps, "updates": self.updates}))


class FaultyEnv:
    """Episode k (counted per process) raises, hangs, returns garbage, or behaves, in turn."""

    episodes = 0

    def __init__(self, hang_s: float = 5.0) -> None:
        FaultyEnv.episodes += 1
        self.kind = FaultyEnv.episodes % 4
        self.hang_s = hang_s

    def reset(self, record: Any) -> None:
        pass

    def step(self, text: str) -> StepResult:
        if self.kind == 1:
            raise RuntimeError("tool server down")
        if self.kind == 2:
            time.sleep(self.hang_s)
        if self.kind == 3:
            return "not a step result"  # type: ignore[return-value]
        return StepResult(done=True)


class Shop(ToolEnvironment):
    """Two typed tools as methods (tests/test_env_tools.py, tests/test_envs_fit.py); the
    episode's reward is the environment's own, and it logs ``env/answer_chars``."""

    metric_names = ("answer_chars",)
    PRICES = {"apple": 30, "pear": 45}  # a value, not a tool

    def price(self, item: str) -> int:
        """The price of one item, in cents.

        Args:
            item: The item's name (apple or pear).
        """
        return self.PRICES[item]

    def total(self, unit_cents: int, count: int = 1) -> int:
        """The cost of several items of one price.

        Args:
            unit_cents: One item's price, in cents.
            count: How many items.
        """
        return unit_cents * count

    def reward(self, answer: str) -> float | None:
        return 1.0 if self.record is not None and self.record.answer in answer else -1.0

    def step(self, text: str) -> StepResult:
        result = super().step(text)
        result.metrics["answer_chars"] = float(len(text)) if result.done else 0.0
        return result
