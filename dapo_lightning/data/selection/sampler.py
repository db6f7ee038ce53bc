"""Which prompts a rank draws next: a rank-strided shard of a seeded permutation per epoch.

Epoch ``e`` orders the ``N`` prompts by a permutation seeded with ``(seed, e)``; rank ``r`` of
``W`` takes positions ``r, r + W, r + 2W, ...`` of it, cut to ``N // W`` prompts so every rank
has an equally long epoch. Ranks therefore draw disjoint prompts within an epoch, and the whole
state is ``(epoch, cursor, pending, deferred)``: the permutation is recomputed, never stored.
``pending`` holds prompts drawn but not generated (a round stopped before their requests ran, e.g. the
vLLM in-flight path once the batch is full): :meth:`PromptSampler.give_back` puts them there
and the next :meth:`PromptSampler.take` returns them first, so a stopped round skips no prompt.

No wrap-around: a *distinct* draw (the producer asks for one whenever prompts can be retired,
parked or skipped) takes each prompt at most once and stops at the end of the first epoch it
scanned whole, so a round never holds a prompt twice however few prompts are eligible (before,
with 2 eligible prompts left, a sized round of ~30 held each about 15 times: a prompt's history
changes only after its round). A prompt whose turn in the next epoch comes inside the draw that
took it is *deferred*: the next draw asks it first, in that epoch, so it keeps its visit per
epoch (``deferred`` is part of the state, like ``pending``). A plain draw (no filter: every prompt eligible, a round at most
one epoch) is the paper's epoch stream, unchanged: a round across an epoch boundary may hold a
prompt from the end of one epoch and again from the start of the next.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any


class PromptsExhausted(RuntimeError):
    """No prompt is eligible any more (every prompt retired or parked)."""


class PromptSampler:
    """Draws prompt indices for one rank, epoch after epoch.

    Args:
        num_prompts: Prompts in the dataset (all ranks see the same list).
        seed: Seeds the per-epoch permutations.
        rank: This rank (0-based).
        world_size: Number of ranks.
        shuffle: False keeps file order (still rank-strided).
    """

    def __init__(
        self,
        num_prompts: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if num_prompts < world_size:
            raise ValueError(
                f"{num_prompts} prompts cannot be sharded over {world_size} ranks: add prompts."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        self.num_prompts = num_prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order_cache: tuple[int, list[int]] | None = None
        self.pending: list[tuple[int, int]] = []  # (index, epoch it was drawn in)
        #: Repeats a distinct draw passed over: (index, epoch of that turn), asked next draw.
        self.deferred: list[tuple[int, int]] = []
        #: The epoch each index of the last :meth:`take` was drawn in (given-back ones: theirs).
        self.last_epochs: list[int] = []
        #: Of the last :meth:`take`: given-back prompts returned first, and reviews taken.
        self.last_given_back = 0
        self.last_reviews = 0

    def shard(self, epoch: int) -> list[int]:
        """This rank's prompt indices for ``epoch``, in draw order."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        per_rank = self.num_prompts // self.world_size
        shard = order[self.rank :: self.world_size][:per_rank]
        self._order_cache = (epoch, shard)
        return shard

    def take(
        self,
        k: int,
        eligible: Callable[[int, int], bool] | None = None,
        max_empty_epochs: int = 2,
        skip: Callable[[int, int], bool] | None = None,
        *,
        distinct: bool = False,
        review: Callable[[int, int], bool] | None = None,
    ) -> list[int]:
        """The next ``k`` indices for which ``eligible(index, epoch)`` holds (all when None).

        Given-back prompts (:meth:`give_back`) come first, then the repeats the last draw
        deferred, asked again now. Ineligible prompts are passed over for this epoch unless
        ``review(index, epoch)`` takes one back (a review of a retired prompt; reviews do not
        make an epoch non-empty); eligible ones for which ``skip(index, epoch)`` is True (a
        chosen skip: predictive selection) are passed over too, and still count as eligible.
        ``distinct``: each index at most once. An eligible prompt whose turn comes (in the
        next epoch) after it was taken is deferred, not asked: the next draw asks it first,
        in that epoch, with the history of the visit just drawn; and the draw ends, with
        fewer than ``k`` if need be, at the end of the first epoch it scanned from its start
        once it holds a prompt (every eligible prompt has had its turn: no wrap-around).
        Raises when ``max_empty_epochs`` whole epochs in a row offer no eligible prompt
        (everything retired or parked).
        """
        out = [i for i, _ in self.pending[:k]]
        epochs = [e for _, e in self.pending[:k]]
        self.pending = self.pending[k:]
        self.last_given_back, self.last_reviews = len(out), 0
        taken = set(out) if distinct else None
        turn = partial(self._turn, eligible=eligible, skip=skip, review=review, taken=taken)
        self._ask_deferred(k, out, epochs, turn)
        self._scan_epochs(
            k, out, epochs, turn, max_empty_epochs=max_empty_epochs, distinct=distinct
        )
        self.last_epochs = epochs
        return out

    def _ask_deferred(
        self, k: int, out: list[int], epochs: list[int], turn: Callable[[int, int], str | None]
    ) -> None:
        """Ask the repeats the last draw deferred, in their epochs, while ``out`` holds fewer
        than ``k``; the rest stay deferred. Taken ones are appended to ``out`` / ``epochs``."""
        deferred, self.deferred = self.deferred, []
        for idx, epoch in deferred:
            if len(out) >= k:
                self.deferred.append((idx, epoch))
            elif turn(idx, epoch) in ("take", "review"):
                out.append(idx)
                epochs.append(epoch)

    def _scan_epochs(
        self,
        k: int,
        out: list[int],
        epochs: list[int],
        turn: Callable[[int, int], str | None],
        *,
        max_empty_epochs: int,
        distinct: bool,
    ) -> None:
        """Walk the shards from the cursor, epoch after epoch, appending the prompts taken to
        ``out`` / ``epochs`` until ``out`` holds ``k``, or (``distinct``) the first epoch
        scanned from its start ends with ``out`` non-empty. Raises :class:`PromptsExhausted`
        after ``max_empty_epochs`` epochs in a row without an eligible prompt."""
        empty_epochs = 0
        found_this_epoch = self.cursor > 0
        whole_epoch = self.cursor == 0  # this draw scans the current epoch from its start
        while len(out) < k:
            shard = self.shard(self.epoch)
            if self.cursor >= len(shard):
                if not found_this_epoch:
                    empty_epochs += 1
                    if empty_epochs >= max_empty_epochs:
                        raise PromptsExhausted(
                            f"no prompt is eligible for {empty_epochs} epochs in a row: every "
                            "prompt is retired or parked. Add prompts, raise retire_after / "
                            "park_after, or lower revisit_every."
                        )
                elif distinct and whole_epoch and out:
                    break  # every eligible prompt had its turn in this draw
                self.epoch += 1
                self.cursor = 0
                found_this_epoch, whole_epoch = False, True
                continue
            idx = shard[self.cursor]
            self.cursor += 1
            turn_taken = turn(idx, self.epoch)
            if turn_taken is not None and turn_taken != "review":
                found_this_epoch = True
                empty_epochs = 0
            if turn_taken in ("take", "review"):
                out.append(idx)
                epochs.append(self.epoch)

    def _turn(
        self,
        idx: int,
        epoch: int,
        eligible: Callable[[int, int], bool] | None,
        skip: Callable[[int, int], bool] | None,
        review: Callable[[int, int], bool] | None,
        taken: set[int] | None,
    ) -> str | None:
        """Prompt ``idx``'s turn in ``epoch``: ``"take"``, ``"review"``, ``"pass"`` (eligible,
        passed over: skipped, or deferred as a repeat of this draw) or None (not eligible).
        A prompt taken is added to ``taken`` (distinct draws)."""
        repeat = taken is not None and idx in taken
        if eligible is None or eligible(idx, epoch):
            if repeat:
                self.deferred.append((idx, epoch))
                return "pass"
            if skip is not None and skip(idx, epoch):
                return "pass"
            turn = "take"
        elif repeat or review is None or not review(idx, epoch):
            return None
        else:
            turn = "review"
            self.last_reviews += 1
        if taken is not None:
            taken.add(idx)
        return turn

    def give_back(self, indices: list[int], epochs: list[int]) -> None:
        """Prompts drawn (in ``epochs``) but not generated: the next :meth:`take` returns them
        first, in order, with their draw epochs."""
        self.pending = [(int(i), int(e)) for i, e in zip(indices, epochs)] + self.pending

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "pending": [list(p) for p in self.pending],
            "deferred": [list(p) for p in self.deferred],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self.pending = [(int(i), int(e)) for i, e in state.get("pending", [])]
        self.deferred = [(int(i), int(e)) for i, e in state.get("deferred", [])]
        self._order_cache = None


def sized_round(want: int, floor: int, cap: int, per_rank: int) -> int:
    """Prompts one engine group draws in a sized round (``round_sizing: kept_frac``)::

        max(1, min(max(want, floor), cap, per_rank))

    ``want``: enough for the missing groups at the kept fraction; ``floor``: the smallest
    efficient engine call (``min_gen_batch_size`` per engine group: the vLLM engine on CPU ran
    114 / 128 / 134 / 148 / 140 tokens/s at 2 / 4 / 8 / 16 / 32 prompts per call, so a 2-prompt
    round runs at 0.77x of a 16-prompt one); ``cap``: ``max_gen_batch_size`` per engine group;
    ``per_rank``: one epoch of the group's prompts. A distinct draw
    (:meth:`PromptSampler.take`) holds no more prompts than are eligible, so a round is never
    above those either; the floor gives way to the cap and to the epoch.
    """
    return max(1, min(max(want, floor), cap, per_rank))
