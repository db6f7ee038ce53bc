"""Training-collapse detection with warn / stop / rollback actions.

RL fine-tuning of language models fails in recognisable ways: the policy's entropy
collapses, responses degenerate into repetition, the answer format disappears, every group
gets the same reward (dynamic sampling then has to generate ever more), lengths collapse or
blow up, gradient norm or KL spike, or the loss becomes non-finite. :class:`CollapseDetector`
watches one signal per :class:`Detector` and acts once a signal stays bad for ``patience``
consecutive observations.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from dapo_lightning.data.batch import ScoredRollouts

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

# Signals observed after every optimizer update (on_dapo_update) ...
UPDATE_SIGNALS = ("entropy", "entropy_drop", "grad_norm_spike", "kl_spike", "nonfinite")
# ... and once per rollout step (on_train_batch_end).
STEP_SIGNALS = (
    "repetition",
    "format",
    "zero_variance",
    "oversampling",
    "length_low",
    "length_high",
    "truncation",
)
# Signals judged against their own moving average (they need `warmup` observations first).
EMA_SIGNALS = ("entropy_drop", "grad_norm_spike", "kl_spike")
# Signals that are bad when the value is BELOW the threshold (all others: above).
LOW_SIGNALS = ("entropy", "length_low")


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


@dataclass
class Detector:
    """One watched signal: when it is bad for ``patience`` consecutive observations, act.

    ==================  =========================================================  ==========
    ``signal``          observed value (bad when ...)                              observed
    ==================  =========================================================  ==========
    entropy             ``metrics["entropy"]`` (bad below ``threshold``)           per update
    entropy_drop        ``1 - H / EMA(H)``, fractional fall (above ``threshold``)  per update
    grad_norm_spike     ``grad_norm / EMA(grad_norm)`` (above ``threshold``)        per update
    kl_spike            ``kl_k3 / EMA(kl_k3)`` (above ``threshold``)                per update
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

    "per update" signals come from the ``on_dapo_update`` hook after every optimizer update;
    "per step" signals once per rollout step (repetition and format over every response
    generated for the step, including groups dynamic sampling dropped; the others from the
    training batch). EMA signals are judged only after ``warmup`` observations, and their EMA
    is updated with healthy observations only, so a sustained spike keeps counting as bad.

    Args:
        signal: What to watch (table above).
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
        if self.signal not in UPDATE_SIGNALS + STEP_SIGNALS:
            raise ValueError(
                f"Detector.signal must be one of {UPDATE_SIGNALS + STEP_SIGNALS}, got {self.signal!r}."
            )
        if self.action not in ("warn", "stop", "rollback"):
            raise ValueError(
                f"Detector.action must be 'warn', 'stop' or 'rollback', got {self.action!r} "
                f"(detector {self.signal!r})."
            )
        if not math.isfinite(self.threshold):
            raise ValueError(f"Detector.threshold must be finite, got {self.threshold}.")
        if self.patience < 1:
            raise ValueError(f"Detector.patience must be >= 1, got {self.patience}.")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"Detector.ema_decay must be in [0, 1), got {self.ema_decay}.")
        if self.warmup < 0:
            raise ValueError(f"Detector.warmup must be >= 0, got {self.warmup}.")
        if self.ngram < 1:
            raise ValueError(f"Detector.ngram must be >= 1, got {self.ngram}.")
        if self.name is None:
            self.name = self.signal

    def is_bad(self, value: float) -> bool:
        """Whether ``value`` crosses ``threshold`` (below for entropy/length_low, else above)."""
        if self.signal in LOW_SIGNALS:
            return value < self.threshold
        return value > self.threshold


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


def _cpu_copy(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU (a snapshot shares no storage)."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class CollapseDetector(Callback):
    """Watches training-health signals and warns, stops or rolls back on collapse.

    Each :class:`Detector` observes one signal (see its table), counts consecutive bad
    observations and fires its action after ``patience`` of them:

    * ``warn``: rank-zero warning (``collapse/fired_<name>`` counts it in the logs).
    * ``stop``: ``trainer.should_stop = True``; the reason is kept in ``self.stop_reason``.
    * ``rollback``: restore the last healthy snapshot of the policy weights, optimizer state
      and LR-scheduler state, bit-exactly, then multiply the learning rate by
      ``rollback_lr_scale``. The restored (rescaled) state becomes the new snapshot, so
      repeated rollbacks compound the LR scale. After ``max_rollbacks`` rollbacks a rollback
      detector stops training instead.

    Snapshots (CPU deep copies) are taken at train start and then after every
    ``snapshot_every`` healthy updates (an update is healthy when no detector fired on it or
    has an open run of bad observations, and the update was not skipped as non-finite). Only policy, optimizer
    and scheduler are restored: the trainer's step counters and the data stream go on. With a
    rollout engine that keeps its own weights copy (vLLM) the restored weights reach it at the
    module's next weight push. Per-update detectors roll back inside ``on_dapo_update`` (the
    step's remaining updates continue from the restored weights); per-step ones in
    ``on_train_batch_end``.

    Under data-parallel training the bad/healthy decisions are all-reduced (bad on any rank
    = bad, also for a signal this rank did not observe), so every rank fires and rolls back
    together. Observed values and EMAs stay rank-local.

    Logs ``collapse/<name>`` (the observed value) when observed and ``collapse/fired_<name>``
    (cumulative count) every rollout step. ``state_dict`` keeps EMAs, counters and the stop
    reason; the snapshot itself only with ``snapshot_in_checkpoint=True`` (it is a full copy of
    model and optimizer; on resume without it the first snapshot is retaken at train start).

    Args:
        detectors: The detectors (dataclasses or dicts of their fields, as from YAML).
            ``None`` uses :func:`default_detectors`.
        snapshot_every: Healthy updates between rollback snapshots (only taken when some
            detector's action is ``"rollback"``).
        rollback_lr_scale: Factor in (0, 1] applied to the optimizer's and the scheduler's
            learning rates after each rollback (1.0 keeps them).
        max_rollbacks: Rollbacks allowed before a rollback detector stops training instead.
        snapshot_in_checkpoint: Also save the rollback snapshot in checkpoints.

    Example::

        from lightning.pytorch import Trainer
        from dapo_lightning.callbacks import CollapseDetector, Detector

        detector = CollapseDetector(
            detectors=[
                Detector("entropy", threshold=0.05, patience=5, action="stop"),
                Detector("grad_norm_spike", threshold=10.0, patience=2, action="rollback"),
                Detector("repetition", threshold=0.3, ngram=4, max_repeat=0.5),
            ],
            snapshot_every=10,
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
        if detectors is None:
            detectors = default_detectors()
        self.detectors: list[Detector] = [
            d if isinstance(d, Detector) else Detector(**d) for d in detectors
        ]
        names = [d.name for d in self.detectors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"CollapseDetector detector names must be unique, got duplicates {duplicates}; "
                "give each detector of the same signal its own `name`."
            )
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}.")
        if not 0 < rollback_lr_scale <= 1:
            raise ValueError(f"rollback_lr_scale must be in (0, 1], got {rollback_lr_scale}.")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {max_rollbacks}.")
        self.snapshot_every = snapshot_every
        self.rollback_lr_scale = rollback_lr_scale
        self.max_rollbacks = max_rollbacks
        self.snapshot_in_checkpoint = snapshot_in_checkpoint
        self._uses_rollback = any(d.action == "rollback" for d in self.detectors)

        self.streak: dict[str, int] = dict.fromkeys(names, 0)
        self.fired: dict[str, int] = dict.fromkeys(names, 0)
        self.observations: dict[str, int] = dict.fromkeys(names, 0)
        self.ema: dict[str, float | None] = dict.fromkeys(names, None)
        self.last_value: dict[str, float] = {}
        self._raw: dict[str, float] = {}  # raw metric behind each EMA-relative value
        self.stop_reason: str | None = None
        self.rollbacks = 0
        self.healthy_updates = 0  # healthy updates since the last snapshot
        self.snapshot: dict[str, Any] | None = None
        # per-response counts from on_rollouts_scored, consumed at on_train_batch_end
        self._pending = self._zero_pending()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(detectors=[d.name for d in self.detectors])

    @staticmethod
    def _zero_pending() -> dict[str, float]:
        # plus "repetitive/<name>" per repetition detector
        return {"responses": 0.0, "format_seen": 0.0, "no_answer": 0.0}

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._uses_rollback and self.snapshot is None:
            self.take_snapshot(trainer, pl_module)

    def on_rollouts_scored(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: ScoredRollouts
    ) -> None:
        """DAPO hook: count repetitive and answer-less responses (logged at batch end)."""
        p = self._pending
        p["responses"] += len(rollouts)
        for det in self.detectors:
            if det.signal == "repetition":
                key = f"repetitive/{det.name}"
                p[key] = p.get(key, 0.0) + sum(
                    ngram_repetition(ids, det.ngram) > det.max_repeat
                    for ids in rollouts.response_ids
                )
        has_answer = rollouts.extra.get("has_answer")
        if has_answer is not None:
            p["format_seen"] += len(has_answer)
            p["no_answer"] += sum(not bool(h) for h in has_answer)

    def on_dapo_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]
    ) -> None:
        """DAPO hook: judge the per-update signals after an optimizer update."""
        values: dict[str, float] = {}
        for det in self.detectors:
            if det.signal not in UPDATE_SIGNALS:
                continue
            value = self._update_value(det, metrics)
            if value is not None:
                values[det.name] = value
        fired = self._observe(trainer, pl_module, UPDATE_SIGNALS, values)
        skipped = float(metrics.get("skipped_nonfinite", 0.0)) > 0
        healthy = not skipped and not fired and all(s == 0 for s in self.streak.values())
        if healthy:
            self.healthy_updates += 1
            if self._uses_rollback and self.healthy_updates >= self.snapshot_every:
                self.take_snapshot(trainer, pl_module)
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
        values: dict[str, float] = {}
        for det in self.detectors:
            if det.signal not in STEP_SIGNALS:
                continue
            value = self._step_value(det, batch)
            if value is not None:
                values[det.name] = value
        self._pending = self._zero_pending()
        fired = self._observe(trainer, pl_module, STEP_SIGNALS, values)
        self._act(trainer, pl_module, fired)
        for name, count in self.fired.items():
            pl_module.log(
                f"collapse/fired_{name}", float(count), on_step=True, on_epoch=False, batch_size=1
            )

    # ------------------------------------------------------------ observation

    def _update_value(self, det: Detector, metrics: Mapping[str, float]) -> float | None:
        sig = det.signal
        if sig == "nonfinite":
            return float(metrics.get("skipped_nonfinite", 0.0))
        key = {"entropy": "entropy", "entropy_drop": "entropy"}.get(sig)
        key = key or {"grad_norm_spike": "grad_norm", "kl_spike": "kl_k3"}[sig]
        if key not in metrics:
            return None
        raw = float(metrics[key])
        self._raw[det.name] = raw
        if not math.isfinite(raw):
            return None  # the nonfinite detector covers these
        if sig == "entropy":
            return raw
        # EMA signals: value relative to the moving average of earlier healthy observations
        ema = self.ema[det.name]
        if ema is None or self.observations[det.name] < det.warmup:
            self.ema[det.name] = ema_update(ema, raw, det.ema_decay)
            self.observations[det.name] += 1
            return None
        if sig == "entropy_drop":
            value = relative_drop(raw, ema)
            bad = det.is_bad(value)
        else:
            value = spike_ratio(raw, ema)
            bad = det.is_bad(value) and raw > det.min_value
        if not bad:
            self.ema[det.name] = ema_update(ema, raw, det.ema_decay)
        self.observations[det.name] += 1
        return value

    def _step_value(self, det: Detector, batch: Any) -> float | None:
        sig = det.signal
        p = self._pending
        if sig == "repetition":
            n = p["responses"]
            return p.get(f"repetitive/{det.name}", 0.0) / n if n > 0 else None
        if sig == "format":
            n = p["format_seen"]
            return p["no_answer"] / n if n > 0 else None
        stats = getattr(batch, "stats", None) or {}
        if sig == "zero_variance":
            v = stats.get("zero_variance_frac")
            return None if v is None else float(v)
        if sig == "oversampling":
            gen, kept = stats.get("generated_groups"), stats.get("kept_groups")
            if gen is None or kept is None:
                return None
            return float(gen) / float(kept) if kept > 0 else math.inf
        if sig in ("length_low", "length_high"):
            lengths = getattr(batch, "response_length", None)
            return None if lengths is None or len(lengths) == 0 else float(lengths.float().mean())
        truncated = getattr(batch, "truncated", None)  # sig == "truncation"
        return None if truncated is None or len(truncated) == 0 else float(truncated.float().mean())

    def _observe(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        signals: tuple[str, ...],
        values: dict[str, float],
    ) -> list[Detector]:
        """Update the streaks of the detectors watching ``signals`` with this observation
        (``values``: the ones observed on this rank); return those whose patience ran out."""
        dets = [d for d in self.detectors if d.signal in signals]
        if not dets:
            return []
        bad = []
        for det in dets:
            value = values.get(det.name)
            b = value is not None and det.is_bad(value)
            if det.signal in ("grad_norm_spike", "kl_spike"):  # also raw value above min_value
                b = b and self._raw.get(det.name, math.inf) > det.min_value
            bad.append(b)
        # same-length flags on every rank, even with nothing observed here: no collective hangs
        bad = self._any_rank(trainer, pl_module, bad)
        fired = []
        for det, b in zip(dets, bad):
            n = det.name
            if n in values:
                self.last_value[n] = values[n]
                if math.isfinite(values[n]):
                    pl_module.log(
                        f"collapse/{n}", values[n], on_step=True, on_epoch=False, batch_size=1
                    )
            if b:
                self.streak[n] += 1
                if self.streak[n] >= det.patience:
                    self.streak[n] = 0
                    self.fired[n] += 1
                    fired.append(det)
            elif n in values:
                self.streak[n] = 0
        return fired

    @staticmethod
    def _any_rank(trainer: Any, pl_module: Any, bad: list[bool]) -> list[bool]:
        """Bad on any rank counts as bad (one MAX all-reduce per hook call when a
        ``torch.distributed`` process group with more than one rank is running)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return bad
        device = getattr(pl_module, "device", None)
        if not isinstance(device, torch.device):
            device = torch.device("cpu")
        flags = torch.tensor([float(b) for b in bad], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [bool(f > 0) for f in flags.tolist()]

    # ---------------------------------------------------------------- actions

    def _act(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, fired: list[Detector]
    ) -> None:
        rolled_back = False
        for det in fired:
            msg = (
                f"CollapseDetector: {det.name} fired (value {self.last_value.get(det.name)!r}, "
                f"threshold {det.threshold}, {det.patience} consecutive bad observations)."
            )
            action = det.action
            if action == "rollback" and self.rollbacks >= self.max_rollbacks:
                msg += f" max_rollbacks={self.max_rollbacks} reached; stopping instead."
                action = "stop"
            if action == "warn":
                rank_zero_warn(msg)
            elif action == "stop":
                self.stop_reason = msg
                trainer.should_stop = True
                rank_zero_warn(msg + " Stopping training.")
            elif not rolled_back:
                if self.snapshot is None:
                    self.stop_reason = msg + " No healthy snapshot to roll back to; stopping."
                    trainer.should_stop = True
                    rank_zero_warn(self.stop_reason)
                    continue
                self.rollback(trainer, pl_module)
                rolled_back = True
                rank_zero_info(
                    msg + f" Rolled back to the last healthy snapshot (rollback {self.rollbacks})."
                )

    def take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep CPU deep copies of policy weights, optimizer and scheduler state."""
        scheduler = self._scheduler(trainer)
        optimizers = getattr(trainer, "optimizers", None) or []
        self.snapshot = {
            "policy": _cpu_copy(pl_module.policy.state_dict()),
            "optimizer": _cpu_copy(optimizers[0].state_dict()) if optimizers else None,
            "scheduler": _cpu_copy(scheduler.state_dict()) if scheduler is not None else None,
        }
        self.healthy_updates = 0

    def rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restore the snapshot bit-exactly, then scale the learning rate by ``rollback_lr_scale``."""
        if self.snapshot is None:
            raise RuntimeError("CollapseDetector.rollback: no snapshot has been taken yet.")
        snap = self.snapshot
        pl_module.policy.load_state_dict(snap["policy"])
        optimizers = getattr(trainer, "optimizers", None) or []
        if optimizers and snap["optimizer"] is not None:
            # a fresh copy: load_state_dict may keep the given tensors as the live state
            optimizers[0].load_state_dict(_cpu_copy(snap["optimizer"]))
        scheduler = self._scheduler(trainer)
        if scheduler is not None and snap["scheduler"] is not None:
            scheduler.load_state_dict(_cpu_copy(snap["scheduler"]))
        if self.rollback_lr_scale != 1.0:
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * self.rollback_lr_scale
            if scheduler is not None and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * self.rollback_lr_scale for lr in scheduler.base_lrs]
            if scheduler is not None and hasattr(scheduler, "_last_lr"):
                scheduler._last_lr = [g["lr"] for g in optimizers[0].param_groups]
        self.rollbacks += 1
        if hasattr(pl_module, "policy_version"):
            # The weights changed: a new version makes the data module push them to the
            # rollout engine before it samples again.
            pl_module.policy_version += 1
        for n in self.streak:
            self.streak[n] = 0
        # the restored (rescaled) state is the new snapshot: repeated rollbacks compound
        self.take_snapshot(trainer, pl_module)

    @staticmethod
    def _scheduler(trainer: Any) -> Any:
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        return configs[0].scheduler if configs else None

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {
            "detectors": [asdict(d) for d in self.detectors],
            "streak": dict(self.streak),
            "fired": dict(self.fired),
            "observations": dict(self.observations),
            "ema": dict(self.ema),
            "last_value": dict(self.last_value),
            "stop_reason": self.stop_reason,
            "rollbacks": self.rollbacks,
            "healthy_updates": self.healthy_updates,
            "pending": dict(self._pending),
        }
        if self.snapshot_in_checkpoint and self.snapshot is not None:
            state["snapshot"] = self.snapshot
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = set(self.streak)
        for key in ("streak", "fired", "observations", "ema"):
            saved = state_dict.get(key, {})
            getattr(self, key).update({k: v for k, v in saved.items() if k in names})
        self.last_value = dict(state_dict.get("last_value", {}))
        self.stop_reason = state_dict.get("stop_reason")
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.healthy_updates = int(state_dict.get("healthy_updates", 0))
        self._pending = {**self._zero_pending(), **state_dict.get("pending", {})}
        if "snapshot" in state_dict:
            self.snapshot = _cpu_copy(state_dict["snapshot"])
