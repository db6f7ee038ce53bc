"""The pure judge of training collapse: signals, detectors and verdicts, with no Lightning in it.

RL fine-tuning of language models fails in recognisable ways: the policy's entropy
collapses, responses degenerate into repetition, the answer format disappears, every group
gets the same reward (dynamic sampling then has to generate ever more), lengths collapse or
blow up, gradient norm or KL spike, or the loss becomes non-finite.

The file reads top-down:

* :data:`SIGNALS`, one row per signal: where it is observed, which reading it compares, in
  which direction it is bad (:data:`BAD_WHEN`, like ``EarlyStopping.mode_dict``) and whether
  it is judged relative to its own moving average.
* :class:`Detector`, the user's settings for one signal, and :func:`default_detectors`.
* :func:`judge`, pure: (settings, observed value, running :class:`SignalState`) -> (new
  state, fired, reason); :func:`update_readings` / :func:`step_readings` build the observed
  values.

The callback that feeds it and acts on its verdicts is
:class:`~dapo_lightning.callbacks.collapse.CollapseDetector`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.checks import ConfigError, check_count, check_finite

Signal = Literal[
    "entropy",
    "entropy_drop",
    "repetition",
    "format",
    "zero_variance",
    "oversampling",
    "length_low",
    "length_high",
    "truncation",
    "grad_norm_spike",
    "kl_spike",
    "nonfinite",
]
Action = Literal["warn", "stop", "rollback"]
Source = Literal["update", "step"]


def ngram_repetition(tokens: Iterable[int], n: int = 4) -> float:
    """Repeated n-gram ratio of one token sequence.

    ``ratio = 1 - (number of distinct n-grams) / (number of n-grams)``, with
    ``len(tokens) - n + 1`` n-grams in total; 0 for sequences shorter than ``n``.
    0 means no n-gram occurs twice; a sequence cycling one n-gram tends to 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    seq = list(tokens)
    total = len(seq) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(seq[i : i + n]) for i in range(total)})
    return 1.0 - distinct / total


def ema_update(ema: float | None, value: float, decay: float) -> float:
    """Exponential moving average: ``value`` if ``ema`` is None, else
    ``decay * ema + (1 - decay) * value``."""
    if ema is None:
        return float(value)
    return decay * ema + (1.0 - decay) * float(value)


def relative_drop(value: float, reference: float) -> float:
    """Fall of ``value`` below ``reference`` as a fraction: ``(reference - value) / reference``
    (0 when ``reference <= 0``; negative when ``value`` rose)."""
    if reference <= 0:
        return 0.0
    return (reference - value) / reference


def spike_ratio(value: float, reference: float, eps: float = 1e-12) -> float:
    """How many times ``value`` exceeds its reference: ``value / max(reference, eps)``."""
    return value / max(reference, eps)


@dataclass(frozen=True)
class SignalSpec:
    """How one signal is observed and judged (a row of :data:`SIGNALS`).

    Args:
        source: ``"update"``: after every optimizer update, from the ``on_dapo_update``
            metrics (:func:`update_readings`); ``"step"``: once per rollout step, at
            ``on_train_batch_end`` (:func:`step_readings`).
        reading: Key of the observed value among the source's readings (``{name}`` is
            replaced by the detector's name).
        bad_when: ``"below"`` or ``"above"`` the threshold (a key of :data:`BAD_WHEN`).
        relative: If set, the judged value is ``relative(reading, EMA of reading)``.
        floor: The reading itself must also exceed ``Detector.min_value`` to count as bad.
    """

    source: Source
    reading: str
    bad_when: Literal["below", "above"]
    relative: Callable[[float, float], float] | None = None
    floor: bool = False


#: Comparison of the judged value with the threshold that makes it bad.
BAD_WHEN: dict[str, Callable[[float, float], bool]] = {"below": operator.lt, "above": operator.gt}

#: Every signal a :class:`Detector` can watch (the table in its docstring, as data).
SIGNALS: dict[str, SignalSpec] = {
    "entropy": SignalSpec("update", "entropy", "below"),
    "entropy_drop": SignalSpec("update", "entropy", "above", relative=relative_drop),
    "grad_norm_spike": SignalSpec("update", "grad_norm", "above", spike_ratio, floor=True),
    "kl_spike": SignalSpec("update", "approx_kl_k3", "above", spike_ratio, floor=True),
    "nonfinite": SignalSpec("update", "skipped_nonfinite", "above"),
    "repetition": SignalSpec("step", "repetitive_share/{name}", "above"),
    "format": SignalSpec("step", "no_answer_share", "above"),
    "zero_variance": SignalSpec("step", "zero_variance_frac", "above"),
    "oversampling": SignalSpec("step", "oversampling", "above"),
    "length_low": SignalSpec("step", "response_length_mean", "below"),
    "length_high": SignalSpec("step", "response_length_mean", "above"),
    "truncation": SignalSpec("step", "truncated_share", "above"),
}


@dataclass
class Detector:
    """One watched signal: when it is bad for ``patience`` consecutive observations, act.

    ==================  =========================================================  ==========
    ``signal``          observed value (bad when ...)                              observed
    ==================  =========================================================  ==========
    entropy             ``metrics["entropy"]`` (bad below ``threshold``)           per update
    entropy_drop        ``1 - H / EMA(H)``, fractional fall (above ``threshold``)  per update
    grad_norm_spike     ``grad_norm / EMA(grad_norm)`` (above ``threshold``)       per update
    kl_spike            ``approx_kl_k3 / EMA(approx_kl_k3)`` (above)               per update
    nonfinite           ``metrics["skipped_nonfinite"]`` (above ``threshold``)     per update
    repetition          share of responses with ``ngram_repetition(ids, ngram) >   per step
                        max_repeat`` (above ``threshold``)
    format              share of responses with ``extra["has_answer"]`` False      per step
    zero_variance       ``batch.stats["zero_variance_frac"]``                      per step
    oversampling        ``stats["generated_groups"] / stats["kept_groups"]``       per step
    length_low          mean response length (bad below ``threshold``)             per step
    length_high         mean response length (above ``threshold``)                 per step
    truncation          share of truncated responses (above ``threshold``)         per step
    ==================  =========================================================  ==========

    "per update" signals come from the ``on_dapo_update`` hook after every optimizer update
    (non-finite metrics are not judged: the nonfinite detector covers those updates);
    "per step" signals once per rollout step (repetition and format over every response
    generated for the step, including groups dynamic sampling dropped; the others from the
    training batch). EMA signals are judged only after ``warmup`` observations, and their EMA
    is updated with healthy observations only, so a sustained spike keeps counting as bad.

    Args:
        signal: What to watch (table above; :data:`SIGNALS` holds it as data).
        threshold: Bound the value is compared against (see the table for the direction).
        patience: Consecutive bad observations before the action fires (then the count restarts).
        action: ``"warn"`` (rank-zero warning), ``"stop"`` (``trainer.should_stop``) or
            ``"rollback"`` (restore the last healthy snapshot).
        name: Name in logs (``collapse/<name>``, ``collapse/fired_<name>``); defaults to ``signal``.
        ema_decay: EMA signals: decay of the moving average, in [0, 1).
        warmup: EMA signals: observations that only feed the EMA before judging starts.
        min_value: Spike signals: the raw value must also exceed this to count as bad (KL is
            ~0 on the first update of each step, so tiny EMAs make large ratios meaningless).
        ngram: Repetition: n-gram size.
        max_repeat: Repetition: a response with repeated n-gram ratio above this is repetitive.

    Raises:
        ValueError: A field is out of range (the message names it).

    Example::

        Detector("kl_spike", threshold=20.0, patience=3, min_value=1e-3, action="rollback")
    """

    signal: Signal
    threshold: float
    patience: int = 1
    action: Action = "warn"
    name: str | None = None
    ema_decay: float = 0.9
    warmup: int = 10
    min_value: float = 0.0
    ngram: int = 4
    max_repeat: float = 0.5

    def __post_init__(self) -> None:
        which = f"detector {self.signal!r}"
        for field in ("threshold", "min_value", "max_repeat", "ema_decay"):
            check_finite(f"Detector.{field}", getattr(self, field), f"Give a number ({which}).")
        check_count("Detector.patience", self.patience, 1, f"bad values in a row; {which}")
        check_count("Detector.warmup", self.warmup, 0, f"observations before judging; {which}")
        check_count("Detector.ngram", self.ngram, 1, f"n-gram size; {which}")
        checks = (
            ("signal", self.signal in SIGNALS, f"one of {tuple(SIGNALS)}"),
            ("action", self.action in ("warn", "stop", "rollback"), "'warn', 'stop' or 'rollback'"),
            ("ema_decay", 0 <= self.ema_decay < 1, "in [0, 1)"),
        )
        for field, ok, must in checks:
            if not ok:
                raise ConfigError(
                    f"Detector.{field} must be {must}, got {getattr(self, field)!r} ({which})."
                )
        if self.name is None:
            self.name = self.signal

    @property
    def spec(self) -> SignalSpec:
        """This detector's row of :data:`SIGNALS`."""
        return SIGNALS[self.signal]

    def is_bad(self, value: float) -> bool:
        """Whether ``value`` crosses ``threshold`` in the signal's bad direction."""
        return BAD_WHEN[self.spec.bad_when](value, self.threshold)


def default_detectors() -> list[Detector]:
    """A conservative default set: warnings for most signals, stop on repeated non-finite loss."""
    return [
        Detector("entropy", threshold=0.05, patience=5),
        Detector("entropy_drop", threshold=0.5, patience=5),
        Detector("repetition", threshold=0.5, patience=3),
        Detector("format", threshold=0.9, patience=3),
        Detector("zero_variance", threshold=0.95, patience=5),
        Detector("truncation", threshold=0.5, patience=3),
        Detector("grad_norm_spike", threshold=10.0, patience=3),
        Detector("kl_spike", threshold=20.0, patience=3, min_value=1e-3),
        Detector("nonfinite", threshold=0.5, patience=3, action="stop"),
    ]


# ------------------------------------------------------------------------ the pure judge
@dataclass(frozen=True)
class SignalState:
    """Running state of one detector.

    Args:
        ema: EMA signals: moving average of the healthy readings (None before the first).
        seen: EMA signals: readings observed so far (warm-up ends at ``Detector.warmup``).
        streak: Consecutive bad observations since the last healthy one or the last firing.
    """

    ema: float | None = None
    seen: int = 0
    streak: int = 0


def judged_value(det: Detector, raw: float | None, state: SignalState) -> float | None:
    """The value compared with ``det.threshold``: ``raw``, or ``relative(raw, EMA)`` for EMA
    signals; None when there is nothing to judge (no reading, or EMA warm-up)."""
    relative = det.spec.relative
    if raw is None or relative is None:
        return raw
    if state.ema is None or state.seen < det.warmup:
        return None
    return relative(raw, state.ema)


def bad_here(det: Detector, raw: float | None, state: SignalState) -> bool:
    """Whether this reading is bad (value past the threshold and, for spikes, raw past
    ``min_value``)."""
    value = judged_value(det, raw, state)
    if value is None or not det.is_bad(value):
        return False
    return not det.spec.floor or raw > det.min_value


def judge(
    det: Detector, raw: float | None, state: SignalState, bad_elsewhere: bool = False
) -> tuple[SignalState, bool, str | None]:
    """Judge one observation: the new state, whether the detector fires, and why.

    A bad observation (here, or on another rank: ``bad_elsewhere``) extends the streak; the
    detector fires when the streak reaches ``patience``, and the streak restarts. A healthy
    observation ends the streak; no observation (``raw`` None, EMA warm-up) leaves it. EMA
    signals feed every reading to the EMA except bad ones.

    Args:
        det: The detector's settings.
        raw: This rank's reading for the signal (None: not observed).
        state: The detector's state before this observation.
        bad_elsewhere: The observation is bad on some rank (the ranks' agreement).

    Example::

        >>> det = Detector("entropy", threshold=0.1, patience=2)
        >>> judge(det, 0.05, SignalState())
        (SignalState(ema=None, seen=0, streak=1), False, None)
    """
    value = judged_value(det, raw, state)
    local_bad = bad_here(det, raw, state)
    ema, seen = state.ema, state.seen
    if raw is not None and det.spec.relative is not None:
        seen += 1
        if not local_bad:
            ema = ema_update(ema, raw, det.ema_decay)
    bad = local_bad or bad_elsewhere
    streak = state.streak + 1 if bad else (0 if value is not None else state.streak)
    if not bad or streak < det.patience:
        return SignalState(ema, seen, streak), False, None
    here = "not observed here" if value is None else f"value {value!r} here"
    seen_as = f"value {value!r}" if local_bad else f"{here}, bad on another rank"
    reason = (
        f"{det.name} fired ({seen_as}, threshold {det.threshold}, "
        f"{det.patience} consecutive bad observations)."
    )
    return SignalState(ema, seen, 0), True, reason


def update_readings(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of one update's metrics (non-finite ones are not judged)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def tally_rollouts(
    pending: Mapping[str, float], rollouts: ScoredRollouts, detectors: Sequence[Detector]
) -> dict[str, float]:
    """``pending`` plus this round's response counts: all, repetitive per repetition detector
    (``repetitive/<name>``), with answer-format information, without an answer."""
    out = {**pending, "responses": pending.get("responses", 0.0) + len(rollouts)}
    for det in (d for d in detectors if d.signal == "repetition"):
        key = f"repetitive/{det.name}"
        hits = sum(
            ngram_repetition(ids, det.ngram) > det.max_repeat for ids in rollouts.response_ids
        )
        out[key] = out.get(key, 0.0) + hits
    has_answer = rollouts.extra.get("has_answer")
    if has_answer is not None:
        out["format_seen"] = out.get("format_seen", 0.0) + len(has_answer)
        out["no_answer"] = out.get("no_answer", 0.0) + sum(not bool(h) for h in has_answer)
    return out


def step_readings(batch: Any, pending: Mapping[str, float]) -> dict[str, float]:
    """The per-step readings (only those this step has) from the training batch and the
    step's counts from :func:`tally_rollouts`."""
    out: dict[str, float] = {}
    stats = getattr(batch, "stats", None) or {}
    zero_variance = _stat(stats, "zero_variance_frac")
    if zero_variance is not None:
        out["zero_variance_frac"] = float(zero_variance)
    generated, kept = _stat(stats, "generated_groups"), _stat(stats, "kept_groups")
    if generated is not None and kept is not None:
        out["oversampling"] = float(generated) / float(kept) if kept > 0 else math.inf
    for key, attribute in (
        ("response_length_mean", "response_length"),
        ("truncated_share", "truncated"),
    ):
        values = getattr(batch, attribute, None)
        if values is not None and len(values) > 0:
            out[key] = float(values.float().mean())
    if pending.get("format_seen", 0.0) > 0:
        out["no_answer_share"] = pending["no_answer"] / pending["format_seen"]
    responses = pending.get("responses", 0.0)
    if responses > 0:
        for key, count in pending.items():
            if key.startswith("repetitive/"):
                out[f"repetitive_share/{key.removeprefix('repetitive/')}"] = count / responses
    return out


def _stat(stats: Mapping[str, Any], key: str) -> Any:
    """``stats[key]`` under its logged name ``data/<key>`` or its bare name; None if absent."""
    return stats.get(f"data/{key}", stats.get(key))
