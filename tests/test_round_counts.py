"""RoundCounts: a callback's per-round counts, taken by the rollout step that trains them
(with one-step-off rollouts the next batch's rounds are scored during the current step), and
the batch index the producer stamps on every round and batch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dapo_lightning.callbacks.round_counts import BY_BATCH, RoundCounts


def zero() -> dict[str, float]:
    return {"responses": 0.0, "truncated": 0.0}


def batch(index: int) -> SimpleNamespace:
    return SimpleNamespace(batch_index=index)


def test_a_step_takes_its_own_rounds_not_the_next_batchs():
    counts = RoundCounts(zero)
    counts.add(3, {"responses": 16, "truncated": 1})  # batch 3's two rounds
    counts.add(3, {"responses": 16, "truncated": 0})
    counts.add(4, {"responses": 16, "truncated": 4})  # batch 4, scored during step 3
    assert counts.take(batch(3)) == {"responses": 32.0, "truncated": 1.0}
    assert counts.take(batch(3)) == zero()  # taken once
    assert counts.state_dict() == {BY_BATCH: {4: {"responses": 16.0, "truncated": 4.0}}}
    assert counts.take(batch(4)) == {"responses": 16.0, "truncated": 4.0}


def test_discard_drops_the_rounds_of_a_batch_and_later_ones_only():
    counts = RoundCounts(zero)
    counts.add(2, {"responses": 8, "truncated": 1})  # the step under way
    counts.add(3, {"responses": 16})  # the next batch, two rounds
    counts.add(3, {"responses": 4, "truncated": 2})
    counts.add(4, {"responses": 2})
    counts.discard(3)  # the producer went back to before batch 3
    assert counts.state_dict() == {BY_BATCH: {2: {"responses": 8.0, "truncated": 1.0}}}
    counts.add(3, {"responses": 16})  # batch 3 scored again: counted once
    assert counts.take(batch(3)) == {"responses": 24.0, "truncated": 1.0}


def test_state_round_trips_and_older_states_go_to_the_next_step():
    counts = RoundCounts(zero)
    counts.add(7, {"responses": 8})
    again = RoundCounts(zero)
    again.load_state_dict(counts.state_dict())
    assert again.take(batch(6)) == zero()
    assert again.take(batch(7)) == {"responses": 8.0, "truncated": 0.0}
    flat = RoundCounts(zero)
    flat.load_state_dict({"responses": 4.0, "truncated": 2.0})  # pending before versions
    assert flat.take(batch(0)) == {"responses": 4.0, "truncated": 2.0}
    assert flat.take(None) == zero()  # a batch without an index takes everything left
    per_version = RoundCounts(zero)  # kept per policy version (before batch indices)
    per_version.load_state_dict({3: {"responses": 16.0, "truncated": 1.0}, 5: {"responses": 8.0}})
    assert per_version.take(batch(0)) == {"responses": 24.0, "truncated": 1.0}


def test_adds_from_two_threads_are_all_counted():
    counts = RoundCounts(zero)

    def add_many(index: int) -> None:
        for _ in range(5000):
            counts.add(index, {"responses": 1.0})

    threads = [threading.Thread(target=add_many, args=(b,)) for b in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.take(batch(2))["responses"] == 10000.0
