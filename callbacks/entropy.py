"""Entropy-bonus coefficient schedules: fixed decays and an adaptive controller.

The DAPO loss may carry an entropy bonus ``- entropy_coef * H`` (the module's
``policy_state.entropy_coef``).
:class:`EntropyScheduler` sets that coefficient before every optimizer update, either from
a fixed schedule over the update count (:func:`schedule_value`) or adaptively from the
measured token entropy (:func:`adaptive_coef`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from dapo_lightning.checks import ConfigError, check_count, check_finite
from dapo_lightning.hooks import DAPOCallback
from dapo_lightning.policy_state import policy_state_of

Schedule = Literal["constant", "linear", "cosine", "exponential", "adaptive"]
_FIXED = ("constant", "linear", "cosine", "exponential")
_ALL = (*_FIXED, "adaptive")


@dataclass(frozen=True)
class AdaptiveEntropyBand:
    """The adaptive controller's settings (:func:`adaptive_coef`), one record.

    Args:
        target_low: Lower edge of the target entropy band (nats per token), > 0.
        target_high: Upper edge of the target entropy band, >= ``target_low``.
        adapt_rate: Gain: relative step per unit of relative distance from the band, > 0.
        max_rel_change: Largest relative change of the coefficient per update, in (0, 1).
        coef_min: Lower bound of the coefficient, > 0 (a multiplicative controller cannot
            leave 0).
        coef_max: Upper bound of the coefficient, >= ``coef_min``.
    """

    target_low: float = 0.3
    target_high: float = 1.0
    adapt_rate: float = 0.1
    max_rel_change: float = 0.05
    coef_min: float = 1e-5
    coef_max: float = 0.1

    def check(self, where: str, start: float) -> None:
        """Finite, 0 < target_low <= target_high, adapt_rate > 0, max_rel_change in (0, 1),
        0 < coef_min <= coef_max, and ``start`` within [coef_min, coef_max]; a
        :class:`ConfigError` naming ``where.<field>`` otherwise."""
        for name, value in vars(self).items():
            check_finite(f"{where}.{name}", value)
        low, high, c_min, c_max = self.target_low, self.target_high, self.coef_min, self.coef_max
        if not 0 < low <= high:
            raise ConfigError(
                f"{where}: the adaptive schedule needs 0 < target_low <= target_high, got "
                f"target_low={low}, target_high={high}."
            )
        if not self.adapt_rate > 0:
            raise ConfigError(f"{where}.adapt_rate must be > 0, got {self.adapt_rate}.")
        if not 0 < self.max_rel_change < 1:
            raise ConfigError(
                f"{where}.max_rel_change must be in (0, 1), got {self.max_rel_change}."
            )
        if not 0 < c_min <= c_max:
            raise ConfigError(
                f"{where}: the adaptive schedule needs 0 < coef_min <= coef_max, got "
                f"coef_min={c_min}, coef_max={c_max}."
            )
        if not c_min <= start <= c_max:
            raise ConfigError(
                f"{where}.start={start} must lie in [coef_min={c_min}, coef_max={c_max}] "
                "for the adaptive schedule."
            )


def _check_schedule(
    schedule: str,
    start: float,
    end: float,
    total_updates: int | None,
    warmup_updates: int,
    where: str = "",
) -> None:
    """The fixed-schedule settings; errors name ``where.field`` (``EntropyScheduler.start``),
    or the bare argument for a function's (``where=""``)."""
    prefix = f"{where}." if where else ""
    if schedule not in _ALL:
        raise ConfigError(f"{prefix}schedule must be one of {_ALL}, got {schedule!r}.")
    for name, value in (("start", start), ("end", end)):
        check_finite(f"{prefix}{name}", value, "Give a coefficient >= 0.")
        if not value >= 0:
            raise ConfigError(f"{prefix}{name} must be a finite coefficient >= 0, got {value}.")
    check_count(f"{prefix}warmup_updates", warmup_updates, 0, "updates of warm-up from 0")
    if schedule in ("linear", "cosine", "exponential"):
        if total_updates is None or total_updates <= warmup_updates:
            raise ValueError(
                f"schedule={schedule!r} needs total_updates > warmup_updates={warmup_updates} "
                f"(the update at which the coefficient reaches `end`), got total_updates="
                f"{total_updates}. Set total_updates, e.g. to the run's number of optimizer updates."
            )
    if schedule == "exponential" and (start <= 0 or end <= 0):
        raise ValueError(
            f"schedule='exponential' interpolates geometrically and needs start > 0 and end > 0, "
            f"got start={start}, end={end}. Use 'linear' or 'cosine' to decay to 0."
        )


def schedule_value(
    step: int,
    *,
    schedule: str,
    start: float,
    end: float = 0.0,
    total_updates: int | None = None,
    warmup_updates: int = 0,
) -> float:
    """Coefficient for optimizer update number ``step`` (0-based) of a fixed schedule.

    With ``W = warmup_updates``, ``T = total_updates`` and ``p = (step - W) / (T - W)``
    clamped to ``[0, 1]``::

        step < W:      c = start * step / W                    (linear warm-up from 0)
        constant:      c = start
        linear:        c = start + (end - start) * p
        cosine:        c = end + (start - end) * (1 + cos(pi * p)) / 2
        exponential:   c = start * (end / start) ** p          (geometric; start, end > 0)

    So ``c(W) = start`` and ``c(step) = end`` for ``step >= T`` (except ``constant``).

    Args:
        step: Number of optimizer updates done before the one that uses the coefficient.
        schedule: ``"constant"``, ``"linear"``, ``"cosine"`` or ``"exponential"``.
        start: Coefficient at the end of warm-up.
        end: Coefficient at ``total_updates`` and after.
        total_updates: Update at which the decay reaches ``end`` (counted from 0, warm-up
            included). Required for the decaying schedules.
        warmup_updates: Updates of linear warm-up from 0 to ``start``.
    """
    if schedule == "adaptive":
        raise ValueError(
            "schedule_value has no closed form for schedule='adaptive'; use adaptive_coef."
        )
    _check_schedule(schedule, start, end, total_updates, warmup_updates)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}.")
    if step < warmup_updates:
        return start * step / warmup_updates
    if schedule == "constant":
        return float(start)
    assert total_updates is not None
    p = min(1.0, (step - warmup_updates) / (total_updates - warmup_updates))
    if schedule == "linear":
        return start + (end - start) * p
    if schedule == "cosine":
        return end + (start - end) * (1.0 + math.cos(math.pi * p)) / 2.0
    return start * (end / start) ** p


def adaptive_coef(coef: float, entropy: float, band: AdaptiveEntropyBand) -> float:
    """One step of the adaptive entropy-coefficient controller.

    The step is proportional to the relative distance of the entropy ``H`` from the target
    band, capped at ``max_rel_change``::

        H < target_low:   d = min(adapt_rate * (target_low - H) / target_low, max_rel_change)
                          c' = c * (1 + d)          (more entropy bonus)
        H > target_high:  d = min(adapt_rate * (H - target_high) / target_high, max_rel_change)
                          c' = c * (1 - d)          (less entropy bonus)
        otherwise:        c' = c
        c' = clamp(c', coef_min, coef_max)

    For ``c`` in ``[coef_min, coef_max]``, ``|c' / c - 1| <= max_rel_change``. A non-finite
    ``H`` (a skipped update) leaves ``c`` unchanged.
    """
    if not math.isfinite(entropy):
        return coef
    b = band
    if entropy < b.target_low:
        d = min(b.adapt_rate * (b.target_low - entropy) / b.target_low, b.max_rel_change)
        coef = coef * (1.0 + d)
    elif entropy > b.target_high:
        d = min(b.adapt_rate * (entropy - b.target_high) / b.target_high, b.max_rel_change)
        coef = coef * (1.0 - d)
    return min(max(coef, b.coef_min), b.coef_max)


class EntropyScheduler(DAPOCallback):
    """Sets the entropy weight of every optimizer update (``PolicyState.set_entropy_coef`` of
    the module's :class:`~dapo_lightning.policy_state.PolicyState`; a module without one, no
    DAPOModule, raises ``TypeError`` at train start).

    The coefficient for the first update is set in ``on_train_start``; after each update the
    custom ``on_dapo_update`` hook (called by ``DAPOModule`` after every optimizer update)
    sets it for the next one. Fixed schedules depend only on the update count (see
    :func:`schedule_value`); ``"adaptive"`` moves the coefficient multiplicatively to keep the
    measured token entropy (``metrics["entropy"]``) inside ``[target_low, target_high]``
    (see :func:`adaptive_coef`), starting from ``start``. Warm-up ramps the applied
    coefficient linearly from 0 in every mode (the adaptive controller starts after it).
    Logs ``entropy/coef`` (the coefficient for the next update) after every update.

    Args:
        schedule: ``"constant"``, ``"linear"``, ``"cosine"``, ``"exponential"`` or ``"adaptive"``.
        start: Coefficient at the end of warm-up (and the adaptive controller's initial value).
        end: Coefficient reached at ``total_updates`` by the decaying schedules.
        warmup_updates: Number of updates of linear warm-up from 0 to ``start``.
        total_updates: Update at which decaying schedules reach ``end`` (warm-up included);
            required for ``"linear"``, ``"cosine"`` and ``"exponential"``.
        target_low, target_high, adapt_rate, max_rel_change, coef_min, coef_max: The
            adaptive controller's settings, kept as one :class:`AdaptiveEntropyBand`
            (``self.band``; each documented there).

    Example::

        from lightning.pytorch import Trainer
        from dapo_lightning.callbacks import EntropyScheduler

        # cosine decay 0.1 -> 0.01 over 1000 optimizer updates after 50 warm-up updates
        sched = EntropyScheduler("cosine", start=0.1, end=0.01, warmup_updates=50, total_updates=1000)

        # keep the token entropy between 0.3 and 0.8 nats
        adaptive = EntropyScheduler("adaptive", start=1e-3, target_low=0.3, target_high=0.8)
        trainer = Trainer(callbacks=[adaptive])
    """

    def __init__(
        self,
        schedule: Schedule = "constant",
        start: float = 0.0,
        end: float = 0.0,
        warmup_updates: int = 0,
        total_updates: int | None = None,
        target_low: float = 0.3,
        target_high: float = 1.0,
        adapt_rate: float = 0.1,
        max_rel_change: float = 0.05,
        coef_min: float = 1e-5,
        coef_max: float = 0.1,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        _check_schedule(schedule, start, end, total_updates, warmup_updates, where)
        #: The adaptive controller's settings (used by ``schedule="adaptive"`` only).
        self.band = AdaptiveEntropyBand(
            target_low, target_high, adapt_rate, max_rel_change, coef_min, coef_max
        )
        if schedule == "adaptive":
            self.band.check(where, start)
        self.schedule = schedule
        self.start = float(start)
        self.end = float(end)
        self.warmup_updates = warmup_updates
        self.total_updates = total_updates
        self.updates = 0  # optimizer updates seen
        self.adaptive_state = float(start)  # the adaptive controller's coefficient
        self.coef = self._coef_for(0)  # coefficient applied to the next update

    def _coef_for(self, step: int) -> float:
        if self.schedule != "adaptive":
            return schedule_value(
                step,
                schedule=self.schedule,
                start=self.start,
                end=self.end,
                total_updates=self.total_updates,
                warmup_updates=self.warmup_updates,
            )
        if step < self.warmup_updates:
            return self.adaptive_state * step / self.warmup_updates
        return self.adaptive_state

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.coef = self._coef_for(self.updates)
        policy_state_of(pl_module, "EntropyScheduler").set_entropy_coef(self.coef)

    @override
    def on_dapo_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]
    ) -> None:
        """DAPO hook: after an optimizer update, set the coefficient for the next one."""
        self.updates += 1
        if self.schedule == "adaptive" and self.updates > self.warmup_updates:
            entropy = float(metrics.get("entropy", math.nan))
            self.adaptive_state = adaptive_coef(self.adaptive_state, entropy, self.band)
        self.coef = self._coef_for(self.updates)
        policy_state_of(pl_module, "EntropyScheduler").set_entropy_coef(self.coef)
        pl_module.log("entropy/coef", self.coef, on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "adaptive_state": self.adaptive_state, "coef": self.coef}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = int(state_dict["updates"])
        self.adaptive_state = float(state_dict["adaptive_state"])
        self.coef = float(state_dict["coef"])
