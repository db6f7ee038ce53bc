"""How many prompts the next generation round draws (``round_sizing``): :class:`RoundSizer`.

``fixed``: ``prompts_per_round / engine groups`` every round. ``kept_frac``: enough prompts for
the short ranks' mean missing groups at the kept fraction seen so far, over all ranks::

    frac  = (kept + 1) / (generated + 2)       (1 without a filter: every group is kept)
    want  = ceil(missing / short_ranks / frac)
    count = sized_round(want, floor, cap, one epoch of this rank's prompts)

where ``(kept, generated)`` are the agreed group counts, each round's added to the previous
ones decayed by :data:`~dapo_lightning.data.sampling.settings.KEPT_FRAC_DECAY`.
"""

from __future__ import annotations

import math

from dapo_lightning.data.sampling.rank_layout import RankLayout
from dapo_lightning.data.sampling.settings import KEPT_FRAC_DECAY, DynamicSamplingConfig
from dapo_lightning.data.selection.sampler import PromptSampler, sized_round


class RoundSizer:
    """The round size of one rank (equal on all ranks: every input is agreed over them).

    Args:
        config: The dynamic-sampling settings (``round_sizing``, ``prompts_per_round``,
            ``round_cap``, ``min_gen_batch_size``, ``filter_metric``).
        layout: This rank and its engine groups.
        sampler: This engine group's prompt sampler (one epoch caps a round).
    """

    def __init__(
        self, config: DynamicSamplingConfig, layout: RankLayout, sampler: PromptSampler
    ) -> None:
        self.config, self.layout, self.sampler = config, layout, sampler
        #: Prompts of one engine group's fixed round.
        self.local_gen = config.prompts_per_round // layout.groups
        #: Decayed (kept, generated) group counts over all ranks: the kept-fraction estimate.
        self.kept_estimate = [0.0, 0.0]

    def size(self, missing: int, short_ranks: int) -> int:
        """Prompts this rank draws next (module docstring): the fixed round with fixed sizing
        or no history yet, else enough for the short ranks' mean ``missing`` groups."""
        kept, generated = self.kept_estimate
        if self.config.round_sizing == "fixed" or generated <= 0 or short_ranks <= 0:
            return self.local_gen
        frac = 1.0 if self.config.filter_metric is None else (kept + 1.0) / (generated + 2.0)
        want = math.ceil(missing / short_ranks / frac)
        cap = max(1, self.config.round_cap // self.layout.groups)
        per_rank = self.sampler.num_prompts // self.sampler.world_size  # one epoch at most
        floor = math.ceil(self.config.min_gen_batch_size / self.layout.groups)
        return sized_round(want, floor, cap, per_rank)

    def observe(self, kept: int, generated: int) -> None:
        """Decay the agreed (kept, generated) counts by ``KEPT_FRAC_DECAY``, add a round's."""
        if generated > 0:
            k, g = self.kept_estimate
            self.kept_estimate = [KEPT_FRAC_DECAY * k + kept, KEPT_FRAC_DECAY * g + generated]
