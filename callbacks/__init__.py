"""Callbacks for DAPO runs, importable as ``dapo_lightning.callbacks``.

Besides Lightning's hooks they implement three DAPO hooks, called by the library on every
:class:`DAPOCallback` (subclass it for your own; it is declared in :mod:`dapo_lightning.hooks`):

* ``on_rollouts_scored(trainer, pl_module, rollouts)``: after scoring, before the
  dynamic-sampling filter (reward shaping, loss masks). No logging there.
* ``on_rollouts_discarded(trainer, pl_module, batch_index)``: the rounds scored for that batch
  and later ones were thrown away (a stop); they are scored again, so drop their counts.
* ``on_dapo_update(trainer, pl_module, metrics)``: after every optimizer update.
"""

from dapo_lightning.callbacks.collapse import CollapseDetector
from dapo_lightning.callbacks.collapse_judge import (
    Detector,
    SignalState,
    default_detectors,
    ema_update,
    judge,
    ngram_repetition,
)
from dapo_lightning.callbacks.entropy import (
    AdaptiveEntropyBand,
    EntropyScheduler,
    adaptive_coef,
    schedule_value,
)
from dapo_lightning.callbacks.initial_validation import ValidateAtStart
from dapo_lightning.callbacks.overlong import OverlongRewardShaping, overlong_penalty
from dapo_lightning.callbacks.progress import DAPOProgressBar, run_summary, stop_reason
from dapo_lightning.callbacks.run_guard import RunDirLockedError, RunGuard
from dapo_lightning.callbacks.sample_log import SampleLog, SampleLogConfig
from dapo_lightning.callbacks.snapshot import TrainingSnapshot
from dapo_lightning.callbacks.step_checkpoint import StepCheckpoint
from dapo_lightning.callbacks.summary import DAPOModelSummary
from dapo_lightning.callbacks.trace import PhaseTrace

from dapo_lightning.hooks import DAPO_HOOKS, DAPOCallback

__all__ = [
    "DAPO_HOOKS",
    "CollapseDetector",
    "DAPOCallback",
    "DAPOModelSummary",
    "DAPOProgressBar",
    "Detector",
    "EntropyScheduler",
    "OverlongRewardShaping",
    "PhaseTrace",
    "RunDirLockedError",
    "RunGuard",
    "SampleLog",
    "SampleLogConfig",
    "SignalState",
    "StepCheckpoint",
    "TrainingSnapshot",
    "ValidateAtStart",
    "AdaptiveEntropyBand",
    "adaptive_coef",
    "default_detectors",
    "ema_update",
    "judge",
    "ngram_repetition",
    "overlong_penalty",
    "run_summary",
    "schedule_value",
    "stop_reason",
]
