"""Per-prompt pass-rate statistics, retiring solved prompts, parking hopeless ones, and
predictive selection (beyond the paper). Their settings are one group,
:class:`PromptSelectionConfig` (``data.dynamic_sampling.selection``).

A *visit* is one generation of a group for a prompt. After each visit the prompt's statistics
(visits, samples, correct samples, streaks of all-correct and all-wrong visits, ever solved) are
updated with the ``acc`` of its samples.

- Retire: a prompt whose last ``retire_after`` visits in a row were all-correct is retired and
  not drawn in turn any more (its groups would have zero variance); it is *reviewed* instead
  (under either strategy): when its turn comes it is drawn with probability ``review_weight``
  (:func:`take_probability`), and a review that is not all-correct puts it back in the draw.
  Prompts a policy once solved regress, and the cost of repairing them grows with the delay
  before they are seen again (issue 40).
- Regression: a prompt all-correct at some visit and not all-correct at a later one has
  *regressed* (``data/regressed_frac``, :meth:`DifficultyTracker.regressed_frac`).
- Park: a prompt never solved after ``park_after`` visits is parked; it is skipped until
  ``revisit_every`` epochs have passed since it was parked, then visited once more (and parked
  again if still unsolved; solving it unparks it).
- Predictive selection (:class:`PredictiveSelector`, beyond the paper; the idea of GRESO, 2025):
  a prompt whose history predicts a zero-variance group likelier than a kept one is skipped. The
  history is a Beta posterior on the prompt's pass rate ``p``: prior ``Beta(a0, b0)``
  (:data:`PRIOR`, U-shaped) plus the correct and wrong sample counts, each visit's counts added
  to the older ones multiplied by ``history_decay`` (1/2: recent visits weigh more, so a prompt
  whose skill changed is believed again quickly). The probability that the next group of ``n``
  has zero variance is the posterior expectation (:func:`zero_variance_prob`)::

      P0 = E[p^n + (1 - p)^n] = prod_{k<n} (a + k) / (a + b + k) + prod_{k<n} (b + k) / (a + b + k)

  The prompt is skipped with probability ``max_skip`` when ``P0 > skip_threshold`` (1/2),
  never otherwise (on benchmarks/sampling_efficiency.py, with in-flight aborts and no
  carry-over, skipping with probability ``min(P0, max_skip)`` measured 1.89 n samples per kept
  group, the threshold 1.77 n). A prompt never visited is never skipped, and one is always
  taken once it is *due* (:meth:`PredictiveSelector.revisit_interval`): ``revisit_after`` epochs
  after its last visit, doubled for each further visit in a row with the same zero-variance
  outcome, back to ``revisit_after`` once the outcome changes, at most ``revisit_within``. No
  prompt is starved: the epochs between two visits of an eligible prompt are at most
  ``revisit_within``, and a prompt whose skill changed is visited again within that bound.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dapo_lightning.checks import (
    ConfigError,
    check_choice,
    check_count,
    check_finite,
    choices_of,
)

SelectionStrategy = Literal["uniform", "predictive"]

#: Where :class:`PromptSelectionConfig` sits in a run's YAML (its errors name this path).
SELECTION_PATH = "data.dynamic_sampling.selection"

#: Beta prior of a prompt's pass rate for :func:`zero_variance_prob`: U-shaped, as RL pass
#: rates are (most prompts are never or always solved; benchmarks/RESULTS.md). On the simulated
#: recipe (benchmarks/sampling_efficiency.py) it needs fewer samples per kept group than the
#: Jeffreys prior Beta(1/2, 1/2) (see RESULTS.md, "Sampling efficiency").
PRIOR: tuple[float, float] = (0.05, 0.05)


@dataclass(frozen=True)
class PromptSelectionConfig:
    """Which prompts are drawn: retiring solved ones, parking hopeless ones, predictive skipping.

    Held by :class:`~dapo_lightning.data.sampling.producer.DynamicSamplingConfig` as ``selection``; YAML
    ``data.init_args.dynamic_sampling.selection.{strategy, max_skip, ...}``.

    Args:
        strategy: ``"uniform"`` (default: every eligible prompt in turn) or ``"predictive"``
            (skip a prompt, with probability ``max_skip``, whose history puts the probability
            that its next group has zero variance above ``skip_threshold``;
            :class:`PredictiveSelector`). Uniform is the default because it learned more where
            both were measured (issue 40, benchmarks/RESULTS.md): the quickstart reached 0.9 on
            5 of 5 seeds against 1 of 3; on the SmolLM2 reasoning-gym recipe (3 seeds, 20
            CPU-minutes) a mean held-out accuracy over the budget at least predictive's and the
            paper's sampling's (0.637 against 0.628 and 0.630) and a higher final one (0.805
            against 0.762 and 0.789).
            Predictive selection needs a filter (``filter_metric`` not null); without one it is
            uniform.
        max_skip: Skip probability of a prompt over ``skip_threshold``, in [0, 1) (the
            exploration floor is ``1 - max_skip``).
        revisit_within: The no-starvation bound: predictive selection never skips a prompt not
            visited for this many epochs, so the epochs between two visits of an eligible
            prompt are at most this (the cap of the back-off from ``revisit_after``).
        retire_after: Retire prompts all-correct in this many visits in a row (0: never).
        park_after: Park prompts never solved after this many visits (0: never).
        revisit_every: Epochs a parked prompt waits before it is visited again.
        skip_threshold: Predictive selection skips only prompts whose zero-variance
            probability is above this, in [0, 1) (0.5: a zero-variance group likelier than a
            kept one; 0.3, 0.4, 0.6, 0.7 measured 1.53-1.57 n against 1.53 n, second pass).
        history_decay: Weight of a prompt's older samples at each new visit in the estimate
            of that probability, in (0, 1] (1: plain counts; 1/2: the last two visits weigh
            3/4; 0.9, the former value, left 0.17 n of mispredicted groups against 0.10 n
            over 600 simulated steps: benchmarks/RESULTS.md, third pass).
        revisit_after: Epochs after its last visit at which predictive selection takes a
            prompt whatever its prediction (it is *due*); doubled for each further visit in a
            row with the same zero-variance outcome (all wrong again, or all right again),
            back to this once the outcome changes, never over ``revisit_within``
            (:meth:`PredictiveSelector.revisit_interval`; ``>= revisit_within``: no back-off).

    Raises:
        ConfigError: a setting out of range, named by its YAML path.
    """

    strategy: SelectionStrategy = "uniform"
    max_skip: float = 0.99
    revisit_within: int = 32
    retire_after: int = 3
    park_after: int = 0
    revisit_every: int = 1
    skip_threshold: float = 0.5
    history_decay: float = 0.5
    revisit_after: int = 16
    #: The probability that a retired prompt is drawn when its turn comes (a review; its
    #: expected gap is 1 / review_weight epochs), in [0, 1]; 0: retired for good (the former
    #: behaviour). 0.2 as prime-rl's easy-pool weight: solved prompts kept at a fifth of the
    #: rate of the others rather than dropped (issue 40).
    review_weight: float = 0.2

    def __post_init__(self) -> None:
        check_choice(f"{SELECTION_PATH}.strategy", self.strategy, choices_of(SelectionStrategy))
        check_finite(f"{SELECTION_PATH}.max_skip", self.max_skip, "Give a number in [0, 1).")
        if not 0.0 <= self.max_skip < 1.0:
            raise ConfigError(
                f"{SELECTION_PATH}.max_skip must be in [0, 1) (1 - max_skip is the "
                f"exploration floor), got {self.max_skip!r}."
            )
        check_count(f"{SELECTION_PATH}.revisit_after", self.revisit_after, 1, "epochs")
        check_count(f"{SELECTION_PATH}.revisit_within", self.revisit_within, 1, "epochs")
        check_finite(
            f"{SELECTION_PATH}.skip_threshold", self.skip_threshold, "Give a number in [0, 1)."
        )
        if not 0.0 <= self.skip_threshold < 1.0:
            raise ConfigError(
                f"{SELECTION_PATH}.skip_threshold must be in [0, 1) (a prompt is skipped only "
                f"when P0 is above it), got {self.skip_threshold!r}."
            )
        check_finite(
            f"{SELECTION_PATH}.history_decay", self.history_decay, "Give a number in (0, 1]."
        )
        if not 0.0 < self.history_decay <= 1.0:
            raise ConfigError(
                f"{SELECTION_PATH}.history_decay must be in (0, 1] (the weight of the older "
                f"samples at each visit), got {self.history_decay!r}."
            )
        check_count(f"{SELECTION_PATH}.retire_after", self.retire_after, 0, "0 = never")
        check_count(f"{SELECTION_PATH}.park_after", self.park_after, 0, "0 = never")
        check_count(f"{SELECTION_PATH}.revisit_every", self.revisit_every, 1, "epochs")
        check_finite(
            f"{SELECTION_PATH}.review_weight", self.review_weight, "Give a number in [0, 1]."
        )
        if not 0.0 <= self.review_weight <= 1.0:
            raise ConfigError(
                f"{SELECTION_PATH}.review_weight must be in [0, 1] (the probability that a "
                f"retired prompt is reviewed at its turn; 0: never), got {self.review_weight!r}."
            )


@dataclass
class PromptStats:
    """Statistics of one prompt (see the module docstring)."""

    visits: int = 0
    samples: int = 0
    correct: int = 0
    solved_streak: int = 0
    #: All-wrong visits in a row (with ``solved_streak``: the same zero-variance outcome).
    wrong_streak: int = 0
    ever_solved: bool = False
    retired: bool = False
    parked_epoch: int | None = None
    #: Decayed correct / wrong sample counts (``history_decay``), the posterior's evidence.
    recent_correct: float = 0.0
    recent_wrong: float = 0.0
    #: Epoch of the last visit (None: never visited).
    last_epoch: int | None = None
    #: All-correct at some visit; ``regressed``: and not all-correct at a later one.
    ever_all_correct: bool = False
    regressed: bool = False

    @property
    def pass_rate(self) -> float | None:
        return self.correct / self.samples if self.samples else None

    @property
    def still_streak(self) -> int:
        """Visits in a row, up to the last, with the same zero-variance outcome (all right,
        or all wrong); 0 after a group with variance."""
        return max(self.solved_streak, self.wrong_streak)


class DifficultyTracker:
    """Per-prompt statistics keyed by prompt uid.

    Args:
        selection: Its ``retire_after``, ``park_after``, ``revisit_every`` and
            ``history_decay`` (checked there); None: the defaults.
    """

    def __init__(self, selection: PromptSelectionConfig | None = None) -> None:
        self.config = selection if selection is not None else PromptSelectionConfig()
        self.stats: dict[str, PromptStats] = {}

    def get(self, uid: str) -> PromptStats:
        return self.stats.setdefault(uid, PromptStats())

    def update(self, uid: str, accs: Sequence[float], epoch: int) -> None:
        """Record one visit of ``uid`` whose samples scored ``accs`` (1.0 = correct)."""
        s = self.get(uid)
        correct = sum(1 for a in accs if a > 0.5)
        s.visits += 1
        s.samples += len(accs)
        s.correct += correct
        all_correct = bool(accs) and correct == len(accs)
        s.solved_streak = s.solved_streak + 1 if all_correct else 0
        s.regressed = s.regressed or (s.ever_all_correct and bool(accs) and not all_correct)
        s.ever_all_correct = s.ever_all_correct or all_correct
        s.wrong_streak = s.wrong_streak + 1 if accs and correct == 0 else 0
        s.ever_solved = s.ever_solved or correct > 0
        cfg = self.config
        s.recent_correct = cfg.history_decay * s.recent_correct + correct
        s.recent_wrong = cfg.history_decay * s.recent_wrong + len(accs) - correct
        s.last_epoch = epoch
        if s.retired and not all_correct:
            s.retired = False  # a review that failed: the prompt is back in the draw
        if cfg.retire_after and s.solved_streak >= cfg.retire_after:
            s.retired = True
        if s.ever_solved:
            s.parked_epoch = None
        elif cfg.park_after and s.visits >= cfg.park_after:
            s.parked_epoch = epoch

    def eligible(self, uid: str, epoch: int) -> bool:
        """Whether ``uid`` may be drawn in ``epoch``."""
        s = self.stats.get(uid)
        if s is None:
            return True
        if s.retired:
            return False
        if s.parked_epoch is not None:
            return epoch - s.parked_epoch >= self.config.revisit_every
        return True

    @property
    def num_retired(self) -> int:
        return sum(s.retired for s in self.stats.values())

    @property
    def num_parked(self) -> int:
        return sum(s.parked_epoch is not None and not s.retired for s in self.stats.values())

    @property
    def regressed_frac(self) -> float:
        """Of the prompts visited, the share all-correct at some visit and not all-correct at
        a later one (0 before any visit)."""
        return sum(s.regressed for s in self.stats.values()) / max(len(self.stats), 1)

    def state_dict(self) -> dict[str, Any]:
        # vars() copies, not asdict(): this runs before every batch (PromptStats is flat)
        return {"stats": {uid: dict(vars(s)) for uid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = {uid: PromptStats(**s) for uid, s in state["stats"].items()}


def zero_variance_prob(
    correct: float, wrong: float, n: int, prior: tuple[float, float] = PRIOR
) -> float:
    """Posterior probability that ``n`` new samples are all right or all wrong.

    With ``p ~ Beta(a, b)``, ``a = prior[0] + correct``, ``b = prior[1] + wrong``::

        E[p^n] + E[(1 - p)^n] = prod_{k<n} (a + k) / (a + b + k) + prod_{k<n} (b + k) / (a + b + k)

    (the Beta moments ``B(a + n, b) / B(a, b)``), computed in log space.
    """
    a, b = prior[0] + correct, prior[1] + wrong
    if n < 1 or a <= 0 or b <= 0:
        raise ValueError(
            f"zero_variance_prob needs n >= 1 and a positive posterior, got {n}, {a}, {b}."
        )
    lg = math.lgamma
    log_norm = lg(a + b) - lg(a + b + n)
    return math.exp(lg(a + n) - lg(a) + log_norm) + math.exp(lg(b + n) - lg(b) + log_norm)


def revisit_interval(stats: PromptStats, selection: PromptSelectionConfig) -> int:
    """Epochs after its last visit at which predictive selection takes a prompt whatever its
    prediction (it is *due*)::

        min(revisit_after * 2^(k - 1), revisit_within),  k = max(1, still_streak)

    ``still_streak``: visits in a row with the same zero-variance outcome. A prompt all wrong
    at its first visit is due after ``revisit_after`` epochs; all wrong again there, after twice
    that; and so on up to ``revisit_within``, the no-starvation bound. A group with variance or
    the other outcome starts over from ``revisit_after``."""
    doublings = min(max(1, stats.still_streak) - 1, selection.revisit_within.bit_length())
    return min(selection.revisit_after << doublings, selection.revisit_within)


def skip_probability(
    stats: PromptStats | None, epoch: int, n: int, selection: PromptSelectionConfig
) -> float:
    """The probability that predictive selection passes over a prompt at its turn in ``epoch``
    (retirement aside), for groups of ``n``::

        0           never visited, or due (epoch - last_epoch >= revisit_interval)
        max_skip    P0 > skip_threshold,  P0 = zero_variance_prob(recent counts, n)
        0           otherwise"""
    if stats is None or stats.last_epoch is None:
        return 0.0
    if epoch - stats.last_epoch >= revisit_interval(stats, selection):
        return 0.0
    p0 = zero_variance_prob(stats.recent_correct, stats.recent_wrong, n)
    return selection.max_skip if p0 > selection.skip_threshold else 0.0


def take_probability(
    stats: PromptStats | None, epoch: int, n: int, selection: PromptSelectionConfig
) -> float:
    """The probability that predictive selection draws a prompt when its turn comes in
    ``epoch`` (its selection weight), for groups of ``n``::

        review_weight                                  retired (a review)
        1 - skip_probability(stats, epoch, n, ...)     otherwise: 1 never visited, due or
                                                       P0 <= skip_threshold; 1 - max_skip else

    Parked prompts are not eligible at all (:meth:`DifficultyTracker.eligible`). A retired
    prompt is reviewed whatever its prediction or due date, 1 / review_weight epochs apart on
    average; a prompt all-correct at fewer than ``retire_after`` visits in a row is still
    passed over with ``max_skip`` until it is due (``revisit_after`` and on, at most
    ``revisit_within`` epochs)."""
    if stats is not None and stats.retired and stats.last_epoch is not None:
        return selection.review_weight
    return 1.0 - skip_probability(stats, epoch, n, selection)


#: Why :meth:`PredictiveSelector.decide` takes or skips a prompt (the benchmark's breakdown).
Decision = Literal["new", "due", "predicted", "floor", "skip"]


class PredictiveSelector:
    """Skips prompts whose next group is predicted to have zero variance (module docstring),
    and reviews retired prompts (:meth:`review`; under uniform selection that is all it does).

    Args:
        n: Group size of the next visit.
        selection: Its ``max_skip``, ``skip_threshold``, ``revisit_after`` and
            ``revisit_within`` (checked there).
        seed: Seeds the skip decisions (its state is in :meth:`state_dict`).
    """

    def __init__(self, n: int, selection: PromptSelectionConfig, seed: str | int = 0) -> None:
        self.n = n
        self.config = selection
        self.rng = random.Random(seed)
        self.skipped = 0  # skip decisions so far (the producer reports the difference per step)
        self.reviewed = 0  # reviews of retired prompts so far

    def revisit_interval(self, stats: PromptStats) -> int:
        """Epochs after its last visit at which a prompt is due (never skipped):
        :func:`revisit_interval`."""
        return revisit_interval(stats, self.config)

    def is_due(self, stats: PromptStats, epoch: int) -> bool:
        """Whether ``revisit_interval`` epochs have passed since the prompt's last visit."""
        last = stats.last_epoch if stats.last_epoch is not None else epoch
        return epoch - last >= self.revisit_interval(stats)

    def skip_prob(self, stats: PromptStats | None, epoch: int) -> float:
        """:func:`skip_probability`: ``max_skip`` if ``P0 > skip_threshold``, else 0; 0 for a
        prompt never visited or due (:meth:`revisit_interval`)."""
        return skip_probability(stats, epoch, self.n, self.config)

    def decide(self, stats: PromptStats | None, epoch: int) -> Decision:
        """``"skip"``, or why the prompt is taken: ``"new"`` (never visited), ``"due"``
        (:meth:`revisit_interval`), ``"predicted"`` (``P0 <= skip_threshold``) or ``"floor"``
        (over the threshold, taken with probability ``1 - max_skip``). One RNG draw per
        decision over the threshold."""
        if stats is None or stats.last_epoch is None:
            return "new"
        prob = self.skip_prob(stats, epoch)
        if prob <= 0.0:
            return "due" if self.is_due(stats, epoch) else "predicted"
        if self.rng.random() < prob:
            self.skipped += 1
            return "skip"
        return "floor"

    def take(self, stats: PromptStats | None, epoch: int) -> bool:
        """Whether to draw the prompt now (:meth:`decide` is not ``"skip"``)."""
        return self.decide(stats, epoch) != "skip"

    def review(self, stats: PromptStats | None) -> bool:
        """Whether to draw a retired prompt now (a review): with probability
        ``review_weight`` (:func:`take_probability`), one RNG draw; False for any other
        prompt and when ``review_weight`` is 0 (no draw)."""
        weight = self.config.review_weight
        if stats is None or not stats.retired or weight <= 0.0:
            return False
        if self.rng.random() < weight:
            self.reviewed += 1
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "skipped": self.skipped, "reviewed": self.reviewed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self.skipped = int(state["skipped"])
        self.reviewed = int(state.get("reviewed", 0))
