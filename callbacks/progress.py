"""What a person watching a DAPO run sees: :class:`DAPOProgressBar` and the end-of-fit summary.

In a terminal the bar is Lightning's rich bar counting optimizer updates (``global_step``) up to
``max_steps``, with the rollout metrics beside it. When stdout is not a terminal (a log file, a
SLURM job, CI) it prints one plain line per rollout step instead. Either way it prints one line
per validation and, when ``fit`` ends, a summary: why it stopped, updates done, best and last
``val/acc``, where the checkpoints and logs are, and the command that plots the run.

The values come from ``trainer.callback_metrics``: the names DAPOModule logs every rollout step
(:data:`STEP_FIELDS`) and after every validation (``val/acc``, ``val/pass@k``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from dapo_lightning.checks import ConfigError, check_count
from dapo_lightning.envs.calls import EnvironmentFailureError
from dapo_lightning.interrupt import AbortRequested, StopRequested, stop_requested
from dapo_lightning.policy_state import HoldsPolicyState
from dapo_lightning.ranks import lost_rank
from dapo_lightning.rewards.results import RewardFailureError

#: Errors of the config, its reward or its environment: the command line prints each as its one
#: ``dapo-lightning: error:`` line (exit 2, :mod:`dapo_lightning.cli.errors`), so the summary
#: and the RunGuard name them without repeating the message.
ONE_LINE_FAULTS: tuple[type[BaseException], ...] = (
    ConfigError,
    RewardFailureError,
    EnvironmentFailureError,
)

#: What the bar and the plain lines show: (label, metric name, format).
STEP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "rollout/reward_mean", "{:+.3f}"),
    ("acc", "rollout/acc", "{:.3f}"),
    ("kept", "data/kept_frac", "{:.2f}"),
    ("len", "rollout/response_length_mean", "{:.1f}"),
    ("gen", "time/generation_s", "{:.2f}s"),
    ("score", "data/score_seconds", "{:.2f}s"),
    ("upd", "time/update_s", "{:.2f}s"),
    ("val/acc", "val/acc", "{:.3f}"),
)


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def step_fields(metrics: dict[str, Any]) -> dict[str, str]:
    """``{label: formatted value}`` of :data:`STEP_FIELDS` present in ``metrics``."""
    out = {}
    for label, name, fmt in STEP_FIELDS:
        value = _number(metrics.get(name))
        if value is not None:
            out[label] = fmt.format(value)
    return out


def updates_text(trainer: pl.Trainer) -> str:
    """``"update 12/600"`` (``"update 12"`` without ``max_steps``)."""
    total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
    return f"update {trainer.global_step}{total}"


def validation_line(trainer: pl.Trainer, metrics: dict[str, Any]) -> str | None:
    """``"validation at update 10: val/acc 0.312 | val/pass@16 0.850"``; None without val/acc."""
    if _number(metrics.get("val/acc")) is None:
        return None
    names = ["val/acc", *sorted(k for k in metrics if k.startswith("val/pass@"))]
    values = " | ".join(f"{k} {float(metrics[k]):.3f}" for k in names)
    when = " (before training)" if trainer.sanity_checking else ""
    return f"validation at update {trainer.global_step}{when}: {values}"


def stop_reason(trainer: pl.Trainer, exception: BaseException | None = None) -> str:
    """Why ``fit`` ended: the exception, a stop request, a callback's or the module's reason
    (``DAPOModule.stop_reason``: the data side ended training), or the limit hit."""
    if isinstance(exception, (KeyboardInterrupt, AbortRequested)):
        return "interrupted (Ctrl-C twice: aborted at once)"
    if isinstance(exception, StopRequested):
        return str(exception)
    lost = lost_rank(exception) if exception is not None else None
    if lost is not None:
        return f"error: {lost}"
    if isinstance(exception, ONE_LINE_FAULTS):  # its message is the error line's
        return f"error: {type(exception).__name__} (the error: line says why)"
    if exception is not None:
        text = str(exception).strip().splitlines()
        return f"error: {type(exception).__name__}" + (f": {text[0][:300]}" if text else "")
    if stop_requested():
        return f"stop requested ({stop_requested()})"
    for callback in trainer.callbacks:
        if getattr(callback, "stop_reason", None):  # CollapseDetector(action="stop")
            return f"{type(callback).__name__}: {callback.stop_reason}"
        if (
            isinstance(callback, EarlyStopping)
            and callback.stopping_reason != EarlyStoppingReason.NOT_STOPPED
        ):
            return f"EarlyStopping: {callback.stopping_reason_message}"
    module = trainer.lightning_module
    if getattr(module, "stop_reason", None):  # the data side ended training (EndOfTraining)
        return f"{type(module).__name__}: {module.stop_reason}"
    if trainer.max_steps == 0:  # a fit that only sets up (writes the first-use model, say)
        return "trainer.max_steps=0: no update was asked for (give max_steps >= 1 to train)"
    if trainer.max_steps and 0 < trainer.max_steps <= trainer.global_step:
        return f"max_steps={trainer.max_steps} reached"
    if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch:
        return f"max_epochs={trainer.max_epochs} reached"
    if trainer.should_stop:
        return "trainer.should_stop was set"
    return "the training data ran out"


def rollout_steps_done(module: object) -> int | None:
    """The rollout steps ``module`` has done (its
    :class:`~dapo_lightning.policy_state.PolicyState`), or None for a module without one."""
    return module.policy_state.rollout_step if isinstance(module, HoldsPolicyState) else None


def plot_dir(trainer: pl.Trainer) -> Path | None:
    """The run folder ``dapo-lightning plot`` takes: the CSVLogger's ``save_dir/name`` (all its
    ``version_*`` folders, so resumed runs plot whole); None without a CSVLogger."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            return Path(logger.root_dir)
    return None


def run_summary(
    trainer: pl.Trainer,
    val_history: list[tuple[int, float]],
    seconds: float | None = None,
    exception: BaseException | None = None,
) -> str:
    """The end-of-fit summary (several lines).

    Args:
        trainer: The trainer whose ``fit`` ended.
        val_history: ``(global_step, val/acc)`` of each validation, in order.
        seconds: Wall-clock seconds of the fit, if known.
        exception: What ended the fit, if it raised.
    """
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    rollout = rollout_steps_done(trainer.lightning_module)
    rollout_text = f" ({rollout} rollout steps)" if rollout is not None else ""
    lines = [
        "DAPO fit summary",
        f"  stopped:     {stop_reason(trainer, exception)}",
        f"  updates:     {updates_text(trainer).removeprefix('update ')}{rollout_text}{took}",
    ]
    if val_history:
        best_step, best = max(val_history, key=lambda sv: (sv[1], -sv[0]))
        last_step, last = val_history[-1]
        lines.append(
            f"  val/acc:     best {best:.3f} (update {best_step}), "
            f"last {last:.3f} (update {last_step})"
        )
    ckpt = trainer.checkpoint_callback
    if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath:
        last_path = f" (last: {Path(ckpt.last_model_path).name})" if ckpt.last_model_path else ""
        lines.append(f"  checkpoints: {ckpt.dirpath}{last_path}")
    if trainer.logger is not None and trainer.logger.log_dir:
        lines.append(f"  logs:        {trainer.logger.log_dir}")
    run_dir = plot_dir(trainer)
    if run_dir is not None:
        lines.append(f"  plot:        {cli_command()} plot {run_dir}")
    return "\n".join(lines)


def cli_command(argv0: str | None = None) -> str:
    """How to call the ``dapo-lightning`` command from here, as this process was run: the bare
    name when it is on ``PATH`` (an activated environment), else the console script's path
    (``.venv/bin/dapo-lightning``, relative to the working directory when below it), else
    ``python -m dapo_lightning`` with this interpreter (a ``python -c`` process).

    Args:
        argv0: The program this process was started as (``sys.argv[0]`` when None).
    """
    program = Path(argv0 if argv0 is not None else sys.argv[0])
    if program.name != "dapo-lightning":
        program = Path(sys.executable).parent / "dapo-lightning"
    if not program.is_file():
        return f"{sys.executable} -m dapo_lightning"
    found = shutil.which("dapo-lightning")
    if found is not None and Path(found).resolve() == program.resolve():
        return "dapo-lightning"
    relative = os.path.relpath(program.absolute())
    return relative if not relative.startswith("..") else str(program.absolute())


class DAPOProgressBar(RichProgressBar):
    """Progress of a DAPO fit: a rich bar in a terminal, one plain line per rollout step
    elsewhere; a line per validation and a summary at the end of ``fit`` in both.

    The bar counts optimizer updates up to ``trainer.max_steps`` and shows :data:`STEP_FIELDS`
    (reward, accuracy, kept share of groups, mean response length, generation and update
    seconds, the last val/acc) plus any metric logged with ``prog_bar=True``. Needs
    ``trainer.enable_progress_bar: true``. Only rank zero prints.

    Args:
        mode: ``"auto"``: rich when stdout is a terminal (or a notebook), else plain lines;
            ``"rich"`` or ``"plain"`` force one.
        plain_every_n_steps: Print a plain line every this many rollout steps.
        refresh_rate: Redraws of the rich bar per second.
        console_kwargs: Passed to rich's ``Console`` (e.g. ``{"force_terminal": True}``).

    Raises:
        ValueError: An unknown ``mode`` or ``plain_every_n_steps < 1``.

    Example::

        trainer = Trainer(callbacks=[DAPOProgressBar()], max_steps=600)

        # or in a config: trainer.callbacks: [{class_path: dapo_lightning.callbacks.DAPOProgressBar}]
    """

    def __init__(
        self,
        mode: Literal["auto", "rich", "plain"] = "auto",
        plain_every_n_steps: int = 1,
        refresh_rate: int = 4,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if mode not in ("auto", "rich", "plain"):
            raise ValueError(
                f"DAPOProgressBar.mode must be 'auto', 'rich' or 'plain', got {mode!r}."
            )
        check_count(
            "DAPOProgressBar.plain_every_n_steps", plain_every_n_steps, 1, "rollout steps per line"
        )
        super().__init__(refresh_rate=refresh_rate, leave=True, console_kwargs=console_kwargs)
        self.mode = mode
        self.plain_every_n_steps = plain_every_n_steps
        self.plain = mode == "plain"
        #: ``(global_step, val/acc)`` of every validation of the current fit.
        self.val_history: list[tuple[int, float]] = []
        self._fit_start: float | None = None

    @property
    @override
    def refresh_rate(self) -> float:
        return 0 if self.plain else self._refresh_rate  # 0 disables the rich display

    @property
    @override
    def total_train_batches(self) -> int | float:
        steps = self.trainer.max_steps
        return steps if steps and steps > 0 else float("inf")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.mode == "auto":
            from rich.console import Console

            console = Console(**self._console_kwargs)
            self.plain = not (console.is_terminal or console.is_jupyter)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        shown = step_fields(trainer.callback_metrics)
        extra = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        return {**shown, **{k: v for k, v in extra.items() if k not in shown}}

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "DAPO update"

    def say(self, text: str) -> None:
        """Print ``text`` on rank zero, above the rich bar when it is drawn."""
        if not self._enabled:
            return
        if self._console is not None and self.progress is not None and not self._progress_stopped:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.val_history, self._fit_start = [], time.monotonic()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.plain:
            self.say(f"fit: {updates_text(trainer)}; generating the first rollout step ...")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed mid-epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)  # updates, not batches
        self._update_metrics(trainer, pl_module)
        step = rollout_steps_done(pl_module)
        step = step if step is not None else trainer.global_step
        if self.plain and step % self.plain_every_n_steps == 0:
            fields = step_fields(trainer.callback_metrics)
            self.say(" | ".join([updates_text(trainer), *(f"{k} {v}" for k, v in fields.items())]))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        metrics = trainer.callback_metrics
        line = validation_line(trainer, metrics)
        if line is None:
            return
        if trainer.state.fn == "fit":
            self.val_history.append((trainer.global_step, float(metrics["val/acc"])))
        self.say(line)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._summarize(trainer, None)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)
        if trainer.state.fn == "fit":
            self._summarize(trainer, exception)

    def _summarize(self, trainer: pl.Trainer, exception: BaseException | None) -> None:
        self._stop_progress()
        seconds = None if self._fit_start is None else time.monotonic() - self._fit_start
        self.say(run_summary(trainer, self.val_history, seconds, exception))
        sys.stdout.flush()
