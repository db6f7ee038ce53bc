"""A reward for sharded-run tests: +1 when the response has an even number of characters, else
-1. A random tiny model earns both within a group, so updates carry a real gradient."""

from __future__ import annotations

from dapo_lightning.rewards.base import RewardResult


class EvenLengthReward:
    """Scores responses by the parity of their length (a test fixture; no task behind it)."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kwargs):
        return [
            RewardResult(score=1.0 if len(r) % 2 == 0 else -1.0, acc=len(r) % 2 == 0)
            for r in responses
        ]
