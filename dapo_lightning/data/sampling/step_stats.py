"""This rank's statistics of one rollout step, each declared once with its reduce op over ranks.

:class:`StepStats` is a typed record of :class:`Stat` s: the producer adds to them as the step
runs (counts and seconds are summed over the step's rounds here), then
:meth:`StepStats.as_metrics` gives the ``RolloutBatch.stats`` dict by logged name. Over ranks
each statistic is reduced by the op its :class:`Stat` declares (:func:`rank_op`; the module's
:func:`~dapo_lightning.data.sampling.metrics.rollout_step_metrics` adds them to the one
:class:`~dapo_lightning.metrics.MetricAccumulator` of the step):

* ``sum``: counts (groups, samples, tokens, failures);
* ``max``: the slowest rank's seconds and rounds, and ``data/short_batch``;
* ``mean`` (each rank weighs 1): per-rank fractions and means (``data/kept_frac``,
  ``reward/<extra>``, the episode means ``env/*_mean``) and any name not declared here.

A reward's numeric ``extra`` field ``k`` is logged as ``reward/k``, this rank's mean over its
responses (``totals[k] / counts[k]``), then averaged over ranks.
"""

from __future__ import annotations

from typing import Any, overload

from dapo_lightning.metrics import ReduceOp


class Stat:
    """One statistic of a rollout step: its logged ``name`` and its reduce ``op`` over ranks.

    Declared on :class:`StepStats`; reading or writing it on a ``StepStats`` reads or writes
    that step's value (0.0 to start with).
    """

    def __init__(self, name: str, op: ReduceOp) -> None:
        self.name, self.op = name, op
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Stat: ...
    @overload
    def __get__(self, obj: StepStats, objtype: type | None = None) -> float: ...
    def __get__(self, obj: StepStats | None, objtype: type | None = None) -> float | Stat:
        return self if obj is None else obj.values[self.attr]

    def __set__(self, obj: StepStats, value: float) -> None:
        obj.values[self.attr] = value


class StepStats:
    """This rank's statistics of one rollout step (see the module docstring).

    Every rank reports every statistic (zeros included), so ranks log the same names.
    """

    generated_groups = Stat("data/generated_groups", "sum")
    kept_groups = Stat("data/kept_groups", "sum")
    batch_groups = Stat("data/batch_groups", "sum")
    carried_groups = Stat("data/carried_groups", "sum")
    dropped_stale_groups = Stat("data/dropped_stale_groups", "sum")
    generated_tokens = Stat("data/generated_tokens", "sum")
    reward_failures = Stat("data/reward_failures", "sum")
    retired = Stat("data/retired", "sum")
    parked = Stat("data/parked", "sum")
    #: Prompts dropped when loading (the data module sets it).
    dropped_prompts = Stat("data/dropped_prompts", "sum")
    generated_samples = Stat("data/generated_samples", "sum")
    skipped_predicted = Stat("data/skipped_predicted", "sum")
    aborted_groups = Stat("data/aborted_groups", "sum")
    dropped_surplus_groups = Stat("data/dropped_surplus_groups", "sum")
    gen_rounds = Stat("data/gen_rounds", "max")
    gen_seconds = Stat("data/gen_seconds", "max")
    score_seconds = Stat("data/score_seconds", "max")
    short_batch = Stat("data/short_batch", "max")
    #: Episodes the environment failed / that timed out (the data module sets them).
    env_failures = Stat("env/failures", "sum")
    #: Tokens of a multi-turn episode's observations (tool output), not sampled.
    env_observation_tokens = Stat("env/observation_tokens", "sum")
    env_timeouts = Stat("env/timeouts", "sum")
    #: Groups with no right episode given the environment's demonstration
    #: (``environment.demonstrate_unsolved``).
    demonstrations = Stat("env/demonstrations", "sum")
    samples_per_kept_group = Stat("data/samples_per_kept_group", "mean")
    kept_frac = Stat("data/kept_frac", "mean")
    zero_variance_frac = Stat("data/zero_variance_frac", "mean")
    epoch = Stat("data/epoch", "mean")
    #: Share of visited prompts that were all-correct at some visit and not at a later one.
    regressed_frac = Stat("data/regressed_frac", "mean")
    #: Share of this step's drawn prompts that were reviews of retired ones (``reviews /
    #: drawn``, 0 when none were drawn).
    review_frac = Stat("data/review_frac", "mean")

    def __init__(self) -> None:
        self.values: dict[str, float] = {s.attr: 0.0 for s in self.declared()}
        #: ``reward/<k>``: the sum of a numeric reward extra ``k`` and how many responses had it.
        self.reward_totals: dict[str, float] = {}
        self.reward_counts: dict[str, float] = {}
        #: Prompts drawn this step and the reviews among them (:func:`~.draw.draw_round`).
        self.drawn = 0.0
        self.reviews = 0.0

    @classmethod
    def declared(cls) -> list[Stat]:
        """The declared statistics, in order."""
        return [v for v in vars(cls).values() if isinstance(v, Stat)]

    def add_reward_extras(self, extras: dict[str, list[float]]) -> None:
        """Add one round's numeric reward extras (:func:`numeric_extras`)."""
        for key, values in extras.items():
            self.reward_totals[key] = self.reward_totals.get(key, 0.0) + sum(values)
            self.reward_counts[key] = self.reward_counts.get(key, 0.0) + float(len(values))

    def finish(self, epoch: int) -> None:
        """Set the step's derived fractions (kept, zero variance, samples per kept group,
        reviews)."""
        gen, kept = self.generated_groups, self.kept_groups
        self.kept_frac = kept / gen if gen else 1.0
        self.zero_variance_frac = 1.0 - self.kept_frac if gen else 0.0
        self.samples_per_kept_group = self.generated_samples / kept if kept else 0.0
        self.epoch = float(epoch)
        self.review_frac = self.reviews / self.drawn if self.drawn else 0.0

    def zero_sums(self) -> None:
        """Zero every statistic summed over ranks (a tensor-parallel member rank: its engine
        group's counts are reported once, by the group's first rank)."""
        for stat in self.declared():
            if stat.op == "sum":
                self.values[stat.attr] = 0.0

    def as_metrics(self) -> dict[str, float]:
        """The statistics by logged name (``RolloutBatch.stats``)."""
        out = {stat.name: float(self.values[stat.attr]) for stat in self.declared()}
        for key, total in self.reward_totals.items():
            out[f"reward/{key}"] = total / max(self.reward_counts[key], 1.0)
        return out


#: What the one-step-off pipeline adds to a batch's stats (:mod:`dapo_lightning.data.streams.one_step_off`):
#: the slowest rank's waits.
PIPELINE_STAT_OPS: dict[str, ReduceOp] = {"time/trainer_wait_s": "max", "time/engine_idle_s": "max"}

#: Each declared statistic's reduce op over ranks, by logged name.
_DECLARED_OPS: dict[str, ReduceOp] = {stat.name: stat.op for stat in StepStats.declared()}
STEP_STAT_OPS: dict[str, ReduceOp] = {**_DECLARED_OPS, **PIPELINE_STAT_OPS}

#: The statistics summed or maxed over ranks (the others are averaged); the table of older
#: releases, kept for code that imports it.
STAT_OPS: dict[str, ReduceOp] = {k: op for k, op in _DECLARED_OPS.items() if op != "mean"}


def rank_op(name: str) -> ReduceOp:
    """How the statistic ``name`` of a rollout step combines over ranks (``mean`` unless
    :class:`StepStats` declares otherwise)."""
    return STEP_STAT_OPS.get(name, "mean")


def numeric_extras(extra: dict[str, list[Any]]) -> dict[str, list[float]]:
    """The reward's ``extra`` fields whose every value is a number or bool (None skipped)."""
    out: dict[str, list[float]] = {}
    for key, values in extra.items():
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, (int, float, bool)) for v in present):
            out[key] = [float(v) for v in present]
    return out
