"""The rollout producer: DAPO's dynamic sampling (paper Sec. 3.2) as generate, score, shape, filter.

One call of :meth:`RolloutProducer.next_batch` runs *generation rounds*: each draws
``gen_batch_size / world_size`` prompts for this rank, samples ``n`` responses per prompt,
scores them, hands them to ``on_scored`` (the data module dispatches the ``on_rollouts_scored``
callback hook there: overlong punishment, masks), then keeps only groups whose *filter metric*
varies within the group (a group where every response is equally right or wrong has zero
advantage and only dilutes the batch). Rounds repeat until ``train_batch_size / world_size``
groups are kept. The end game (docs/design.md, "Dynamic sampling"):

* prompts solved ``selection.retire_after`` visits in a row are retired (never drawn again);
* when ``max_num_gen_batches`` rounds run out, ``on_exhausted`` decides: ``"train_on_kept"``
  (default: the batch holds the groups kept so far; exact under token-mean, whose normaliser
  counts the tokens actually there; ``data/short_batch`` says so), ``"stop"`` (end the run
  cleanly) or ``"error"`` (:class:`DynamicSamplingError`);
* when no eligible prompt is left (all retired or parked), :class:`TrainingComplete` ends
  the run cleanly.

Ranks stay in lockstep: after every round all ranks sum (short, failed, exhausted, stop)
flags; a full rank generates nothing but keeps joining the sum until every rank is full, so no
collective can hang. An exception on one rank is raised on every rank after the same round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from dapo_lightning.checks import ConfigError, check_count
from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.config import check_batch_split
from dapo_lightning.data.difficulty import (
    SELECTION_PATH,
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
)
from dapo_lightning.data.sampler import PromptSampler, PromptsExhausted
from dapo_lightning.data.sources import PromptRecord
from dapo_lightning.envs.runner import episode_results, token_masks
from dapo_lightning.interrupt import StopRequested, request_stop, stop_requested
from dapo_lightning.ranks import sum_over_ranks
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import DRAIN, SamplingConfig
from dapo_lightning.rollout.session import EngineSession

FilterMetric = Literal["acc", "score", "reward"] | None
OnExhausted = Literal["train_on_kept", "stop", "error"]
RoundSizing = Literal["fixed", "kept_frac"]

#: Weight of the older rounds in the kept-fraction estimate that sizes rounds (per round).
KEPT_FRAC_DECAY = 0.7

#: How the producer's per-rank statistics combine over ranks (others: mean over ranks).
STAT_OPS: dict[str, Literal["sum", "max"]] = {
    "data/generated_groups": "sum",
    "data/kept_groups": "sum",
    "data/batch_groups": "sum",
    "data/carried_groups": "sum",
    "data/dropped_stale_groups": "sum",
    "data/generated_tokens": "sum",
    "data/reward_failures": "sum",
    "data/retired": "sum",
    "data/parked": "sum",
    "data/dropped_prompts": "sum",
    "data/generated_samples": "sum",
    "data/skipped_predicted": "sum",
    "data/aborted_groups": "sum",
    "data/dropped_surplus_groups": "sum",
    "data/gen_rounds": "max",
    "data/gen_seconds": "max",
    "data/score_seconds": "max",
    "data/short_batch": "max",
    "env/failures": "sum",
    "env/observation_tokens": "sum",
    "env/timeouts": "sum",
}


class DynamicSamplingError(RuntimeError):
    """Generation rounds ran out (``max_num_gen_batches``) before the batch was full."""


class TrainingComplete(Exception):
    """Nothing is left to train on (every prompt retired, or rounds ran out with ``stop``)."""


#: Where :class:`DynamicSamplingConfig` sits in a run's YAML (its errors name this path).
DYNAMIC_SAMPLING_PATH = "data.dynamic_sampling"


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """How rollout batches are produced: group size, batch sizes, filter and end game.

    Args:
        n: Responses per prompt, the group size G (paper 16). >= 2 when filtering.
        train_batch_size: Groups per rollout step over all ranks (paper 512).
        gen_batch_size: Prompts per generation round over all ranks (None: train_batch_size;
            larger values waste fewer rounds when many groups are filtered).
        filter_metric: Per-response value whose within-group std must be > 0 for a group to be
            kept: ``"acc"`` (default; shaping never decides the filter), ``"score"`` (raw
            reward), ``"reward"`` (shaped reward), or None (keep everything: GRPO baseline).
        max_num_gen_batches: Most generation rounds per batch (0: unlimited).
        on_exhausted: When rounds run out: ``"train_on_kept"``, ``"stop"`` or ``"error"``.
        carry_over: Keep surplus kept groups, at most one batch of them (``train_batch_size``),
            for the next step instead of dropping them (default True; verl drops them; what is
            over the bound is dropped and counted, ``data/dropped_surplus_groups``). They are
            then ``updates per step`` updates stale, each response stamped with its sample
            version; the module corrects them with the engine's log-probs (``stale_tis_cap``).
        max_staleness: Carried groups older than this many policy versions are dropped
            (``data/dropped_stale_groups``); None keeps them whatever their age.
        selection: Which prompts are drawn (strategy, exploration, retiring, parking):
            :class:`~dapo_lightning.data.difficulty.PromptSelectionConfig`; YAML
            ``selection: {strategy: predictive, max_skip: 0.99, ...}``.
        round_sizing: ``"kept_frac"`` (default): after the first round the next round draws
            enough prompts to fill the batch at the kept fraction observed so far (one estimate
            agreed over ranks, :data:`KEPT_FRAC_DECAY`; 1 without a filter, so a round is
            exactly what is missing), at most ``max_gen_batch_size``;
            ``"fixed"``: every round draws ``gen_batch_size``.
        max_gen_batch_size: Cap of a sized round over all ranks (None: 4 x train_batch_size;
            never more than one epoch of a rank's prompts). Kept groups beyond the batch go to
            the carry-over with ``carry_over``, else are dropped and counted
            (``data/dropped_surplus_groups``).
        in_flight: With an engine that streams groups (``stream_groups``: the vLLM engine), a
            round stops starting groups as soon as the batch is full: groups are scored as they
            finish, the requests not started yet are aborted (their prompts drawn first next
            time) and the started ones finish (:data:`~dapo_lightning.rollout.base.DRAIN`; their
            kept groups go to the carry-over). Other engines (HF) keep whole rounds.

    Raises:
        ValueError: a setting out of range, named with the fix.
    """

    n: int = 16
    train_batch_size: int = 512
    gen_batch_size: int | None = None
    filter_metric: FilterMetric = "acc"
    max_num_gen_batches: int = 10
    on_exhausted: OnExhausted = "train_on_kept"
    carry_over: bool = True
    max_staleness: int | None = None
    selection: PromptSelectionConfig = field(default_factory=PromptSelectionConfig)
    round_sizing: RoundSizing = "kept_frac"
    max_gen_batch_size: int | None = None
    in_flight: bool = True

    def __post_init__(self) -> None:
        check_count(f"{DYNAMIC_SAMPLING_PATH}.n", self.n, 1, "responses per prompt")
        check_count(
            f"{DYNAMIC_SAMPLING_PATH}.train_batch_size",
            self.train_batch_size,
            1,
            "groups per rollout step",
        )
        if self.gen_batch_size is not None:
            check_count(
                f"{DYNAMIC_SAMPLING_PATH}.gen_batch_size",
                self.gen_batch_size,
                1,
                "prompts per round, or null",
            )
        if self.filter_metric not in ("acc", "score", "reward", None):
            raise ConfigError(
                f"{DYNAMIC_SAMPLING_PATH}.filter_metric must be 'acc', 'score', 'reward' or null, "
                f"got {self.filter_metric!r}."
            )
        if self.filter_metric is not None and self.n < 2:
            raise ConfigError(
                f"{DYNAMIC_SAMPLING_PATH}.n={self.n} with filter_metric={self.filter_metric!r}: "
                "a group of one response never has variance; use n >= 2 or filter_metric: null."
            )
        check_count(
            f"{DYNAMIC_SAMPLING_PATH}.max_num_gen_batches",
            self.max_num_gen_batches,
            0,
            "0 = unlimited",
        )
        if self.on_exhausted not in ("train_on_kept", "stop", "error"):
            raise ConfigError(
                f"{DYNAMIC_SAMPLING_PATH}.on_exhausted must be 'train_on_kept', 'stop' or "
                f"'error', got {self.on_exhausted!r}."
            )
        if self.max_staleness is not None:
            check_count(
                f"{DYNAMIC_SAMPLING_PATH}.max_staleness",
                self.max_staleness,
                0,
                "policy versions, or null",
            )
        object.__setattr__(self, "selection", as_selection(self.selection))
        if self.round_sizing not in ("fixed", "kept_frac"):
            raise ConfigError(
                f"{DYNAMIC_SAMPLING_PATH}.round_sizing must be 'fixed' or 'kept_frac', "
                f"got {self.round_sizing!r}."
            )
        if self.max_gen_batch_size is not None:
            check_count(
                f"{DYNAMIC_SAMPLING_PATH}.max_gen_batch_size",
                self.max_gen_batch_size,
                1,
                "prompts, or null",
            )

    @property
    def prompts_per_round(self) -> int:
        """``gen_batch_size``, or ``train_batch_size`` when it is None."""
        return self.gen_batch_size or self.train_batch_size

    @property
    def round_cap(self) -> int:
        """The most prompts of a sized round over all ranks (``max_gen_batch_size``)."""
        if self.max_gen_batch_size is not None:
            return self.max_gen_batch_size
        return max(4 * self.train_batch_size, self.prompts_per_round)

    def check_split(self, world_size: int, num_prompts: int) -> None:
        """Raise unless the batch sizes split over ``world_size`` ranks and fit the prompts."""
        check_batch_split(self.train_batch_size, self.gen_batch_size, world_size, num_prompts)

    @property
    def predictive(self) -> bool:
        """Predictive selection is on (and meaningful: the filter drops zero variance)."""
        return self.selection.strategy == "predictive" and self.filter_metric is not None

    def make_tracker(self) -> DifficultyTracker | None:
        """Per-prompt statistics when retiring, parking or predictive selection need them."""
        sel = self.selection
        if sel.retire_after or sel.park_after or self.predictive:
            return DifficultyTracker(sel)
        return None

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (``torch.load`` of a checkpoint's hyper-parameters); a config saved before
        the prompt-selection settings were grouped (flat keys, :data:`LEGACY_SELECTION_KEYS`)
        is mapped onto ``selection``."""
        state = dict(state)
        if not isinstance(state.get("selection"), PromptSelectionConfig):
            legacy = LEGACY_SELECTION_KEYS.items()
            state["selection"] = PromptSelectionConfig(
                **{new: state.pop(old) for old, new in legacy if old in state}
            )
        self.__dict__.update(state)


#: Flat ``dynamic_sampling`` keys of configs saved before prompt selection was its own group
#: -> their field of ``dynamic_sampling.selection`` (:class:`PromptSelectionConfig`).
LEGACY_SELECTION_KEYS: dict[str, str] = {
    "selection": "strategy",
    "max_skip": "max_skip",
    "revisit_within": "revisit_within",
    "retire_after": "retire_after",
    "park_after": "park_after",
    "revisit_every": "revisit_every",
}


def as_selection(value: Any) -> PromptSelectionConfig:
    """``value`` as a :class:`PromptSelectionConfig` (a mapping of its fields is built into one).

    Raises:
        ConfigError: anything else, e.g. the former ``selection: uniform`` (now
            ``selection: {strategy: uniform}``).
    """
    if isinstance(value, PromptSelectionConfig):
        return value
    if isinstance(value, dict):
        return PromptSelectionConfig(**value)
    raise ConfigError(
        f"{SELECTION_PATH} is a group of settings, got {value!r}: write "
        f"selection: {{strategy: {value}}} (max_skip, revisit_within, retire_after, park_after "
        "and revisit_every moved into it too)."
    )


def concat_rollouts(parts: Sequence[ScoredRollouts]) -> ScoredRollouts:
    """Concatenate rollouts; group ids are renumbered so groups stay distinct and contiguous."""
    if not parts:
        raise ValueError("nothing to concatenate.")
    group_index, offset = [], 0
    for p in parts:
        if len(p):
            group_index.append(p.group_index + offset)
            offset += p.num_groups
    keys = set().union(*(p.extra.keys() for p in parts))
    return ScoredRollouts(
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        response_ids=[x for p in parts for x in p.response_ids],
        rollout_log_probs=[x for p in parts for x in p.rollout_log_probs],
        finish_reason=[x for p in parts for x in p.finish_reason],
        group_index=torch.cat(group_index) if group_index else torch.zeros(0, dtype=torch.long),
        prompt_uid=[x for p in parts for x in p.prompt_uid],
        score=torch.cat([p.score for p in parts]),
        acc=torch.cat([p.acc for p in parts]),
        sampling=parts[0].sampling,
        policy_version=max(p.policy_version for p in parts),
        reward=torch.cat([p.reward for p in parts]),
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        extra={k: [x for p in parts for x in p.extra.get(k, [None] * len(p))] for k in keys},
        token_mask=None
        if all(p.token_mask is None for p in parts)
        else [m for p in parts for m in p.token_masks()],
    )


def group_has_variance(values: Tensor, group_index: Tensor) -> Tensor:
    """``[G]`` bool: True where the group's values are not all equal (std > 0 <=> max > min)."""
    num_groups = int(group_index.max()) + 1 if len(group_index) else 0
    v = values.float()
    hi = torch.full((num_groups,), -torch.inf).scatter_reduce(0, group_index, v, "amax")
    lo = torch.full((num_groups,), torch.inf).scatter_reduce(0, group_index, v, "amin")
    return hi > lo


def numeric_extras(extra: dict[str, list[Any]]) -> dict[str, list[float]]:
    """The reward's ``extra`` fields whose every value is a number or bool (None skipped)."""
    out: dict[str, list[float]] = {}
    for key, values in extra.items():
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, (int, float, bool)) for v in present):
            out[key] = [float(v) for v in present]
    return out


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
        rank: This rank.
        world_size: Number of ranks.
        tp_size: Ranks per tensor-parallel engine group (vLLM ``tensor_parallel_size`` under
            the external launcher): the ranks of a group submit the same prompts and receive
            the same responses, and each trains on its own 1 / tp_size of the group's batch.
        sync: Sums integer flags over ranks (the data module passes the strategy's reduce;
            default: :func:`~dapo_lightning.ranks.sum_over_ranks` over the default process
            group when one is initialised).
        on_scored: Called with every round's scored rollouts before the filter (shaping).

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
        rank: int = 0,
        world_size: int = 1,
        tp_size: int = 1,
        sync: Callable[[list[int]], list[int]] | None = None,
        on_scored: Callable[[ScoredRollouts], None] | None = None,
    ) -> None:
        if tp_size < 1 or world_size % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the number of ranks ({world_size}): "
                "each engine group is tensor_parallel_size consecutive ranks."
            )
        config.check_split(world_size, len(records))
        missing = [r.uid for r in records if r.prompt_ids is None]
        if missing:
            raise ValueError(f"{len(missing)} prompts are not tokenized (e.g. uid {missing[0]}).")
        self.session = session
        self.reward_runner = reward_runner
        self.records = list(records)
        self.config = config
        self.decode = decode
        self.pad_token_id = pad_token_id
        self.sampling = sampling
        self.world_size = world_size
        self.tp_size, self.member = tp_size, rank % tp_size
        group, groups = rank // tp_size, world_size // tp_size  # engine groups draw prompts
        #: Groups of one engine group's batch (every rank of the group holds all of them).
        self.local_train = config.train_batch_size // groups
        self.local_gen = config.prompts_per_round // groups
        self.sync = sync or sum_over_ranks
        self.on_scored = on_scored
        self.tracker = config.make_tracker()
        self.sampler = PromptSampler(len(self.records), seed=seed, rank=group, world_size=groups)
        self.selector = (
            PredictiveSelector(config.n, config.selection, seed=f"{seed}-{group}-select")
            if config.predictive
            else None
        )
        #: Decayed (kept, generated) group counts over all ranks: the round-sizing estimate.
        self.kept_estimate = [0.0, 0.0]
        self.carried: list[tuple[ScoredRollouts, list[int]]] = []
        self.drawn_uids: list[str] = []  # uids drawn by the last next_batch (tests, logging)

    # ------------------------------------------------------------------ scoring
    def score(
        self,
        records: Sequence[PromptRecord],
        sizes: Sequence[int],
        sampling: SamplingConfig,
        policy_version: int,
        stats: dict[str, float] | None = None,
    ) -> ScoredRollouts:
        """Sample ``sizes[i]`` responses for ``records[i]`` and score them (no shaping, no filter)."""
        stats = stats if stats is not None else {}
        t0 = time.perf_counter()
        engine = self.session.engine
        completions: list[list[Any]] = [[] for _ in records]
        for size in sorted(set(sizes)):
            which = [i for i, s in enumerate(sizes) if s == size]
            out = engine.generate([records[i].prompt_ids for i in which], size, sampling)
            if len(out) != len(which) or any(len(c) != size for c in out):
                raise RuntimeError(
                    f"engine {type(engine).__name__} returned {[len(c) for c in out]} "
                    f"completions for {len(which)} prompts x n={size}: it must return n per prompt."
                )
            for i, c in zip(which, out):
                completions[i] = c
        _add(stats, "data/gen_seconds", time.perf_counter() - t0)
        return self.score_completions(records, completions, sampling, policy_version, stats)

    def score_completions(
        self,
        records: Sequence[PromptRecord],
        completions: Sequence[Sequence[Any]],
        sampling: SamplingConfig,
        policy_version: int,
        stats: dict[str, float],
    ) -> ScoredRollouts:
        """Score ``completions[i]`` (the samples of ``records[i]``): group ``i`` of the result."""
        t1 = time.perf_counter()
        t1 = time.perf_counter()
        flat = [(g, rec, c) for g, (rec, cs) in enumerate(zip(records, completions)) for c in cs]
        texts = [c.text if c.text is not None else self.decode(list(c.token_ids)) for *_, c in flat]
        results = self.reward_runner.score(
            texts,
            [rec.answer for _, rec, _ in flat],
            [
                {"data_source": rec.data_source, **rec.meta.get("reward_kwargs", {})}
                for _, rec, _ in flat
            ],
        )
        # multi-turn episodes (dapo_lightning.envs): the environment's reward or failure
        results = episode_results([c for *_, c in flat], results, self.reward_runner.reward)
        t2 = time.perf_counter()
        extra_keys = set().union(*(r.extra.keys() for r in results)) if results else set()
        rollouts = ScoredRollouts(
            prompt_ids=[list(rec.prompt_ids) for _, rec, _ in flat],
            response_ids=[list(c.token_ids) for *_, c in flat],
            rollout_log_probs=[list(c.log_probs) for *_, c in flat],
            finish_reason=[c.finish_reason for *_, c in flat],
            group_index=torch.tensor([g for g, *_ in flat], dtype=torch.long),
            prompt_uid=[rec.uid for _, rec, _ in flat],
            score=torch.tensor([r.score for r in results], dtype=torch.float32),
            acc=torch.tensor([float(r.acc) for r in results], dtype=torch.float32),
            sampling=sampling,
            policy_version=policy_version,
            extra={k: [r.extra.get(k) for r in results] for k in extra_keys},
            token_mask=token_masks([c for *_, c in flat]),
        )
        _add(stats, "data/score_seconds", t2 - t1)
        _add(stats, "data/generated_samples", float(len(flat)))
        # the policy's own tokens; a multi-turn episode's observations (tool output) apart
        sampled = float(rollouts.response_length.sum())
        _add(stats, "data/generated_tokens", sampled)
        if rollouts.token_mask is not None:
            episode = float(sum(len(r) for r in rollouts.response_ids))
            _add(stats, "env/observation_tokens", episode - sampled)
        _add(stats, "data/reward_failures", float(self.reward_runner.last_failures))
        for key, values in numeric_extras(rollouts.extra).items():
            _add(stats, f"reward/{key}", sum(values))
            _add(stats, f"_count/reward/{key}", float(len(values)))
        return rollouts

    # ------------------------------------------------------------------ rounds
    def _draw(self, count: int) -> tuple[list[int], list[int]]:
        """``count`` prompt indices and the epochs they were drawn in."""
        tracker, selector = self.tracker, self.selector
        eligible = skip = None
        if tracker is not None:

            def eligible(i: int, epoch: int) -> bool:
                return tracker.eligible(self.records[i].uid, epoch)

        if selector is not None and tracker is not None:

            def skip(i: int, epoch: int) -> bool:
                return not selector.take(tracker.stats.get(self.records[i].uid), epoch)

        idx = self.sampler.take(count, eligible, skip=skip)
        return idx, list(self.sampler.last_epochs)

    def _filter(
        self,
        records: list[PromptRecord],
        epochs: list[int],
        rollouts: ScoredRollouts,
        stats: dict[str, float],
    ) -> ScoredRollouts | None:
        """Record the visits (in the epochs they were drawn in), shape, keep groups with
        variance."""
        if self.tracker is not None:
            per_group: list[list[float]] = [[] for _ in records]
            for g, a in zip(rollouts.group_index.tolist(), rollouts.acc.tolist()):
                per_group[g].append(a)
            for rec, accs, epoch in zip(records, per_group, epochs):
                self.tracker.update(rec.uid, accs, epoch)
        if self.on_scored is not None:
            self.on_scored(rollouts)
        _add(stats, "data/generated_groups", float(len(records)))
        metric = self.config.filter_metric
        if metric is None:
            _add(stats, "data/kept_groups", float(len(records)))
            return rollouts
        keep_group = group_has_variance(getattr(rollouts, metric), rollouts.group_index)
        _add(stats, "data/kept_groups", float(keep_group.sum()))
        keep_idx = keep_group[rollouts.group_index].nonzero().flatten().tolist()
        return rollouts.select(keep_idx) if keep_idx else None

    def _round(
        self, count: int, need: int, policy_version: int, stats: dict[str, float]
    ) -> ScoredRollouts | None:
        """One generation round of ``count`` prompts: draw, sample, score, shape, filter.

        With a streaming engine (``in_flight``) the round stops once ``need`` groups are kept.
        None if nothing was kept.
        """
        idx, epochs = self._draw(count)
        records = [self.records[i] for i in idx]
        if self.config.in_flight and hasattr(self.session.engine, "stream_groups"):
            return self._stream_round(idx, epochs, need, policy_version, stats)
        self.drawn_uids.extend(r.uid for r in records)
        sizes = [self.config.n] * len(records)
        rollouts = self.score(records, sizes, self.sampling, policy_version, stats)
        return self._filter(records, epochs, rollouts, stats)

    def _stream_round(
        self,
        idx: list[int],
        epochs: list[int],
        need: int,
        policy_version: int,
        stats: dict[str, float],
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
                _add(stats, "data/gen_seconds", time.perf_counter() - t0)
                rollouts = self.score_completions(
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
        _add(stats, "data/gen_seconds", time.perf_counter() - t0)
        left = [k for k in range(len(idx)) if k not in done]
        _add(stats, "data/aborted_groups", float(len(left)))
        self.sampler.give_back([idx[k] for k in left], [epochs[k] for k in left])
        return concat_rollouts(parts) if parts else None

    def _round_size(self, missing: int, short_ranks: int) -> int:
        """Prompts this rank draws next: ``gen_batch_size / ranks`` (fixed sizing or no history
        yet), else enough for the short ranks' mean missing groups at the kept fraction
        ``(kept + 1) / (generated + 2)`` of the agreed estimate (exactly 1 without a filter:
        every group is kept, so the round is what is missing), capped. Equal on all ranks."""
        groups = self.world_size // self.tp_size
        kept, generated = self.kept_estimate
        if self.config.round_sizing == "fixed" or generated <= 0 or short_ranks <= 0:
            return self.local_gen
        frac = 1.0 if self.config.filter_metric is None else (kept + 1.0) / (generated + 2.0)
        want = math.ceil(missing / short_ranks / frac)
        cap = max(1, self.config.round_cap // groups)
        per_rank = self.sampler.num_prompts // self.sampler.world_size  # one epoch at most
        return max(1, min(want, cap, per_rank))

    def _carried_within_staleness(
        self, policy_version: int, stats: dict[str, float]
    ) -> list[tuple[ScoredRollouts, list[int]]]:
        kept, limit = [], self.config.max_staleness
        for rollouts, versions in self.carried:
            if limit is not None and policy_version - min(versions) > limit:
                _add(stats, "data/dropped_stale_groups", float(rollouts.num_groups))
                continue
            kept.append((rollouts, versions))
        self.carried = []
        return kept

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
        saved then resumes this step with the same prompts and samples.
        """
        start, engine_start = self.state_dict(), self.session.state_dict()
        try:
            return self._next_batch(policy_version)
        except BaseException:
            self.load_state_dict(start)
            self.session.load_state_dict(engine_start)
            raise

    def _next_batch(self, policy_version: int) -> RolloutBatch:
        stats = dict.fromkeys(STAT_OPS, 0.0)  # the same names on every rank (reduced over ranks)
        kept = self._carried_within_staleness(policy_version, stats)
        self.drawn_uids = []
        have = sum(r.num_groups for r, _ in kept)
        skipped_before = self.selector.skipped if self.selector is not None else 0
        missing, short_ranks = self.sync(
            [max(self.local_train - have, 0), int(have < self.local_train)]
        )
        rounds = 0
        with self.session.generating(policy_version):
            while True:
                error: BaseException | None = None
                exhausted = False
                before = (stats["data/kept_groups"], stats["data/generated_groups"])
                if have < self.local_train and stop_requested() is None:
                    try:
                        count = self._round_size(missing, short_ranks)
                        got = self._round(count, self.local_train - have, policy_version, stats)
                        _add(stats, "data/gen_rounds", 1.0)
                        if got is not None and len(got):
                            kept.append((got, [policy_version] * len(got)))
                            have += got.num_groups
                    except PromptsExhausted:
                        exhausted = True
                    except StopRequested as e:  # the engine's should_stop: a stop like a signal
                        request_stop(e.reason)
                    except Exception as e:  # noqa: BLE001 - re-raised after the collective below
                        error = e
                rounds += 1
                reason = stop_requested()
                short, failed, out_of_prompts, missing, round_kept, round_gen, *stops = self.sync(
                    [int(have < self.local_train), int(error is not None), int(exhausted)]
                    + [max(self.local_train - have, 0)]
                    + [int(stats["data/kept_groups"] - before[0])]
                    + [int(stats["data/generated_groups"] - before[1])]
                    + [int(reason == name) for name in _STOP_NAMES]
                    + [int(reason is not None and reason not in _STOP_NAMES)]
                )
                short_ranks = short
                self._update_kept_estimate(round_kept, round_gen)
                if error is not None:
                    raise error
                if failed:
                    raise RuntimeError(
                        "another rank failed during a generation round (its own error is in its log)."
                    )
                if any(stops):
                    raise StopRequested(_agreed_stop(reason, stops))
                if out_of_prompts:
                    raise TrainingComplete(
                        solved_message(self.tracker, len(self.records), self.config)
                    )
                if not short:
                    break
                if self.config.max_num_gen_batches and rounds >= self.config.max_num_gen_batches:
                    stats["data/short_batch"] = 1.0
                    out_of_rounds(
                        self.config, have, self.local_train, short, self.world_size, stats
                    )
                    break
        if self.selector is not None:
            stats["data/skipped_predicted"] = float(self.selector.skipped - skipped_before)
        return self._assemble(kept, policy_version, stats)

    def _update_kept_estimate(self, kept: int, generated: int) -> None:
        """Decay the agreed (kept, generated) counts by :data:`KEPT_FRAC_DECAY`, add a round's."""
        if generated > 0:
            k, g = self.kept_estimate
            self.kept_estimate = [KEPT_FRAC_DECAY * k + kept, KEPT_FRAC_DECAY * g + generated]

    def _assemble(
        self,
        kept: list[tuple[ScoredRollouts, list[int]]],
        policy_version: int,
        stats: dict[str, float],
    ) -> RolloutBatch:
        n = self.config.n
        parts = [r for r, _ in kept] or [empty_rollouts(self.sampling)]
        allr = concat_rollouts(parts)
        versions = [v for _, vs in kept for v in vs]
        end = int((allr.group_index < self.local_train).sum())
        # at most one batch of surplus is carried (carry_over), the rest dropped and counted
        bound = 2 * self.local_train if self.config.carry_over else self.local_train
        stop = int((allr.group_index < bound).sum())
        if stop > end:
            self.carried = [(allr.select(list(range(end, stop))), versions[end:stop])]
        if stop < len(allr):
            surplus = allr.num_groups - bound
            _add(stats, "data/dropped_surplus_groups", float(surplus))
        mine = member_rows(allr.group_index[:end], self.member, self.tp_size)
        batch_r = allr.select(mine)
        sample_version = torch.tensor([versions[i] for i in mine], dtype=torch.long)
        gen = stats.get("data/generated_groups", 0.0)
        kept_frac = stats.get("data/kept_groups", 0.0) / gen if gen else 1.0
        for key in [k for k in stats if k.startswith("_count/")]:
            name = key[len("_count/") :]
            stats[name] = stats[name] / max(stats.pop(key), 1.0)
        kept_groups = stats.get("data/kept_groups", 0.0)
        stats.update(
            {
                "data/samples_per_kept_group": (
                    stats.get("data/generated_samples", 0.0) / kept_groups if kept_groups else 0.0
                ),
                "data/kept_frac": kept_frac,
                "data/zero_variance_frac": 1.0 - kept_frac if gen else 0.0,
                "data/batch_groups": float(batch_r.num_groups),
                "data/carried_groups": float(self.carried[0][0].num_groups if self.carried else 0),
                "data/epoch": float(self.sampler.epoch),
            }
        )
        stats.setdefault("data/short_batch", 0.0)
        if self.tracker is not None:
            stats["data/retired"] = float(self.tracker.num_retired)
            stats["data/parked"] = float(self.tracker.num_parked)
        if self.member:  # the group's counts are reported once, by its first rank
            stats.update({k: 0.0 for k, op in STAT_OPS.items() if op == "sum"})
        return RolloutBatch.from_rollouts(
            batch_r,
            group_size=n,
            pad_token_id=self.pad_token_id,
            sample_version=sample_version if mine else None,
            stats=stats,
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
            "carried": [(r.state_dict(), v) for r, v in self.carried],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.sampler.load_state_dict(state["sampler"])
        if self.tracker is not None and state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])
        if self.selector is not None and state.get("selector") is not None:
            self.selector.load_state_dict(state["selector"])
        self.kept_estimate = [float(x) for x in state.get("kept_estimate", [0.0, 0.0])]
        self.carried = [(ScoredRollouts.from_state_dict(r), list(v)) for r, v in state["carried"]]


def solved_message(
    tracker: DifficultyTracker | None, prompts: int, config: DynamicSamplingConfig
) -> str:
    """Why the run ends when no prompt is eligible any more."""
    retired, parked = (tracker.num_retired, tracker.num_parked) if tracker is not None else (0, 0)
    return (
        f"no training prompt is left to sample: {retired} of {prompts} are retired "
        f"(all-correct {config.selection.retire_after} visits in a row) and {parked} parked. "
        "The training set is solved; add harder prompts to continue."
    )


def out_of_rounds(
    config: DynamicSamplingConfig,
    have: int,
    need: int,
    short_ranks: int,
    world_size: int,
    stats: dict[str, float],
) -> None:
    """Act on ``config.on_exhausted`` when the rounds ran out with ``have`` of ``need`` groups.

    Raises:
        DynamicSamplingError: ``on_exhausted="error"``.
        TrainingComplete: ``on_exhausted="stop"``.
    """
    gen = stats.get("data/generated_groups", 0.0)
    frac = 1 - stats.get("data/kept_groups", 0.0) / gen if gen else 0.0
    msg = (
        f"dynamic sampling ran out of rounds (max_num_gen_batches={config.max_num_gen_batches}): "
        f"this rank kept {have} of the {need} groups a batch needs ({short_ranks} of "
        f"{world_size} ranks short); of {int(gen)} groups generated here {frac:.0%} had zero "
        f"variance of {config.filter_metric!r}."
    )
    if config.on_exhausted == "error":
        raise DynamicSamplingError(
            msg + " Raise n, add prompts, raise max_num_gen_batches (0 = unlimited), set "
            "on_exhausted: train_on_kept, or filter_metric: null."
        )
    if config.on_exhausted == "stop":
        raise TrainingComplete(msg + " Stopping (on_exhausted: stop).")


def member_rows(group_index: Tensor, member: int, tp_size: int) -> list[int]:
    """Rows of tensor-parallel rank ``member``'s share of an engine group's batch: its
    1 / tp_size of the groups, as evenly as possible (all of them when ``tp_size`` is 1)."""
    groups = int(group_index[-1]) + 1 if len(group_index) else 0
    base, extra = divmod(groups, tp_size)
    first = member * base + min(member, extra)
    last = first + base + (member < extra)
    return ((group_index >= first) & (group_index < last)).nonzero().flatten().tolist()


def empty_rollouts(sampling: SamplingConfig) -> ScoredRollouts:
    """No rollouts (a rank that kept no group)."""
    return ScoredRollouts(
        prompt_ids=[], response_ids=[], rollout_log_probs=[], finish_reason=[],
        group_index=torch.zeros(0, dtype=torch.long), prompt_uid=[], score=torch.zeros(0),
        acc=torch.zeros(0), sampling=sampling,
    )  # fmt: skip


#: Stop reasons the ranks agree on by name (the signals a run guard turns into exit codes).
_STOP_NAMES = ("SIGTERM", "SIGINT")


def _agreed_stop(reason: str | None, stops: list[int]) -> str:
    """The stop every rank reports: this rank's own reason, else a signal seen on another
    rank (recorded here too, so this rank exits as that one does)."""
    if reason is not None:
        return reason
    for name, seen in zip(_STOP_NAMES, stops):
        if seen:
            request_stop(name)
            return name
    return "a stop was requested on another rank"


def _add(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = stats.get(key, 0.0) + value


__all__ = [
    "DynamicSamplingConfig",
    "DynamicSamplingError",
    "LEGACY_SELECTION_KEYS",
    "RolloutProducer",
    "TrainingComplete",
    "concat_rollouts",
    "group_has_variance",
]
