"""PromptSampler draws (issue 40): no wrap-around inside a round, repeats deferred to their
epoch, the plain epoch stream unchanged, and the sized round's floor."""

from __future__ import annotations

import random

import pytest

from dapo_lightning.data.selection.sampler import PromptSampler, PromptsExhausted, sized_round


def epoch_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s order of a one-rank sampler, computed here: the seeded shuffle."""
    order = list(range(num_prompts))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def stream(num_prompts: int, seed: int, epochs: int) -> list[tuple[int, int]]:
    """(index, epoch) of the plain epoch stream, epoch after epoch."""
    return [(i, e) for e in range(epochs) for i in epoch_order(num_prompts, seed, e)]


def test_two_eligible_prompts_are_each_drawn_at_most_once_per_round():
    """A round of 30 on a pool where 2 of 10 prompts are eligible holds each of them once,
    round after round (before: ~15 times each, wrapping around the epochs inside one draw)."""
    s = PromptSampler(10, seed=3)
    live = {2, 7}
    for _ in range(6):
        got = s.take(30, lambda i, e: i in live, distinct=True)
        assert sorted(got) == [2, 7], got
    # the plain draw of today wraps around: asked for 30 it returns 30
    plain = PromptSampler(10, seed=3).take(30, lambda i, e: i in live)
    assert len(plain) == 30 and plain.count(2) + plain.count(7) == 30


def test_a_repeat_is_deferred_to_the_next_draw_in_its_own_epoch():
    """The draw that took prompt x at the end of epoch 0 meets x again in epoch 1: x is not
    taken twice; the next draw asks it first, stamped with epoch 1 (its visit per epoch)."""
    n, seed = 8, 0
    e0, e1 = epoch_order(n, seed, 0), epoch_order(n, seed, 1)
    # a cursor from which the round of 5 crosses the boundary and meets a repeat
    for start in range(1, n):
        tail = e0[start:]
        head = e1[: 5 - len(tail)]
        if set(tail) & set(head) and len(tail) < 5:
            break
    else:
        pytest.fail("no boundary with a repeat for this seed")
    s = PromptSampler(n, seed=seed)
    s.take(start)  # plain: positions 0 .. start-1 of epoch 0
    got = s.take(5, lambda i, e: True, distinct=True)
    assert len(got) == len(set(got)) == 5
    repeats = [i for i in e1 if i in tail]
    expected = tail + [i for i in e1 if i not in tail][: 5 - len(tail)]
    assert got == expected
    assert s.last_epochs == [0] * len(tail) + [1] * (5 - len(tail))
    deferred = [(i, 1) for i in e1[: s.cursor] if i in tail]
    assert s.deferred == deferred and deferred
    nxt = s.take(len(deferred), lambda i, e: True, distinct=True)
    assert nxt == [i for i, _ in deferred] and s.last_epochs == [1] * len(deferred)
    assert set(repeats) >= set(nxt)
    # deferred repeats are state: saved and restored like the given-back prompts
    s2 = PromptSampler(n, seed=seed)
    s2.take(start)
    s2.take(5, lambda i, e: True, distinct=True)
    state = s2.state_dict()
    s3 = PromptSampler(n, seed=seed)
    s3.load_state_dict(state)
    assert s3.deferred == deferred
    assert s3.take(len(deferred), lambda i, e: True, distinct=True) == nxt


def test_uniform_draws_over_an_epoch_boundary_are_unchanged_when_the_pool_is_larger():
    """The plain draw (no filter; the quickstart's uniform selection without retiring) is the
    epoch stream: rounds of 7 and 11 over 40 prompts cross epoch boundaries and take exactly
    the next positions, a prompt from the end of one epoch again at the start of the next
    included. A distinct draw with every prompt eligible takes the same prompts whenever
    no prompt repeats within the round."""
    n, seed = 40, 0
    ref = stream(n, seed, 8)
    s = PromptSampler(n, seed=seed)
    pos, sizes, crossed_with_repeat = 0, [7, 11] * 12, 0
    for k in sizes:
        got = s.take(k)
        assert list(zip(got, s.last_epochs)) == ref[pos : pos + k]
        crossed_with_repeat += len(set(got)) < k
        pos += k
    assert s.epoch == 5 and crossed_with_repeat == 1  # the 10th round: a prompt twice
    d = PromptSampler(n, seed=seed)
    pos = 0
    for k in sizes:
        window = ref[pos : pos + k]
        if len({i for i, _ in window}) < k:
            break  # the first round with a repeat: from here the two differ
        got = d.take(k, lambda i, e: True, distinct=True)
        assert list(zip(got, d.last_epochs)) == window
        pos += k
    assert pos == 7 + 11 + 7 + 11 + 7 + 11 + 7 + 11 + 7  # the 5th round crossed epoch 0's end


def test_reviews_are_taken_from_ineligible_prompts_and_do_not_keep_the_pool_alive():
    s = PromptSampler(6, seed=1)
    retired = {0, 1, 2, 3}
    asked: list[int] = []

    def review(i, e):
        asked.append(i)
        return i == 0

    got = s.take(10, lambda i, e: i not in retired, distinct=True, review=review)
    assert sorted(got) == [0, 4, 5] and s.last_reviews == 1
    assert set(asked) == retired
    # every prompt retired: reviews alone leave the epochs empty and the pool is exhausted
    s2 = PromptSampler(6, seed=1)
    with pytest.raises(PromptsExhausted):
        s2.take(10, lambda i, e: False, distinct=True, review=lambda i, e: True)


@pytest.mark.parametrize(
    "want, floor, cap, per_rank, expected",
    [
        (2, 8, 64, 80, 8),  # the floor lifts a tiny second round
        (30, 8, 64, 80, 30),  # above the floor: the kept-fraction estimate
        (100, 8, 64, 80, 64),  # the cap
        (100, 8, 200, 80, 80),  # one epoch at most
        (2, 16, 8, 80, 8),  # the floor gives way to the cap
        (2, 16, 64, 10, 10),  # and to the epoch
        (0, 1, 64, 80, 1),  # never empty
        (5, 1, 64, 80, 5),  # the default floor 1 leaves the estimate as it was
    ],
)
def test_sized_round_pins_hand_computed_sizes(want, floor, cap, per_rank, expected):
    assert sized_round(want, floor, cap, per_rank) == expected
