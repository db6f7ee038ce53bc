"""The carry-over: kept groups beyond one batch, held for the next rollout step.

A round can keep more groups than the batch needs (a sized round's overshoot, the groups an
in-flight round had started). With ``dynamic_sampling.carry_over`` at most one more batch of
them is carried, each response stamped with the policy version it was sampled with; the rest is
dropped and counted (``data/dropped_surplus_groups``). At the next step carried groups older
than ``max_staleness`` versions are dropped (``data/dropped_stale_groups``) and the others fill
the batch first. The carried groups are in the checkpoint; a checkpoint whose groups have
another size than today's ``n`` has them dropped on load, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.data.sampling.groups import group_sizes
from dapo_lightning.data.sampling.settings import DYNAMIC_SAMPLING_PATH, DynamicSamplingConfig
from dapo_lightning.data.sampling.step_stats import StepStats

log = logging.getLogger(__name__)

#: Groups and the sample version of each of their responses.
VersionedGroups = tuple[ScoredRollouts, list[int]]


class CarryOver:
    """Kept groups beyond the batch, held for the next step (see the module docstring).

    Args:
        config: The dynamic-sampling settings (``n``, ``carry_over``, ``max_staleness``).
    """

    def __init__(self, config: DynamicSamplingConfig) -> None:
        self.config = config
        self.groups: list[VersionedGroups] = []

    def take(self, policy_version: int, stats: StepStats) -> list[VersionedGroups]:
        """Hand over the carried groups within ``max_staleness`` of ``policy_version`` (the
        others are dropped and counted); nothing is carried afterwards."""
        kept, limit = [], self.config.max_staleness
        for rollouts, versions in self.groups:
            if limit is not None and policy_version - min(versions) > limit:
                stats.dropped_stale_groups += float(rollouts.num_groups)
                continue
            kept.append((rollouts, versions))
        self.groups = []
        return kept

    def keep_surplus(
        self, rollouts: ScoredRollouts, versions: list[int], batch_groups: int, stats: StepStats
    ) -> int:
        """Carry the groups of ``rollouts`` after the first ``batch_groups`` (at most one batch
        of them with ``carry_over``, none without; what is over is dropped and counted).

        Returns:
            The number of rows of the batch's groups (``rollouts``' first rows).
        """
        end = int((rollouts.group_index < batch_groups).sum())
        bound = 2 * batch_groups if self.config.carry_over else batch_groups
        stop = int((rollouts.group_index < bound).sum())
        if stop > end:
            self.groups = [(rollouts.select(list(range(end, stop))), versions[end:stop])]
        if stop < len(rollouts):
            stats.dropped_surplus_groups += float(rollouts.num_groups - bound)
        return end

    @property
    def num_groups(self) -> int:
        """Groups carried now."""
        return self.groups[0][0].num_groups if self.groups else 0

    def state_dict(self) -> list[tuple[dict[str, Any], list[int]]]:
        """The carried groups as plain containers (``torch.load(weights_only=True)`` reads them)."""
        return [(r.state_dict(), v) for r, v in self.groups]

    def load_state_dict(self, state: list[tuple[dict[str, Any], list[int]]]) -> None:
        """Restore :meth:`state_dict`'s groups; groups of another size than ``n`` (the run
        resumed with a changed ``dynamic_sampling.n``) are dropped, with a warning."""
        groups = [(ScoredRollouts.from_state_dict(r), list(v)) for r, v in state]
        n = self.config.n
        sizes = set().union(*(group_sizes(r.group_index) for r, _ in groups))
        if sizes - {n}:
            dropped = sum(r.num_groups for r, _ in groups)
            log.warning(
                "%s.n changed from %s to %d since the checkpoint: its %d carried-over groups "
                "of the old size are dropped (never trained on); new groups have n=%d responses.",
                DYNAMIC_SAMPLING_PATH,
                "/".join(str(s) for s in sorted(sizes)),
                n,
                dropped,
                n,
            )
            groups = []
        self.groups = groups
