"""RoundCounts: a callback's per-round counts, taken by the rollout step that trains them
(with one-step-off rollouts the next batch's rounds are scored during the current step)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dapo_lightning.callbacks.round_counts import RoundCounts


def zero() -> dict[str, float]:
    return {"responses": 0.0, "truncated": 0.0}


def test_a_step_takes_its_own_rounds_not_the_next_batchs():
    counts = RoundCounts(zero)
    counts.add(3, {"responses": 16, "truncated": 1})  # batch k's two rounds (version 3)
    counts.add(3, {"responses": 16, "truncated": 0})
    counts.add(5, {"responses": 16, "truncated": 4})  # batch k+1, scored during step k
    assert counts.take(SimpleNamespace(policy_version=3)) == {"responses": 32.0, "truncated": 1.0}
    assert counts.take(SimpleNamespace(policy_version=3)) == zero()  # taken once
    assert counts.state_dict() == {5: {"responses": 16.0, "truncated": 4.0}}
    assert counts.take(SimpleNamespace(policy_version=5)) == {"responses": 16.0, "truncated": 4.0}


def test_state_round_trips_and_a_flat_legacy_state_goes_to_the_next_step():
    counts = RoundCounts(zero)
    counts.add(7, {"responses": 8})
    again = RoundCounts(zero)
    again.load_state_dict(counts.state_dict())
    assert again.take(SimpleNamespace(policy_version=7)) == {"responses": 8.0, "truncated": 0.0}
    legacy = RoundCounts(zero)
    legacy.load_state_dict({"responses": 4.0, "truncated": 2.0})  # pending before versions
    assert legacy.take(SimpleNamespace(policy_version=0)) == {"responses": 4.0, "truncated": 2.0}
    assert legacy.take(None) == zero()  # a batch without a version takes everything left


def test_adds_from_two_threads_are_all_counted():
    counts = RoundCounts(zero)

    def add_many(version: int) -> None:
        for _ in range(5000):
            counts.add(version, {"responses": 1.0})

    threads = [threading.Thread(target=add_many, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.take(SimpleNamespace(policy_version=2))["responses"] == 10000.0
