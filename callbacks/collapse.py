"""Training-collapse detection with warn / stop / rollback actions, in the shape of
Lightning's ``EarlyStopping``: a pure judge, and one place that acts.

* :mod:`.collapse_judge` is the judge: :data:`SIGNALS` (one row per signal), :class:`Detector`
  (the user's settings for one signal), :func:`judge` ((settings, observed value, running
  :class:`SignalState`) -> (new state, fired, reason)) and the readings it is fed.
* :class:`CollapseDetector`, in this file, is the thin callback: it feeds the judge, agrees
  over ranks and acts in one place (``_act``). Rollback snapshots live in :mod:`.snapshot`.

Every name of the judge is importable from here too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import lightning.pytorch as pl
from dapo_lightning.callbacks.collapse_judge import (
    BAD_WHEN,
    SIGNALS,
    Action,
    Detector,
    Signal,
    SignalSpec,
    SignalState,
    Source,
    bad_here,
    default_detectors,
    ema_update,
    judge,
    judged_value,
    ngram_repetition,
    relative_drop,
    spike_ratio,
    step_readings,
    tally_rollouts,
    update_readings,
)
from dapo_lightning.callbacks.round_counts import RoundCounts
from dapo_lightning.callbacks.snapshot import TrainingSnapshot
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.checks import ConfigError, check_count
from dapo_lightning.hooks import DAPOCallback
from dapo_lightning.policy_state import HoldsPolicyState

__all__ = [
    "BAD_WHEN",
    "SIGNALS",
    "Action",
    "CollapseDetector",
    "CollapseStopError",
    "Detector",
    "Signal",
    "SignalSpec",
    "SignalState",
    "Source",
    "bad_here",
    "default_detectors",
    "ema_update",
    "judge",
    "judged_value",
    "raise_if_collapsed",
    "ngram_repetition",
    "relative_drop",
    "spike_ratio",
    "step_readings",
    "tally_rollouts",
    "update_readings",
]


class CollapseStopError(RuntimeError):
    """A :class:`CollapseDetector` ``stop`` action ended the run (the CLI prints it as one
    error line and exits 1: a collapse is not a successful end)."""


def raise_if_collapsed(trainer: pl.Trainer) -> None:
    """Raise :class:`CollapseStopError` with the reason when a :class:`CollapseDetector` of
    ``trainer`` stopped the fit that just ended (after the run guard saved its state)."""
    for callback in trainer.callbacks:
        if isinstance(callback, CollapseDetector) and callback.stopped:
            raise CollapseStopError(
                f"{callback.stop_reason} The run stopped at update {trainer.global_step} (a "
                "detector's action: stop) with its state saved. Fix: look at the collapse/ "
                "metrics, change the settings (the detector's threshold, the learning rate) and "
                "resume with --ckpt_path auto, or start over."
            )


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
      bump the module's policy version (``PolicyState.bump_version``, so the restored weights
      reach the rollout engine; a module without a
      :class:`~dapo_lightning.policy_state.PolicyState` has no engine to reach: not bumped).
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
        #: A ``stop`` action of this fit stopped it (not saved: a resume starts without), read
        #: by :func:`raise_if_collapsed`.
        self.stopped = False
        self.rollbacks = 0
        self.healthy_updates = 0  # healthy updates since the last snapshot
        self.snapshot: TrainingSnapshot | None = None
        # each round's counts from on_rollouts_scored, taken by the step that trains them
        self._pending = RoundCounts(self._zero_pending)

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
        counts = tally_rollouts(self._zero_pending(), rollouts, self.detectors)
        self._pending.add(rollouts.batch_index, counts)

    @override
    def on_rollouts_discarded(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_index: int
    ) -> None:
        """Forget the counts of rounds that will be scored again."""
        self._pending.discard(batch_index)

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
        readings = step_readings(batch, self._pending.take(batch))
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
                self.stopped = True
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
        bump the module's policy version (where it holds a
        :class:`~dapo_lightning.policy_state.PolicyState`) and clear every streak.

        Raises:
            RuntimeError: No snapshot has been taken yet.
        """
        if self.snapshot is None:
            raise RuntimeError("CollapseDetector.rollback: no snapshot has been taken yet.")
        optimizer, scheduler = _optimizer_and_scheduler(trainer)
        self.snapshot.restore(pl_module.policy, optimizer, scheduler, self.rollback_lr_scale)
        self.rollbacks += 1
        if isinstance(pl_module, HoldsPolicyState):
            pl_module.policy_state.bump_version()  # new weights: to the engine before sampling
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
            "pending": self._pending.state_dict(),
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
        self._pending.load_state_dict(state_dict.get("pending", {}))
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
