"""The dynamic-sampling settings (paper Sec. 3.2): group size, batch sizes, filter, end game.

:class:`DynamicSamplingConfig` is the data module's ``dynamic_sampling`` group (YAML
``data.init_args.dynamic_sampling``), checked in ``__post_init__`` with every error naming its
field; its prompt selection is the nested
:class:`~dapo_lightning.data.selection.difficulty.PromptSelectionConfig`. A config pickled by an older
release loads through :func:`group_legacy_settings`. The one-step-off settings
(:class:`OneStepOffConfig`, ``dynamic_sampling.one_step_off``) are read only with
``dynamic_sampling.pipeline: one_step_off``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dapo_lightning.checks import ConfigError, as_group, check_choice, check_count, choices_of
from dapo_lightning.data.prompts.config import check_batch_split
from dapo_lightning.data.selection.difficulty import (
    SELECTION_PATH,
    DifficultyTracker,
    PromptSelectionConfig,
)

FilterMetric = Literal["acc", "score", "reward"] | None
OnExhausted = Literal["train_on_kept", "stop", "error"]
RoundSizing = Literal["fixed", "kept_frac"]
Pipeline = Literal["sync", "one_step_off"]

#: Weight of the older rounds in the kept-fraction estimate that sizes rounds (per round).
KEPT_FRAC_DECAY = 0.7

#: Where :class:`DynamicSamplingConfig` sits in a run's YAML (its errors name this path).
DYNAMIC_SAMPLING_PATH = "data.dynamic_sampling"


#: Where :class:`OneStepOffConfig` sits in a run's YAML (its errors name this path).
ONE_STEP_OFF_PATH = "data.dynamic_sampling.one_step_off"


@dataclass(frozen=True)
class OneStepOffConfig:
    """The rollout thread's share of the cores and when each of its batches starts.

    Args:
        share_cores: The update uses the rollout thread's cores while that thread is idle, and
            the rollout thread the update's while the update waits for its batch (default
            True: :mod:`~dapo_lightning.shared_cores`). The thread counts then follow the
            timing, and some reductions (bf16 autocast's) round differently on another count:
            a run repeats to rounding, not bit for bit. False: a fixed split, bit-exact runs
            and resumes.
        start_after_updates: The next batch starts generating after this many of the current
            step's optimizer updates instead of at the hand-over (0, default), with the weights
            after them: its samples are that many policy versions fresher, and the update runs
            alone (on all the cores) until then. Worth it where generation beside the rest of
            the update still ends before it (the trainer then never waits:
            ``time/trainer_wait_s``); a step with fewer updates starts the batch when it ends.

    Raises:
        ConfigError: ``start_after_updates`` not an integer >= 0.
    """

    share_cores: bool = True
    start_after_updates: int = 0

    def __post_init__(self) -> None:
        check_count(
            f"{ONE_STEP_OFF_PATH}.start_after_updates", self.start_after_updates, 0, "updates"
        )


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


#: Flat ``dynamic_sampling`` keys of configs saved before the one-step-off settings were
#: grouped -> their field of ``dynamic_sampling.one_step_off`` (:class:`OneStepOffConfig`).
LEGACY_ONE_STEP_OFF_KEYS = ("share_cores", "start_after_updates")


def group_legacy_settings(state: dict[str, Any]) -> dict[str, Any]:
    """An unpickled ``DynamicSamplingConfig`` state with its settings groups: a flat one
    (``selection`` a string, ``max_skip``, ...; ``share_cores``) gets a
    :class:`PromptSelectionConfig` and a :class:`OneStepOffConfig` of those keys; today's
    state is returned as it is (a copy)."""
    state = dict(state)
    if not isinstance(state.get("selection"), PromptSelectionConfig):
        legacy = LEGACY_SELECTION_KEYS.items()
        state["selection"] = PromptSelectionConfig(
            **{new: state.pop(old) for old, new in legacy if old in state}
        )
    if not isinstance(state.get("one_step_off"), OneStepOffConfig):
        flat = {key: state.pop(key) for key in LEGACY_ONE_STEP_OFF_KEYS if key in state}
        state["one_step_off"] = OneStepOffConfig(**flat)
    return state


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
            :class:`~dapo_lightning.data.selection.difficulty.PromptSelectionConfig`; YAML
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
        min_gen_batch_size: Floor of a sized round over all ranks (default 1: none), e.g. 16
            with the vLLM engine, whose CPU rate at 2 prompts per call is 0.77x that at 16
            (:func:`~dapo_lightning.data.selection.sampler.sized_round`); never above the cap, the
            epoch or the eligible prompts. The surplus goes as above.
        in_flight: With an engine that streams groups (``stream_groups``: the vLLM engine), a
            round stops starting groups as soon as the batch is full: groups are scored as they
            finish, the requests not started yet are aborted (their prompts drawn first next
            time) and the started ones finish (:data:`~dapo_lightning.rollout.base.DRAIN`; their
            kept groups go to the carry-over). Other engines (HF) keep whole rounds.
        pipeline: ``"sync"`` (default): a step's rollouts are generated right before its
            update, with the newest weights. ``"one_step_off"``: the next step's rollouts are
            generated on a rollout thread while this step updates, with the weights from
            before this step's updates (one rollout step stale, corrected like carried-over
            groups; :mod:`~dapo_lightning.data.streams.one_step_off`).
        one_step_off: With ``one_step_off``, the rollout thread's share of the cores and when
            each batch starts: :class:`~dapo_lightning.data.sampling.settings.OneStepOffConfig`; YAML
            ``one_step_off: {share_cores: true, start_after_updates: 0}``.

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
    min_gen_batch_size: int = 1
    pipeline: Pipeline = "sync"
    one_step_off: OneStepOffConfig = field(default_factory=OneStepOffConfig)

    def __post_init__(self) -> None:
        path = DYNAMIC_SAMPLING_PATH
        check_choice(f"{path}.pipeline", self.pipeline, choices_of(Pipeline))
        fix = "one_step_off: {share_cores: true, start_after_updates: 0}"
        group = as_group(self.one_step_off, OneStepOffConfig, ONE_STEP_OFF_PATH, fix)
        object.__setattr__(self, "one_step_off", group)
        start = group.start_after_updates
        if start and self.pipeline != "one_step_off":
            raise ConfigError(
                f"{ONE_STEP_OFF_PATH}.start_after_updates={start} delays the one-step-off "
                f"rollout thread; with {path}.pipeline={self.pipeline!r} every batch starts "
                "after its step: set pipeline: one_step_off or start_after_updates: 0."
            )
        check_choice(f"{path}.filter_metric", self.filter_metric, choices_of(FilterMetric))
        check_choice(f"{path}.on_exhausted", self.on_exhausted, choices_of(OnExhausted))
        check_choice(f"{path}.round_sizing", self.round_sizing, choices_of(RoundSizing))
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
        if self.max_staleness is not None:
            check_count(
                f"{DYNAMIC_SAMPLING_PATH}.max_staleness",
                self.max_staleness,
                0,
                "policy versions, or null",
            )
        object.__setattr__(self, "selection", as_selection(self.selection))
        if self.max_gen_batch_size is not None:
            check_count(
                f"{DYNAMIC_SAMPLING_PATH}.max_gen_batch_size",
                self.max_gen_batch_size,
                1,
                "prompts, or null",
            )
        check_count(
            f"{DYNAMIC_SAMPLING_PATH}.min_gen_batch_size", self.min_gen_batch_size, 1, "prompts"
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

    @property
    def reviews(self) -> bool:
        """Retired prompts are reviewed (drawn at ``review_weight`` when their turn comes)."""
        return self.selection.retire_after > 0 and self.selection.review_weight > 0

    def make_tracker(self) -> DifficultyTracker:
        """Per-prompt statistics (retiring, parking, predictive selection, and the regression
        statistic of every run)."""
        return DifficultyTracker(self.selection)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (``torch.load`` of a checkpoint's hyper-parameters); a config saved before
        the prompt-selection or one-step-off settings were grouped is mapped onto
        ``selection`` and ``one_step_off``
        (:func:`group_legacy_settings`)."""
        self.__dict__.update(group_legacy_settings(state))


def as_selection(value: Any) -> PromptSelectionConfig:
    """``value`` as a :class:`PromptSelectionConfig` (:func:`~dapo_lightning.checks.as_group`).

    Raises:
        ConfigError: anything else, e.g. the former ``selection: uniform`` (now
            ``selection: {strategy: uniform}``).
    """
    fix = (
        f"selection: {{strategy: {value}}} (max_skip, revisit_within, retire_after, park_after "
        "and revisit_every moved into it too)"
    )
    return as_group(value, PromptSelectionConfig, SELECTION_PATH, fix)


#: Where checkpoints written before this module was split from ``producer.py`` name the class
#: (``torch.load(weights_only=True)`` finds it under that name too).
LEGACY_CLASS_PATH = "dapo_lightning.data.producer.DynamicSamplingConfig"
torch.serialization.add_safe_globals([(DynamicSamplingConfig, LEGACY_CLASS_PATH)])
