"""Training-collapse detection with warn / stop / rollback actions.

RL fine-tuning of language models fails in recognisable ways: the policy's entropy
collapses, responses degenerate into repetition, the answer format disappears, every group
gets the same reward (dynamic sampling then has to generate ever more), lengths collapse or
blow up, gradient norm or KL spike, or the loss becomes non-finite.

The file reads top-down, in the shape of Lightning's ``EarlyStopping``:

* :data:`SIGNALS`, one row per signal: where it is observed, which reading it compares, in
  which direction it is bad (:data:`BAD_WHEN`, like ``EarlyStopping.mode_dict``) and whether
  it is judged relative to its own moving average.
* :class:`Detector`, the user's settings for one signal, and :func:`default_detectors`.
* :func:`judge`, pure: (settings, observed value, running :class:`SignalState`) -> (new
  state, fired, reason); :func:`update_readings` / :func:`step_readings` build the observed
  values.
* :class:`CollapseDetector`, the thin callback: it feeds the judge, agrees over ranks and
  acts in one place (``_act``). Rollback snapshots live in :mod:`.snapshot`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import lightning.pytorch as pl
from dapo_lightning.callbacks.snapshot import TrainingSnapshot
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.checks import ConfigError, check_count, check_finite
from dapo_lightning.hooks import DAPOCallback

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


# ---------------------------------------------------------------------------- callback


class CollapseDetector(DAPOCallback):
    """Watches training-health signals and warns, stops or rolls back on collapse.

    Each :class:`Detector` watches one signal; :func:`judge` fires it after ``patience``
    consecutive bad observations, and ``_act`` carries out its action:

    * ``warn``: rank-zero warning (``collapse/fired_<name>`` counts it in the logs).
    * ``stop``: ``trainer.should_stop = True``; the reason is kept in ``self.stop_reason``.
    * ``rollback``: restore the last healthy :class:`~.snapshot.TrainingSnapshot` (policy,
      optimizer and scheduler state, bit-exactly), scale the learning rate by
      ``rollback_lr_scale`` (the rescaled state becomes the snapshot: scales compound) and
      bump ``pl_module.policy_version`` (so the restored weights reach the rollout engine).
      After ``max_rollbacks`` rollbacks, or with no snapshot, it stops training instead.

    Snapshots are taken at train start, then after every ``snapshot_every`` healthy updates
    (none fired, no open streak, not skipped as non-finite). Step counters and the data
    stream go on. Per-update detectors act inside ``on_dapo_update`` (the step's remaining
    updates continue from the restored weights), per-step ones in ``on_train_batch_end``.

    Ranks agree through ``trainer.strategy.reduce_boolean_decision(bad, all=False)`` (bad on
    any rank = bad): one call per detector of the hook's source, on every rank, observed
    there or not, so the ranks fire together and never hang. Readings and EMAs stay local.

    Logs ``collapse/<name>`` (the judged value) when observed and ``collapse/fired_<name>``
    (cumulative count) every rollout step. ``state_dict`` keeps EMAs, counters and the stop
    reason, and the snapshot only with ``snapshot_in_checkpoint=True`` (without it the first
    snapshot is retaken at train start after a resume).

    Args:
        detectors: The detectors (dataclasses or dicts of their fields, as from YAML).
            ``None`` uses :func:`default_detectors`.
        snapshot_every: Healthy updates between rollback snapshots (only taken when some
            detector's action is ``"rollback"``).
        rollback_lr_scale: Factor in (0, 1] applied to the learning rate after each rollback.
        max_rollbacks: Rollbacks allowed before a rollback detector stops training instead.
        snapshot_in_checkpoint: Also save the rollback snapshot in checkpoints.

    Raises:
        ValueError: Two detectors share a name, or an argument is out of range.

    Example::

        detector = CollapseDetector(
            detectors=[
                Detector("entropy", threshold=0.05, patience=5, action="stop"),
                Detector("grad_norm_spike", threshold=10.0, patience=2, action="rollback"),
            ],
            rollback_lr_scale=0.5,
        )
        trainer = Trainer(callbacks=[detector])

    In YAML (LightningCLI)::

        trainer:
          callbacks:
            - class_path: dapo_lightning.callbacks.CollapseDetector
              init_args:
                detectors:
                  - {signal: entropy, threshold: 0.05, patience: 5, action: stop}
                  - {signal: kl_spike, threshold: 20.0, min_value: 0.001}
    """

    def __init__(
        self,
        detectors: list[Detector] | None = None,
        snapshot_every: int = 10,
        rollback_lr_scale: float = 1.0,
        max_rollbacks: int = 3,
        snapshot_in_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.detectors = _checked(detectors, snapshot_every, rollback_lr_scale, max_rollbacks)
        names = [d.name for d in self.detectors]
        self.snapshot_every = snapshot_every
        self.rollback_lr_scale = rollback_lr_scale
        self.max_rollbacks = max_rollbacks
        self.snapshot_in_checkpoint = snapshot_in_checkpoint
        self._uses_rollback = any(d.action == "rollback" for d in self.detectors)
        self.states: dict[str, SignalState] = {n: SignalState() for n in names}
        self.fired: dict[str, int] = dict.fromkeys(names, 0)
        self.last_value: dict[str, float] = {}
        self.stop_reason: str | None = None
        self.rollbacks = 0
        self.healthy_updates = 0  # healthy updates since the last snapshot
        self.snapshot: TrainingSnapshot | None = None
        self._pending = self._zero_pending()  # this step's counts from on_rollouts_scored

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(detectors=[d.name for d in self.detectors])

    def _zero_pending(self) -> dict[str, float]:
        repetitive = {
            f"repetitive/{d.name}": 0.0 for d in self.detectors if d.signal == "repetition"
        }
        return {"responses": 0.0, "format_seen": 0.0, "no_answer": 0.0, **repetitive}

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._uses_rollback and self.snapshot is None:
            self.take_snapshot(trainer, pl_module)

    @override
    def on_rollouts_scored(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: ScoredRollouts
    ) -> None:
        """Count repetitive and answer-less responses (judged at batch end)."""
        self._pending = tally_rollouts(self._pending, rollouts, self.detectors)

    @override
    def on_dapo_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]
    ) -> None:
        """Judge the per-update signals after an optimizer update."""
        fired = self._judge(trainer, pl_module, "update", update_readings(metrics))
        self._count_healthy(trainer, pl_module, metrics.get("skipped_nonfinite", 0.0) > 0, fired)
        self._act(trainer, pl_module, fired)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        readings, self._pending = step_readings(batch, self._pending), self._zero_pending()
        self._act(trainer, pl_module, self._judge(trainer, pl_module, "step", readings))
        for name, count in self.fired.items():
            _log(pl_module, f"collapse/fired_{name}", float(count))

    # ------------------------------------------------------- judging and acting

    def _judge(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        source: Source,
        readings: Mapping[str, float],
    ) -> list[tuple[Detector, str]]:
        """Judge every detector of ``source`` on ``readings``; return the fired ones and why.

        One ``reduce_boolean_decision`` per detector, in the same order on every rank."""
        fired = []
        for det in (d for d in self.detectors if d.spec.source == source):
            raw = readings.get(det.spec.reading.format(name=det.name))
            state = self.states[det.name]
            value = judged_value(det, raw, state)
            anywhere = trainer.strategy.reduce_boolean_decision(
                bad_here(det, raw, state), all=False
            )
            self.states[det.name], did_fire, reason = judge(det, raw, state, anywhere)
            if value is not None:
                self.last_value[det.name] = value
                if math.isfinite(value):
                    _log(pl_module, f"collapse/{det.name}", value)
            if did_fire:
                self.fired[det.name] += 1
                fired.append((det, reason))
        return fired

    def _count_healthy(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, skipped: bool, fired: list
    ) -> None:
        """Count a healthy update; take a snapshot every ``snapshot_every`` of them."""
        if skipped or fired or any(s.streak for s in self.states.values()):
            return
        self.healthy_updates += 1
        if self._uses_rollback and self.healthy_updates >= self.snapshot_every:
            self.take_snapshot(trainer, pl_module)

    def _act(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, fired: list[tuple[Detector, str]]
    ) -> None:
        """The one place that acts on fired detectors (at most one rollback per observation)."""
        rolled_back = False
        for det, reason in fired:
            message, action = f"CollapseDetector: {reason}", det.action
            if action == "rollback" and self.rollbacks >= self.max_rollbacks:
                message, action = f"{message} max_rollbacks={self.max_rollbacks} reached.", "stop"
            elif action == "rollback" and self.snapshot is None:
                message, action = f"{message} No healthy snapshot to roll back to.", "stop"
            if action == "warn":
                rank_zero_warn(message)
            elif action == "stop":
                self.stop_reason, trainer.should_stop = message, True
                rank_zero_warn(f"{message} Stopping training.")
            elif not rolled_back:
                self.rollback(trainer, pl_module)
                rolled_back = True
                rank_zero_info(f"{message} Rolled back (rollback {self.rollbacks}).")

    # -------------------------------------------------------------- snapshots

    def take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep CPU copies of policy weights, optimizer and scheduler state."""
        self.snapshot = TrainingSnapshot.take(pl_module.policy, *_optimizer_and_scheduler(trainer))
        self.healthy_updates = 0

    def rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restore the snapshot bit-exactly, scale the learning rate by ``rollback_lr_scale``,
        bump ``pl_module.policy_version`` and clear every streak.

        Raises:
            RuntimeError: No snapshot has been taken yet.
        """
        if self.snapshot is None:
            raise RuntimeError("CollapseDetector.rollback: no snapshot has been taken yet.")
        optimizer, scheduler = _optimizer_and_scheduler(trainer)
        self.snapshot.restore(pl_module.policy, optimizer, scheduler, self.rollback_lr_scale)
        self.rollbacks += 1
        if hasattr(pl_module, "policy_version"):
            pl_module.policy_version += 1  # new weights: pushed to the engine before sampling
        self.states = {n: replace(s, streak=0) for n, s in self.states.items()}
        if self.rollback_lr_scale != 1.0:
            self.take_snapshot(trainer, pl_module)  # the rescaled state: scales compound
        else:
            self.healthy_updates = 0  # the snapshot equals the restored state already

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {
            "detectors": [asdict(d) for d in self.detectors],
            "streak": {n: s.streak for n, s in self.states.items()},
            "fired": dict(self.fired),
            "observations": {n: s.seen for n, s in self.states.items()},
            "ema": {n: s.ema for n, s in self.states.items()},
            "last_value": dict(self.last_value),
            "stop_reason": self.stop_reason,
            "rollbacks": self.rollbacks,
            "healthy_updates": self.healthy_updates,
            "pending": dict(self._pending),
        }
        if self.snapshot_in_checkpoint and self.snapshot is not None:
            state["snapshot"] = self.snapshot.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k, {}) for k in ("streak", "observations", "ema", "fired")}
        for n, s in self.states.items():
            self.states[n] = SignalState(
                ema=saved["ema"].get(n, s.ema),
                seen=int(saved["observations"].get(n, s.seen)),
                streak=int(saved["streak"].get(n, s.streak)),
            )
            self.fired[n] = int(saved["fired"].get(n, self.fired[n]))
        self.last_value = dict(state_dict.get("last_value", {}))
        self.stop_reason = state_dict.get("stop_reason")
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.healthy_updates = int(state_dict.get("healthy_updates", 0))
        self._pending = {**self._zero_pending(), **state_dict.get("pending", {})}
        if "snapshot" in state_dict:
            self.snapshot = TrainingSnapshot.from_state_dict(state_dict["snapshot"])


def _optimizer_and_scheduler(trainer: Any) -> tuple[Any, Any]:
    """The trainer's (first) optimizer and LR scheduler, None where it has none."""
    optimizers = getattr(trainer, "optimizers", None) or []
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    return (optimizers[0] if optimizers else None), (configs[0].scheduler if configs else None)


def _checked(
    detectors: Sequence[Detector | Mapping[str, Any]] | None,
    snapshot_every: int,
    rollback_lr_scale: float,
    max_rollbacks: int,
) -> list[Detector]:
    """:class:`CollapseDetector`'s arguments, checked; its detectors as dataclasses."""
    dets = default_detectors() if detectors is None else detectors
    dets = [d if isinstance(d, Detector) else Detector(**d) for d in dets]
    names = [d.name for d in dets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"CollapseDetector: detector names must be unique, got {duplicates} twice; "
            "give each detector of the same signal its own `name`."
        )
    check_count("CollapseDetector.snapshot_every", snapshot_every, 1, "healthy updates")
    if not 0 < rollback_lr_scale <= 1:  # NaN fails it too
        raise ConfigError(
            f"CollapseDetector.rollback_lr_scale must be in (0, 1], got {rollback_lr_scale}."
        )
    check_count("CollapseDetector.max_rollbacks", max_rollbacks, 0, "rollbacks before stopping")
    return dets


def _log(pl_module: pl.LightningModule, name: str, value: float) -> None:
    pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
