"""One generation round of this rank: draw prompts, sample, score, shape, keep the groups with
variance (DAPO's dynamic-sampling filter).

A round draws its prompts through the :class:`~dapo_lightning.data.selection.sampler.PromptSampler`
(retired and parked prompts skipped, predictive selection's skips), samples and scores them
(:class:`~dapo_lightning.data.sampling.scoring.RolloutScorer`), records every visit in the
:class:`~dapo_lightning.data.selection.difficulty.DifficultyTracker`, puts a demonstration into each
group with no right answer (``environment.demonstrate_unsolved``: the first episode is
replaced by the environment's, scored the same way), calls ``on_scored`` (shaping) and keeps
the groups whose filter metric varies. With an engine that streams groups
(``stream_groups``) and ``in_flight``, groups are scored as they finish and the round stops
starting new ones once the batch is full. :class:`~dapo_lightning.data.sampling.producer.RolloutProducer`
runs rounds until the batch is full, in lockstep over ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapo_lightning.batch import FILTER_DECISION, ScoredRollouts
from dapo_lightning.data.sampling.draw import draw_round
from dapo_lightning.data.sampling.groups import (
    concat_rollouts,
    filter_decisions,
    group_has_variance,
    group_max,
    replace_rows,
)
from dapo_lightning.data.sampling.scoring import RolloutScorer
from dapo_lightning.data.sampling.settings import DynamicSamplingConfig
from dapo_lightning.data.sampling.step_stats import StepStats
from dapo_lightning.data.selection.difficulty import DifficultyTracker, PredictiveSelector
from dapo_lightning.data.selection.sampler import PromptSampler
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rollout.base import DRAIN, Completion, SamplingConfig

#: Plays the environment's demonstration of each record: a completion, or None where none.
Demonstrate = Callable[[Sequence[PromptRecord]], list[Completion | None]]


@dataclass(frozen=True)
class RoundHooks:
    """What the producer tells its owner about its rounds (the data module passes the DAPO
    callbacks' ``on_rollouts_scored`` and ``on_rollouts_discarded``).

    Args:
        scored: Called with every round's scored rollouts before the filter (shaping).
        discarded: Called with a batch index when the producer goes back to before that batch
            (a rewind, or an exception inside ``next_batch``): the rounds ``scored`` saw for it
            and for later batches are void (they are scored again).
    """

    scored: Callable[[ScoredRollouts], None] | None = None
    discarded: Callable[[int], None] | None = None


class GenerationRounds:
    """Runs one generation round at a time for one rank (see the module docstring).

    Args:
        records: Training prompts, tokenized.
        config: The dynamic-sampling settings (``n``, ``filter_metric``, ``in_flight``).
        sampling: Sampling settings of training rollouts.
        scorer: Samples and scores.
        sampler: Draws prompt indices (this rank's shard).
        tracker: Per-prompt statistics (retire, park, predictive selection), or None.
        selector: Predictive selection and reviews of retired prompts, or None.
        on_scored: Called with every round's scored rollouts before the filter (shaping).
        demonstrations: Plays demonstrations for the groups with no right answer (None: off).
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        config: DynamicSamplingConfig,
        sampling: SamplingConfig,
        scorer: RolloutScorer,
        sampler: PromptSampler,
        *,
        tracker: DifficultyTracker | None,
        selector: PredictiveSelector | None,
        on_scored: Callable[[ScoredRollouts], None] | None,
        demonstrations: Demonstrate | None = None,
    ) -> None:
        self.records = list(records)
        self.config = config
        self.sampling = sampling
        self.scorer = scorer
        self.session = scorer.session
        self.sampler = sampler
        self.tracker = tracker
        self.selector = selector
        self.on_scored = on_scored
        self.demonstrations = demonstrations
        self.drawn_uids: list[str] = []  # uids drawn since the producer's batch began
        #: The producer's batch these rounds generate for (stamped on each round's rollouts).
        self.batch_index = 0

    def _draw(self, count: int, stats: StepStats) -> tuple[list[int], list[int]]:
        """``count`` prompt indices and the epochs they were drawn in (:func:`draw_round`)."""

        def uid_of(i: int) -> str:
            return self.records[i].uid

        cfg = self.config
        return draw_round(
            self.sampler, self.tracker, self.selector, cfg.selection, uid_of, count, stats,
            predictive=cfg.predictive,
        )  # fmt: skip

    def _filter(
        self,
        records: list[PromptRecord],
        epochs: list[int],
        rollouts: ScoredRollouts,
        stats: StepStats,
    ) -> ScoredRollouts | None:
        """Record the visits (in the epochs they were drawn in), shape, keep groups with
        variance (each response's decision in ``extra[FILTER_DECISION]``)."""
        if self.tracker is not None:
            per_group: list[list[float]] = [[] for _ in records]
            for g, a in zip(rollouts.group_index.tolist(), rollouts.acc.tolist()):
                per_group[g].append(a)
            for rec, accs, epoch in zip(records, per_group, epochs):
                self.tracker.update(rec.uid, accs, epoch)
        if self.demonstrations is not None:
            rollouts = demonstrate_unsolved(
                records, rollouts, self.demonstrations, self.scorer, self.sampling, stats
            )
        rollouts.batch_index = self.batch_index
        if self.on_scored is not None:
            self.on_scored(rollouts)
        stats.generated_groups += float(len(records))
        metric = self.config.filter_metric
        if metric is None:
            stats.kept_groups += float(len(records))
            rollouts.extra[FILTER_DECISION] = ["kept"] * len(rollouts)
            return rollouts
        keep_group = group_has_variance(getattr(rollouts, metric), rollouts.group_index)
        rollouts.extra[FILTER_DECISION] = filter_decisions(
            getattr(rollouts, metric), rollouts.group_index, keep_group, metric
        )
        stats.kept_groups += float(keep_group.sum())
        keep_idx = keep_group[rollouts.group_index].nonzero().flatten().tolist()
        return rollouts.select(keep_idx) if keep_idx else None

    def run(
        self, count: int, need: int, policy_version: int, stats: StepStats
    ) -> ScoredRollouts | None:
        """One generation round of ``count`` prompts: draw, sample, score, shape, filter.

        With a streaming engine (``in_flight``) the round stops once ``need`` groups are kept.
        None if nothing was kept.
        """
        idx, epochs = self._draw(count, stats)
        records = [self.records[i] for i in idx]
        if self.config.in_flight and self.session.engine.capabilities.streaming:
            return self._stream_round(idx, epochs, need, policy_version, stats)
        self.drawn_uids.extend(r.uid for r in records)
        sizes = [self.config.n] * len(records)
        rollouts = self.scorer.score(records, sizes, self.sampling, policy_version, stats)
        return self._filter(records, epochs, rollouts, stats)

    def _stream_round(
        self, idx: list[int], epochs: list[int], need: int, policy_version: int, stats: StepStats
    ) -> ScoredRollouts | None:
        """A round through ``engine.stream_groups``: groups are scored as they finish (each
        completion step's finished groups together); once ``need`` are kept the stream is sent
        :data:`DRAIN` (the requests not started are aborted, the started ones finish and are
        scored too: their surplus goes to the carry-over) and the prompts never generated are
        given back to the sampler."""
        n, t0 = self.config.n, time.perf_counter()
        stream = self.session.engine.stream_groups(
            [self.records[i].prompt_ids for i in idx], n, self.sampling
        )
        done: set[int] = set()
        parts: list[ScoredRollouts] = []
        have, draining = 0, False
        try:
            finished = next(stream, None)
            while finished is not None:
                keys = [k for k, _ in finished]
                if any(len(c) != n for _, c in finished):
                    raise RuntimeError(
                        f"stream_groups returned {[len(c) for _, c in finished]} completions "
                        f"per group for n={n}: it must return n per finished group."
                    )
                done.update(keys)
                records = [self.records[idx[k]] for k in keys]
                self.drawn_uids.extend(r.uid for r in records)
                stats.gen_seconds += time.perf_counter() - t0
                rollouts = self.scorer.score_completions(
                    records, [c for _, c in finished], self.sampling, policy_version, stats
                )
                got = self._filter(records, [epochs[k] for k in keys], rollouts, stats)
                t0 = time.perf_counter()
                if got is not None:
                    parts.append(got)
                    have += got.num_groups
                send = DRAIN if have >= need and not draining else None
                draining = draining or send is not None
                try:
                    finished = stream.send(send)
                except StopIteration:
                    finished = None
        finally:
            stream.close()  # aborts what is still queued or running
        stats.gen_seconds += time.perf_counter() - t0
        left = [k for k in range(len(idx)) if k not in done]
        stats.aborted_groups += float(len(left))
        self.sampler.give_back([idx[k] for k in left], [epochs[k] for k in left])
        return concat_rollouts(parts) if parts else None


def demonstrate_unsolved(
    records: Sequence[PromptRecord],
    rollouts: ScoredRollouts,
    demonstrations: Demonstrate,
    scorer: RolloutScorer,
    sampling: SamplingConfig,
    stats: StepStats,
) -> ScoredRollouts:
    """``rollouts`` (group ``g`` sampled for ``records[g]``) with the first episode of each
    group without a right answer (``acc`` all 0) replaced by the environment's demonstration,
    where it plays one (``demonstrations``) that ``scorer``'s reward scores right, its
    ``finish_reason`` ``"demonstration"`` (nothing sampled it: it is its own behaviour policy);
    each one counts in ``stats.demonstrations``."""
    best = group_max(rollouts.acc, rollouts.group_index, len(records))
    unsolved = (best <= 0).nonzero().flatten().tolist()
    played = demonstrations([records[g] for g in unsolved]) if unsolved else []
    have = [(g, e) for g, e in zip(unsolved, played) if e is not None]
    if not have:
        return rollouts
    demos = scorer.score_completions(
        [records[g] for g, _ in have], [[e] for _, e in have], sampling,
        rollouts.policy_version, StepStats(),
    )  # fmt: skip
    right = (demos.acc > 0).nonzero().flatten().tolist()
    if not right:
        return rollouts
    demos = demos.select(right)
    demos.finish_reason = ["demonstration"] * len(demos)
    first: dict[int, int] = {}
    for row, g in enumerate(rollouts.group_index.tolist()):
        first.setdefault(g, row)
    stats.demonstrations += float(len(right))
    return replace_rows(rollouts, [first[have[i][0]] for i in right], demos)
