"""A reward for stop tests: the first ``ok_calls`` calls score by length parity; every later
call hangs for an hour (a reward stuck on adversarial input). Each call is logged in
``marker`` (one line), across the worker processes that run it."""

from __future__ import annotations

import time
from pathlib import Path

from dapo_lightning.rewards.base import RewardResult


class HangsAfterCalls:
    """Length-parity scores for ``ok_calls`` calls, then a hang (a test fixture)."""

    failure_score = -1.0

    def __init__(self, marker: str, ok_calls: int = 1) -> None:
        self.marker = marker
        self.ok_calls = ok_calls

    def __call__(self, responses, ground_truths, **kwargs):
        with open(self.marker, "a") as f:
            f.write("call\n")
        if len(Path(self.marker).read_text().splitlines()) > self.ok_calls:
            time.sleep(3600)
        return [
            RewardResult(score=1.0 if len(r) % 2 == 0 else -1.0, acc=len(r) % 2 == 0)
            for r in responses
        ]


class LockedReward:
    """A reward holding a lock: it cannot be pickled into a reward worker process."""

    failure_score = -1.0

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, responses, ground_truths, **kwargs):
        return [RewardResult(score=1.0, acc=True) for _ in responses]
