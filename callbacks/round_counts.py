"""RoundCounts: what a callback counts in ``on_rollouts_scored``, kept until the rollout step
that trains those rollouts.

A callback that tallies each scored round (truncated responses, answer-less ones) and reports
the tally when a rollout step ends must know which step the round belongs to. In ``sync`` mode
a step's rounds are scored right before it; with one-step-off rollouts the next batch's rounds
are scored on the rollout thread *while* the current batch trains, so "everything since the
last step" would split the two batches between steps by timing (and two threads would update
one dict). Each round is therefore kept under the policy version it was sampled with
(``ScoredRollouts.policy_version``), and a step takes the rounds at or below its batch's
version (``RolloutBatch.policy_version``, its freshest rows): its own rounds, never the next
batch's, whose version is higher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

Counts = dict[str, float]


class RoundCounts:
    """Counts per policy version, added from any thread, taken per rollout step.

    Args:
        zero: The counts of no round (the keys every ``take`` returns).
    """

    def __init__(self, zero: Callable[[], Counts]) -> None:
        self._zero = zero
        self._by_version: dict[int, Counts] = {}
        self._lock = threading.Lock()

    def add(self, version: int, counts: Mapping[str, float]) -> None:
        """Add one round's ``counts`` under the ``version`` its rollouts were sampled with."""
        with self._lock:
            total = self._by_version.setdefault(int(version), self._zero())
            for key, value in counts.items():
                total[key] = total.get(key, 0.0) + float(value)

    def take(self, batch: Any) -> Counts:
        """The sum of the rounds sampled at ``batch.policy_version`` or earlier (the rounds of
        the rollout step training ``batch``), removed; all of them for a batch without a
        version (a test's stand-in)."""
        version = getattr(batch, "policy_version", None)
        out = self._zero()
        with self._lock:
            for v in [v for v in self._by_version if version is None or v <= version]:
                for key, value in self._by_version.pop(v).items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def state_dict(self) -> dict[int, Counts]:
        with self._lock:
            return {v: dict(c) for v, c in self._by_version.items()}

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        """Counts saved by :meth:`state_dict`; a flat dict of counts (a checkpoint written before
        the counts were kept per version) is the rounds of the step under way (version -1:
        taken by the next step)."""
        with self._lock:
            if state and all(isinstance(v, (int, float)) for v in state.values()):
                self._by_version = {-1: {**self._zero(), **state}}
            else:
                self._by_version = {int(v): {**self._zero(), **c} for v, c in state.items()}
