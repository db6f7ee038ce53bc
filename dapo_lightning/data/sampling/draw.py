"""One generation round's draw of prompts: the sampler asked with the filters the selection
settings call for, and the selection's per-step statistics.

Without retiring, parking or predictive selection every prompt is eligible and a round is the
next stretch of the epoch stream (:class:`~dapo_lightning.data.selection.sampler.PromptSampler`, the
paper's sampler; a round is at most one epoch). With any of them the draw is *distinct*: each
prompt at most once per round, a round never longer than the eligible prompts (no wrap-around),
retired prompts reviewed (:meth:`~dapo_lightning.data.selection.difficulty.PredictiveSelector.review`,
under either strategy).
"""

from __future__ import annotations

from collections.abc import Callable

from dapo_lightning.data.sampling.step_stats import StepStats
from dapo_lightning.data.selection.difficulty import (
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
)
from dapo_lightning.data.selection.sampler import PromptSampler


def draw_round(
    sampler: PromptSampler,
    tracker: DifficultyTracker,
    selector: PredictiveSelector | None,
    selection: PromptSelectionConfig,
    uid_of: Callable[[int], str],
    count: int,
    stats: StepStats,
    *,
    predictive: bool,
) -> tuple[list[int], list[int]]:
    """``count`` prompt indices (fewer when fewer are eligible) and the epochs they were drawn
    in: ``selector`` reviews retired prompts, and skips predicted zero-variance ones when
    ``predictive``. Counts the reviews among the newly drawn prompts (given-back ones aside) and
    the drawn prompts in ``stats`` (:meth:`StepStats.finish` divides one by the other)."""
    if not (selection.retire_after or selection.park_after or selector is not None):
        idx = sampler.take(count)
    else:

        def eligible(i: int, epoch: int) -> bool:
            return tracker.eligible(uid_of(i), epoch)

        skip = review = None
        if selector is not None and predictive:

            def skip(i: int, epoch: int) -> bool:
                return not selector.take(tracker.stats.get(uid_of(i)), epoch)

        if selector is not None:

            def review(i: int, epoch: int) -> bool:
                return selector.review(tracker.stats.get(uid_of(i)))

        idx = sampler.take(count, eligible, skip=skip, distinct=True, review=review)
    stats.reviews += sampler.last_reviews
    stats.drawn += float(len(idx) - sampler.last_given_back)
    return idx, list(sampler.last_epochs)


def selection_stats(tracker: DifficultyTracker, stats: StepStats) -> None:
    """Set the selection's per-step statistics, on every rank: the retired and parked counts
    and ``data/regressed_frac`` (:attr:`DifficultyTracker.regressed_frac`)."""
    stats.retired = float(tracker.num_retired)
    stats.parked = float(tracker.num_parked)
    stats.regressed_frac = tracker.regressed_frac
