"""Rewards that misbehave, importable by class path in a CLI fit and in worker processes
(tests/test_rewards.py, tests/test_bad_inputs.py): a NaN or string score, a worker that ends
itself (``os._exit``) or hangs on every response, and one that marks and slows its own start
in a worker (unpickling it is part of the worker's start-up)."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
    """Scores by length parity; slow where the reward workers start. A worker that unpickles
    it appends "starting <pid>" to ``marker`` and takes ``start_s`` seconds more to start (a
    reward with a slow import); the parent's third pickling of it (1: the picklability check,
    2: the first worker's start, 3: the second's) waits until the first worker is starting,
    appends "pickling <pid>" and takes ``pickle_s`` seconds more (the parent is busy starting
    a worker while the first one starts: a signal then finds both busy)."""

    failure_score = -1.0

    def __init__(self, marker: str, start_s: float = 60.0, pickle_s: float = 5.0) -> None:
        self.marker = marker
        self.start_s = start_s
        self.pickle_s = pickle_s
        self.pickled = 0

    def _mark(self, what: str) -> None:
        with open(self.marker, "a") as f:
            f.write(f"{what} {os.getpid()}\n")

    def _marks(self) -> str:
        path = Path(self.marker)
        return path.read_text() if path.exists() else ""

    def __getstate__(self) -> dict:
        self.pickled += 1
        if self.pickled >= 3:  # wait for the first worker's start, then take pickle_s more
            deadline = time.monotonic() + 300
            while "starting" not in self._marks() and time.monotonic() < deadline:
                time.sleep(0.05)
            self._mark("pickling")
            time.sleep(self.pickle_s)
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._mark("starting")
        time.sleep(self.start_s)

    def __call__(self, responses, ground_truths, **kwargs):
        return [
            RewardResult(score=1.0 if len(r) % 2 == 0 else -1.0, acc=len(r) % 2 == 0)
            for r in responses
        ]


class CallsSysExit:
    """Calls ``sys.exit(3)`` on every call (a reward that gives up the way a script would)."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        import sys

        sys.exit(3)


class RaisesKeyboardInterrupt:
    """Raises ``KeyboardInterrupt`` on every call."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        raise KeyboardInterrupt


class EvenLength:
    """Scores by length parity (a reward that always scores); its worker's pid in ``extra``."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        return [
            RewardResult(
                score=1.0 if len(r) % 2 == 0 else -1.0,
                acc=len(r) % 2 == 0,
                extra={"pid": os.getpid()},
            )
            for r in responses
        ]
