"""Rewards that misbehave, importable by class path in a CLI fit and in worker processes
(tests/test_rewards.py, tests/test_bad_inputs.py): a NaN or string score, a worker that ends
itself (``os._exit``) or hangs on every response, and one that marks and slows its own start
in a worker (unpickling it is part of the worker's start-up)."""

from __future__ import annotations

import os
import time

from dapo_lightning.rewards.base import RewardResult


class NaNScore:
    """Returns score=nan for every response (a reward bug)."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        return [RewardResult(score=float("nan"), acc=False) for _ in responses]


class StringScore:
    """Returns score="high" for every response (a reward bug)."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        return [RewardResult(score="high", acc=True) for _ in responses]


class ExitsInWorker:
    """Ends its process with exit code 3 on every call (as a crashing C extension would)."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        os._exit(3)


class HangsAlways:
    """Hangs for an hour on every call."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        time.sleep(3600)


class StartsSlowly:
    """Scores by length parity; a worker that unpickles it appends "starting" to ``marker``
    and takes ``start_s`` seconds more to start (a reward with a slow import)."""

    failure_score = -1.0

    def __init__(self, marker: str, start_s: float = 30.0) -> None:
        self.marker = marker
        self.start_s = start_s

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        with open(self.marker, "a") as f:
            f.write(f"starting {os.getpid()}\n")
        time.sleep(self.start_s)

    def __call__(self, responses, ground_truths, **kwargs):
        return [
            RewardResult(score=1.0 if len(r) % 2 == 0 else -1.0, acc=len(r) % 2 == 0)
            for r in responses
        ]
