"""One generation round's draw of prompts: the sampler asked with the filters the selection
settings call for, and the selection's per-step statistics.

Without retiring, parking or predictive selection every prompt is eligible and a round is the
next stretch of the epoch stream (:class:`~dapo_lightning.data.sampler.PromptSampler`, the
paper's sampler; a round is at most one epoch). With any of them the draw is *distinct*: each
prompt at most once per round, a round never longer than the eligible prompts (no wrap-around),
retired prompts reviewed under predictive selection
(:meth:`~dapo_lightning.data.difficulty.PredictiveSelector.review`).
"""

from __future__ import annotations

from collections.abc import Callable

from dapo_lightning.data.difficulty import (
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
)
from dapo_lightning.data.sampler import PromptSampler

#: The review statistic's name; ``_count/`` + it is its denominator (drawn prompts).
REVIEW_FRAC = "data/review_frac"


def draw_round(
    sampler: PromptSampler,
    tracker: DifficultyTracker,
    selector: PredictiveSelector | None,
    selection: PromptSelectionConfig,
    uid_of: Callable[[int], str],
    count: int,
    stats: dict[str, float],
) -> tuple[list[int], list[int]]:
    """``count`` prompt indices (fewer when fewer are eligible) and the epochs they were drawn
    in. Adds the reviews among the newly drawn prompts (given-back ones aside) to
    ``stats[REVIEW_FRAC]`` and their number to ``stats["_count/" + REVIEW_FRAC]`` (the
    producer divides one by the other)."""
    if not (selection.retire_after or selection.park_after or selector is not None):
        idx = sampler.take(count)
    else:

        def eligible(i: int, epoch: int) -> bool:
            return tracker.eligible(uid_of(i), epoch)

        skip = review = None
        if selector is not None:

            def skip(i: int, epoch: int) -> bool:
                return not selector.take(tracker.stats.get(uid_of(i)), epoch)

            def review(i: int, epoch: int) -> bool:
                return selector.review(tracker.stats.get(uid_of(i)))

        idx = sampler.take(count, eligible, skip=skip, distinct=True, review=review)
    stats[REVIEW_FRAC] = stats.get(REVIEW_FRAC, 0.0) + sampler.last_reviews
    drawn = float(len(idx) - sampler.last_given_back)
    stats["_count/" + REVIEW_FRAC] = stats.get("_count/" + REVIEW_FRAC, 0.0) + drawn
    return idx, list(sampler.last_epochs)


def selection_stats(tracker: DifficultyTracker, stats: dict[str, float]) -> dict[str, float]:
    """The selection's per-step statistics, on every rank: ``data/regressed_frac``
    (:attr:`DifficultyTracker.regressed_frac`) and ``data/review_frac`` (reviews among the
    prompts drawn this step; 0 when none were drawn), with the retired and parked counts."""
    return {
        "data/retired": float(tracker.num_retired),
        "data/parked": float(tracker.num_parked),
        "data/regressed_frac": tracker.regressed_frac,
        REVIEW_FRAC: stats.get(REVIEW_FRAC, 0.0),
    }
