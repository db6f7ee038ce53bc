"""The rollout producer: DAPO's dynamic sampling (paper Sec. 3.2) as generate, score, shape, filter.

One call of :meth:`RolloutProducer.next_batch` runs *generation rounds*: each draws
``gen_batch_size / world_size`` prompts for this rank, samples ``n`` responses per prompt,
scores them (:mod:`~dapo_lightning.data.sampling.scoring`), hands them to ``hooks.scored`` (the data module
dispatches the ``on_rollouts_scored`` callback hook there: overlong punishment, masks), then
keeps only groups whose *filter metric* varies within the group (a group where every response
is equally right or wrong has zero advantage and only dilutes the batch). Rounds repeat until
``train_batch_size / world_size`` groups are kept; what a round keeps beyond the batch goes to
the carry-over (:mod:`~dapo_lightning.data.sampling.carry_over`). The end game
(:mod:`~dapo_lightning.data.sampling.end_game`; docs/design.md, "Dynamic sampling"):

* prompts solved ``selection.retire_after`` visits in a row are retired (never drawn again);
* when ``max_num_gen_batches`` rounds run out, ``on_exhausted`` decides: ``"train_on_kept"``
  (default: the batch holds the groups kept so far; exact under token-mean, whose normaliser
  counts the tokens actually there; ``data/short_batch`` says so), ``"stop"`` (end the run
  cleanly) or ``"error"`` (:class:`DynamicSamplingError`);
* when no eligible prompt is left (all retired or parked), :class:`TrainingComplete` ends
  the run cleanly.

Ranks stay in lockstep: after every round all ranks sum a
:class:`~dapo_lightning.data.sampling.round_report.RoundReport` (short, failed, out of prompts, stop); a
full rank generates nothing but keeps joining the sum until every rank is full, so no
collective can hang. An exception on one rank is raised on every rank after the same round.

The settings (:class:`DynamicSamplingConfig`), the exceptions and the group helpers live in
their own modules and are importable from here as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.sampling.carry_over import CarryOver, VersionedGroups
from dapo_lightning.data.sampling.draw import selection_stats
from dapo_lightning.data.sampling.end_game import (
    DynamicSamplingError,
    TrainingComplete,
    out_of_rounds,
    solved_message,
)
from dapo_lightning.data.sampling.groups import (
    concat_rollouts,
    empty_rollouts,
    group_has_variance,
)
from dapo_lightning.data.sampling.rank_layout import RankLayout, member_rows
from dapo_lightning.data.sampling.round_report import RoundReport, Shortfall, SumOverRanks
from dapo_lightning.data.sampling.round_sizing import RoundSizer
from dapo_lightning.data.sampling.rounds import Demonstrate, GenerationRounds, RoundHooks
from dapo_lightning.data.sampling.scoring import RolloutScorer
from dapo_lightning.data.sampling.settings import (
    LEGACY_SELECTION_KEYS,
    DynamicSamplingConfig,
)
from dapo_lightning.data.sampling.step_stats import STAT_OPS, StepStats
from dapo_lightning.data.selection.difficulty import PredictiveSelector
from dapo_lightning.data.selection.sampler import PromptSampler, PromptsExhausted
from dapo_lightning.interrupt import StopRequested, request_stop, stop_requested
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.ranks import sum_over_ranks
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.session import EngineSession


@dataclass(frozen=True)
class BatchStart:
    """The state a batch started from: the producer's (:meth:`RolloutProducer.state_dict`) and
    the engine's sampling RNG (the session's ``state_dict``)."""

    producer: dict[str, Any]
    engine: dict[str, Any]


class RolloutProducer:
    """Produces on-policy :class:`RolloutBatch` es of ``train_batch_size`` groups of ``n``.

    Works without Lightning (no trainer, module or callback list).

    Args:
        session: The engine session (builds the engine, keeps its weights current).
        reward_runner: Scores responses (:class:`~dapo_lightning.rewards.base.RewardRunner`).
        records: Training prompts, tokenized (``prompt_ids`` set).
        config: The dynamic-sampling settings.
        decode: Token ids -> response text for the reward; used when the engine gives no text.
        pad_token_id: Padding id of the batch tensors.
        sampling: Sampling settings of training rollouts.
        seed: Seeds the prompt order and the predictive selection.
        layout: This rank, the world size and the tensor-parallel engine groups
            (:class:`~dapo_lightning.data.sampling.rank_layout.RankLayout`; default: one rank).
        sync: Sums integer lists over ranks (the data module passes the strategy's reduce;
            default: :func:`~dapo_lightning.ranks.sum_over_ranks` over the default process
            group when one is initialised).
        hooks: Told of every scored round (shaping) and of the rounds a rewind voids
            (:class:`~dapo_lightning.data.sampling.rounds.RoundHooks`; default: none).
        demonstrations: Plays the environment's demonstrations of records (one completion or
            None each), put into the groups with no right answer
            (``environment.demonstrate_unsolved``; :class:`GenerationRounds`); None: off.

    Raises:
        ValueError: bad settings for this world size or prompt set; untokenized prompts.
    """

    def __init__(
        self,
        session: EngineSession,
        reward_runner: RewardRunner,
        records: Sequence[PromptRecord],
        config: DynamicSamplingConfig,
        *,
        decode: Callable[[list[int]], str],
        pad_token_id: int,
        sampling: SamplingConfig,
        seed: int = 0,
        layout: RankLayout | None = None,
        sync: SumOverRanks | None = None,
        hooks: RoundHooks | None = None,
        demonstrations: Demonstrate | None = None,
    ) -> None:
        layout = layout if layout is not None else RankLayout()
        config.check_split(layout.world_size, len(records))
        missing = [r.uid for r in records if r.prompt_ids is None]
        if missing:
            raise ValueError(f"{len(missing)} prompts are not tokenized (e.g. uid {missing[0]}).")
        self.session = session
        self.reward_runner = reward_runner
        self.hooks = hooks if hooks is not None else RoundHooks()
        self.scorer = RolloutScorer(session, reward_runner, decode)
        self.records = list(records)
        self.config = config
        self.pad_token_id = pad_token_id
        self.sampling = sampling
        self.layout = layout
        #: Groups of one engine group's batch (every rank of the group holds all of them).
        self.local_train = config.train_batch_size // layout.groups
        self.sync = sync or sum_over_ranks
        self.tracker = config.make_tracker()
        self.sampler = PromptSampler(
            len(self.records), seed=seed, rank=layout.group, world_size=layout.groups
        )
        self.selector = (
            PredictiveSelector(config.n, config.selection, seed=f"{seed}-{layout.group}-select")
            if config.predictive or config.reviews
            else None
        )
        self.rounds = GenerationRounds(
            self.records, config, sampling, self.scorer, self.sampler,
            tracker=self.tracker, selector=self.selector, on_scored=self.hooks.scored,
            demonstrations=demonstrations,
        )  # fmt: skip
        #: How many prompts each round draws (its kept-fraction estimate is checkpointed).
        self.sizer = RoundSizer(config, layout, self.sampler)
        self.carry = CarryOver(config)
        #: The state the last :meth:`next_batch` started from (None: none since the last
        #: :meth:`rewind`); the one snapshot of a batch's start.
        self.batch_start: BatchStart | None = None
        #: Batches handed out so far: the next one's ``batch_index``.
        self.batches_made = 0

    @property
    def carried(self) -> list[VersionedGroups]:
        """The carried-over groups and their sample versions (:class:`CarryOver`)."""
        return self.carry.groups

    @property
    def drawn_uids(self) -> list[str]:
        """Uids drawn by the last :meth:`next_batch` (tests, logging)."""
        return self.rounds.drawn_uids

    def score(
        self,
        records: Sequence[PromptRecord],
        sizes: Sequence[int],
        sampling: SamplingConfig,
        policy_version: int,
        stats: StepStats | None = None,
    ) -> ScoredRollouts:
        """Sample ``sizes[i]`` responses for ``records[i]`` and score them (no shaping, no
        filter; validation uses it too): :meth:`RolloutScorer.score`."""
        return self.scorer.score(records, sizes, sampling, policy_version, stats)

    @property
    def kept_estimate(self) -> list[float]:
        """The agreed, decayed (kept, generated) group counts (:class:`RoundSizer`)."""
        return self.sizer.kept_estimate

    # ------------------------------------------------------------------ a batch
    def next_batch(self, policy_version: int = 0) -> RolloutBatch:
        """Run generation rounds until this rank holds ``train_batch_size / world_size`` groups.

        Args:
            policy_version: Weight version of the policy now (stamped on new responses; the
                engine is brought to it first, on every rank).

        Raises:
            TrainingComplete: no eligible prompt is left, or rounds ran out with ``stop``.
            DynamicSamplingError: rounds ran out with ``on_exhausted="error"``.
            StopRequested: a stop was requested (signal, on any rank) between rounds.

        Whatever it raises, the producer and the engine's sampling RNG are back in their state
        from before the call (prompt cursor, RNGs, statistics, carried groups), so a checkpoint
        saved then resumes this step with the same prompts and samples. That state is kept as
        :attr:`batch_start` (:meth:`rewind`).
        """
        self.batch_start = BatchStart(self.state_dict(), self.session.state_dict())
        try:
            return self._next_batch(policy_version)
        except BaseException:
            self._restore(self.batch_start)
            raise

    def rewind(self) -> bool:
        """Put the producer and the engine's sampling RNG back to :attr:`batch_start` (before
        the last :meth:`next_batch`: a stop dropped its update, the same rollouts are generated
        again) and forget it; False when there is none (nothing since the last rewind)."""
        start, self.batch_start = self.batch_start, None
        if start is None:
            return False
        self._restore(start)
        return True

    def _restore(self, start: BatchStart) -> None:
        """Go back to ``start``; the rounds scored since are void (``hooks.discarded``)."""
        self.load_state_dict(start.producer)
        self.session.load_state_dict(start.engine)
        if self.hooks.discarded is not None:
            self.hooks.discarded(self.batches_made)

    def _next_batch(self, policy_version: int) -> RolloutBatch:
        stats = StepStats()  # the same names on every rank (reduced over ranks)
        kept = self.carry.take(policy_version, stats)
        self.rounds.drawn_uids = []
        self.rounds.batch_index = self.batches_made
        have = sum(r.num_groups for r, _ in kept)
        skipped_before = self.selector.skipped if self.selector is not None else 0
        need = Shortfall(max(self.local_train - have, 0), int(have < self.local_train))
        need = need.summed(self.sync)
        report = RoundReport(need.short, 0, 0, need.missing, 0, 0)
        rounds = 0
        with self.session.generating(policy_version):
            while True:
                have, report = self._lockstep_round(kept, have, report, policy_version, stats)
                rounds += 1
                if not report.short:
                    break
                if self.config.max_num_gen_batches and rounds >= self.config.max_num_gen_batches:
                    stats.short_batch = 1.0
                    world = self.layout.world_size
                    out_of_rounds(self.config, have, self.local_train, report.short, world, stats)
                    break
        if self.selector is not None:
            stats.skipped_predicted = float(self.selector.skipped - skipped_before)
        batch = self._assemble(kept, policy_version, stats)
        self.batches_made += 1
        return batch

    def _lockstep_round(
        self,
        kept: list[VersionedGroups],
        have: int,
        last: RoundReport,
        policy_version: int,
        stats: StepStats,
    ) -> tuple[int, RoundReport]:
        """One round on this rank unless it is full or stopping (its kept groups appended to
        ``kept``), then the round's :class:`RoundReport` summed over ranks (``last``: the
        previous sum, which sizes the round). Raises on every rank what any rank raised."""
        error: BaseException | None = None
        exhausted = False
        before = (stats.kept_groups, stats.generated_groups)
        if have < self.local_train and stop_requested() is None:
            try:
                count = self.sizer.size(last.missing, last.short)
                got = self.rounds.run(count, self.local_train - have, policy_version, stats)
                stats.gen_rounds += 1.0
                if got is not None and len(got):
                    kept.append((got, [policy_version] * len(got)))
                    have += got.num_groups
            except PromptsExhausted:
                exhausted = True
            except StopRequested as e:  # the engine's should_stop: a stop like a signal
                request_stop(e.reason)
            except Exception as e:  # noqa: BLE001 - re-raised after the collective below
                error = e
        reason = stop_requested()
        report = RoundReport(
            short=int(have < self.local_train),
            failed=int(error is not None),
            out_of_prompts=int(exhausted),
            missing=max(self.local_train - have, 0),
            kept=int(stats.kept_groups - before[0]),
            generated=int(stats.generated_groups - before[1]),
            **RoundReport.stop_fields(reason),
        ).summed(self.sync)
        self.sizer.observe(report.kept, report.generated)
        if error is not None:
            raise error
        if report.failed:
            raise RuntimeError(
                "another rank failed during a generation round (its own error is in its log)."
            )
        if report.stopped:
            raise StopRequested(report.agreed_stop(reason))
        if report.out_of_prompts:
            raise TrainingComplete(solved_message(self.tracker, len(self.records), self.config))
        return have, report

    def _assemble(
        self, kept: list[VersionedGroups], policy_version: int, stats: StepStats
    ) -> RolloutBatch:
        """This rank's batch of the kept groups (the surplus to the carry-over), its stats."""
        allr = concat_rollouts([r for r, _ in kept] or [empty_rollouts(self.sampling)])
        versions = [v for _, vs in kept for v in vs]
        end = self.carry.keep_surplus(allr, versions, self.local_train, stats)
        mine = member_rows(allr.group_index[:end], self.layout.member, self.layout.tp_size)
        batch_r = allr.select(mine)
        batch_r.batch_index = self.batches_made  # carried groups included
        sample_version = torch.tensor([versions[i] for i in mine], dtype=torch.long)
        stats.finish(self.sampler.epoch)
        stats.batch_groups = float(batch_r.num_groups)
        stats.carried_groups = float(self.carry.num_groups)
        selection_stats(self.tracker, stats)
        if self.layout.member:  # the group's counts are reported once, by its first rank
            stats.zero_sums()
        return RolloutBatch.from_rollouts(
            batch_r,
            group_size=self.config.n,
            pad_token_id=self.pad_token_id,
            sample_version=sample_version if mine else None,
            stats=stats.as_metrics(),
        )

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Prompt cursor, epoch and given-back prompts, per-prompt statistics, the selection
        RNG, the round-sizing estimate, carried groups."""
        return {
            "sampler": self.sampler.state_dict(),
            "tracker": self.tracker.state_dict() if self.tracker is not None else None,
            "selector": self.selector.state_dict() if self.selector is not None else None,
            "kept_estimate": list(self.kept_estimate),
            "carried": self.carry.state_dict(),
            "batches_made": self.batches_made,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (carried groups of another size than
        today's ``n`` are dropped with a warning: :meth:`CarryOver.load_state_dict`)."""
        self.sampler.load_state_dict(state["sampler"])
        if self.tracker is not None and state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])
        if self.selector is not None and state.get("selector") is not None:
            self.selector.load_state_dict(state["selector"])
        self.sizer.kept_estimate = [float(x) for x in state.get("kept_estimate", [0.0, 0.0])]
        self.carry.load_state_dict(state["carried"])
        self.batches_made = int(state.get("batches_made", 0))  # 0 in older checkpoints


__all__ = [
    "STAT_OPS",
    "DynamicSamplingConfig",
    "DynamicSamplingError",
    "LEGACY_SELECTION_KEYS",
    "BatchStart",
    "RolloutProducer",
    "TrainingComplete",
    "concat_rollouts",
    "group_has_variance",
]
