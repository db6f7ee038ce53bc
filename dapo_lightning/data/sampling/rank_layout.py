"""Where this rank sits: its rank, the world size, and its tensor-parallel engine group.

Ranks ``tp_size`` apart from the start form one engine group (vLLM ``tensor_parallel_size``
under the external launcher): the ranks of a group submit the same prompts and receive the same
responses, and each trains on its own ``1 / tp_size`` of the group's batch
(:func:`member_rows`). Prompts are sharded over engine groups, not ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class RankLayout:
    """This rank's place among the ranks (see the module docstring).

    Args:
        rank: This rank.
        world_size: Number of ranks.
        tp_size: Ranks per tensor-parallel engine group (1: every rank its own engine).

    Raises:
        ValueError: ``tp_size`` does not divide ``world_size``.
    """

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} must divide the number of ranks "
                f"({self.world_size}): each engine group is tensor_parallel_size consecutive ranks."
            )

    @property
    def member(self) -> int:
        """This rank's place in its engine group (0: the group's first rank)."""
        return self.rank % self.tp_size

    @property
    def group(self) -> int:
        """This rank's engine group: the prompt shard it draws from."""
        return self.rank // self.tp_size

    @property
    def groups(self) -> int:
        """Number of engine groups (prompt shards)."""
        return self.world_size // self.tp_size


def member_rows(group_index: Tensor, member: int, tp_size: int) -> list[int]:
    """Rows of tensor-parallel rank ``member``'s share of an engine group's batch: its
    1 / tp_size of the groups, as evenly as possible (all of them when ``tp_size`` is 1)."""
    groups = int(group_index[-1]) + 1 if len(group_index) else 0
    base, extra = divmod(groups, tp_size)
    first = member * base + min(member, extra)
    last = first + base + (member < extra)
    return ((group_index >= first) & (group_index < last)).nonzero().flatten().tolist()
