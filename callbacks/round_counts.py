"""RoundCounts: what a callback counts in ``on_rollouts_scored``, kept until the rollout step
that trains those rollouts.

A callback that tallies each scored round (truncated responses, answer-less ones) and reports
the tally when a rollout step ends must know which step the round belongs to. In ``sync`` mode
a step's rounds are scored right before it; with one-step-off rollouts the next batch's rounds
are scored on the rollout thread *while* the current batch trains, so "everything since the
last step" would split the two batches between steps by timing (and two threads would update
one dict). Each round is therefore kept under the batch it was generated for
(``ScoredRollouts.batch_index``, the producer's count), and a step takes the rounds of its
batch and earlier ones (``RolloutBatch.batch_index``): never the next batch's, even where both
were sampled with the same weights (the first two batches of a one-step-off run, or a step
whose updates were all skipped). When the producer goes back to before a batch (a stop during
its generation, or one that undid the step training it), ``on_rollouts_discarded`` drops that
batch's rounds and later ones (:meth:`RoundCounts.discard`): they are scored again, and
counted once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

Counts = dict[str, float]

#: The key under which :meth:`RoundCounts.state_dict` keeps its counts; a checkpoint without it
#: was written when the counts were kept per policy version (or flat).
BY_BATCH = "by_batch"


class RoundCounts:
    """Counts per rollout batch, added from any thread, taken per rollout step.

    Args:
        zero: The counts of no round (the keys every ``take`` returns).
    """

    def __init__(self, zero: Callable[[], Counts]) -> None:
        self._zero = zero
        self._by_batch: dict[int, Counts] = {}
        self._lock = threading.Lock()

    def add(self, batch_index: int, counts: Mapping[str, float]) -> None:
        """Add one round's ``counts`` under the batch its rollouts were generated for."""
        with self._lock:
            total = self._by_batch.setdefault(int(batch_index), self._zero())
            for key, value in counts.items():
                total[key] = total.get(key, 0.0) + float(value)

    def take(self, batch: Any) -> Counts:
        """The sum of the rounds generated for ``batch.batch_index`` or an earlier batch (the
        rounds of the rollout step training ``batch``), removed; all of them for a batch
        without an index (a test's stand-in)."""
        index = getattr(batch, "batch_index", None)
        out = self._zero()
        with self._lock:
            for b in [b for b in self._by_batch if index is None or b <= index]:
                for key, value in self._by_batch.pop(b).items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def discard(self, batch_index: int) -> None:
        """Drop the rounds of ``batch_index`` and later batches (``on_rollouts_discarded``: the
        producer went back to before them, so they are scored again)."""
        with self._lock:
            self._by_batch = {b: c for b, c in self._by_batch.items() if b < batch_index}

    def state_dict(self) -> dict[str, dict[int, Counts]]:
        with self._lock:
            return {BY_BATCH: {b: dict(c) for b, c in self._by_batch.items()}}

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        """Counts saved by :meth:`state_dict`. An older checkpoint's counts (kept per policy
        version, or one flat dict) are the rounds of the step under way: index -1, taken by the
        next step."""
        with self._lock:
            if BY_BATCH in state:
                saved = state[BY_BATCH]
                self._by_batch = {int(b): {**self._zero(), **c} for b, c in saved.items()}
                return
            older = self._zero()
            flat = all(isinstance(v, (int, float)) for v in state.values())
            for counts in [state] if flat else state.values():
                for key, value in counts.items():
                    older[key] = older.get(key, 0.0) + float(value)
            self._by_batch = {-1: older} if state else {}
