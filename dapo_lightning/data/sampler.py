"""Which prompts a rank draws next: a rank-strided shard of a seeded permutation per epoch.

Epoch ``e`` orders the ``N`` prompts by a permutation seeded with ``(seed, e)``; rank ``r`` of
``W`` takes positions ``r, r + W, r + 2W, ...`` of it, cut to ``N // W`` prompts so every rank
has an equally long epoch. Ranks therefore draw disjoint prompts within an epoch, and the whole
state is ``(epoch, cursor, pending)``: the permutation is recomputed, never stored. ``pending``
holds prompts drawn but not generated (a round stopped before their requests ran, e.g. the
vLLM in-flight path once the batch is full): :meth:`PromptSampler.give_back` puts them there
and the next :meth:`PromptSampler.take` returns them first, so a stopped round skips no prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
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
        #: The epoch each index of the last :meth:`take` was drawn in (given-back ones: theirs).
        self.last_epochs: list[int] = []

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
    ) -> list[int]:
        """The next ``k`` indices for which ``eligible(index, epoch)`` holds (all when None).

        Given-back prompts (:meth:`give_back`) come first. Ineligible prompts are passed over
        for this epoch; so are eligible ones for which ``skip(index, epoch)`` is True (a chosen
        skip: predictive selection), which still count as eligible. Raises when
        ``max_empty_epochs`` whole epochs in a row offer no eligible prompt (everything retired
        or parked).
        """
        out = [i for i, _ in self.pending[:k]]
        epochs = [e for _, e in self.pending[:k]]
        self.pending = self.pending[k:]
        empty_epochs = 0
        found_this_epoch = self.cursor > 0
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
                self.epoch += 1
                self.cursor = 0
                found_this_epoch = False
                continue
            idx = shard[self.cursor]
            self.cursor += 1
            if eligible is None or eligible(idx, self.epoch):
                found_this_epoch = True
                empty_epochs = 0
                if skip is None or not skip(idx, self.epoch):
                    out.append(idx)
                    epochs.append(self.epoch)
        self.last_epochs = epochs
        return out

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self.pending = [(int(i), int(e)) for i, e in state.get("pending", [])]
        self._order_cache = None
