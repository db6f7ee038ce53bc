"""RunGuard: nothing is lost when a fit ends, whatever ends it (see docs/design.md, "Stopping and
resuming").

* **End of fit** (``max_steps``, ``EarlyStopping``, any ``trainer.should_stop``): the final state
  is saved as ``last.ckpt`` in the checkpoint directory of the trainer's ``ModelCheckpoint``,
  where ``--ckpt_path auto`` finds it, unless that exact update is already saved (with
  checkpointing off, ``enable_checkpointing=False``, nothing is saved). Lightning's
  ``ModelCheckpoint(save_last=True)`` alone saves on its own schedule only: a run stopping at
  update 50 with ``every_n_train_steps=20`` would end with update 40 on disk.
* **Periodic saves**: ``ModelCheckpoint(every_n_train_steps=N)`` saves only when the update
  count lands on a multiple of N after a rollout step; a step's several updates can step over
  it (and a step with an odd count shifts every later one off the multiples). When a step
  passes a multiple without landing on it, it saves all the same: the guard makes each plain
  ``ModelCheckpoint`` a :class:`~dapo_lightning.callbacks.step_checkpoint.StepCheckpoint`.
* **SIGTERM / SIGINT / SIGHUP / SIGQUIT / SIGUSR1 / SIGUSR2** (:mod:`dapo_lightning.interrupt`):
  the signal only records a stop request. The rollout step under way finishes (or, during
  generation, the producer raises :class:`~dapo_lightning.interrupt.StopRequested` between
  rounds), the state is saved, and the command exits with 128 + the signal (143 / 130 / 129).
  A second or third signal never cuts the save (:func:`~dapo_lightning.interrupt.saving`).
  Lightning's own SIGTERM handling (``SIGTERMException`` at the end of the step, SLURM's
  requeue signal) keeps working: the guard's handler is composed into it. Ctrl-C twice
  abandons the update under way (not a save that has begun).
* **SLURM's requeue signal** (SIGUSR1 under ``srun``; :mod:`dapo_lightning.slurm`): handled like
  SIGTERM (no save inside Lightning's signal handler), then global rank 0 requeues the job.
* **Any other exception** after training started: the state is saved if it is one that training
  reached between two optimizer updates (every hook outside ``optimizer.step``); not in the middle
  of an optimizer step, and on several ranks only for a stop every rank takes part in (a
  collective save cannot wait for a rank that failed alone).
* **One fit per run directory**: a lock file (:class:`RunLock`) in ``trainer.default_root_dir``.
  The run directory and the checkpoint folder are tried for writing at ``setup``, before any
  training time is spent (:func:`~dapo_lightning.run_lock.check_run_dirs_writable`).
* **Checkpoint files**: Lightning's plain ``TorchCheckpointIO`` is replaced by
  :class:`~dapo_lightning.checkpoint.AtomicCheckpointIO` (atomic writes, the previous
  ``last.ckpt`` kept as ``last-previous.ckpt``, a clear error on a full disk).
* **Resume**: the config applies. Where the checkpoint's module / data hyper-parameters or the
  optimizer's (learning rate, weight decay, ...) differ from the config, the config's values are
  used and each difference is printed. The weights are the checkpoint's: a changed
  ``model_name_or_path`` is printed as what it is (the architecture and tokenizer come from
  it, the weights do not). The resumed run keeps writing ``last.ckpt`` where it resumed, also
  when the run directory was copied or moved (:func:`_continue_last`).

Multi-rank: every rank takes part in the saves (``trainer.save_checkpoint`` is collective) and in
the stop decision; only global rank 0 writes files and prints.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from dapo_lightning.callbacks.progress import ONE_LINE_FAULTS
from dapo_lightning.callbacks.step_checkpoint import save_stepped_over_multiples
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from dapo_lightning.checkpoint.files import CheckpointWriteError, newest_checkpoint
from dapo_lightning.checkpoint.io import AtomicCheckpointIO, NonFiniteCheckpointError
from dapo_lightning.checkpoint.optimizer import (
    apply_optimizer_settings,
    check_same_optimizer,
    optimizer_settings,
)
from dapo_lightning.checks import ConfigError
from dapo_lightning.hooks import DAPOCallback
from dapo_lightning.interrupt import (
    StopRequested,
    clear_stop_request,
    exit_code,
    install_stop_handlers,
    reassert_stop_handlers,
    request_stop,
    saving,
    stop_requested,
)
from dapo_lightning.lightning_internals import (
    as_batch_end_state,
    last_saved_step,
    monitor_candidates,
    save_last_as_model_checkpoint,
)
from dapo_lightning.ranks import lost_rank
from dapo_lightning.run_lock import RunDirLockedError, RunLock, check_run_dirs_writable
from dapo_lightning.slurm import requeue_job, requeue_signal
from dapo_lightning.step_guard import NonFiniteUpdatesError

#: Exceptions every rank raises together: the state can be saved collectively.
_COLLECTIVE_STOPS = (StopRequested, SIGTERMException)


class RunGuard(DAPOCallback):
    """Saves the final state at the end of fit, on SIGTERM / SIGINT and on an exception; one fit
    per run directory; the config applies on resume (see the module docstring).

    The ``dapo-lightning`` CLI adds one to every fit that has none.

    Args:
        lock: Hold a lock file in ``trainer.default_root_dir`` while fitting, so a second fit in
            the same run directory fails at once instead of mixing its checkpoints in.

    Raises:
        RunDirLockedError: From ``setup``, when another live fit holds the run directory.

    Example::

        trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="runs/x/checkpoints", save_last=True),
                                     RunGuard()])
    """

    def __init__(self, lock: bool = True) -> None:
        self.lock = lock
        self._lock: RunLock | None = None
        self._restore_signals = None
        self._configured_optim: list[list[dict[str, Any]]] = []
        self._resume_notes: list[str] = []
        self._weights_note: str | None = None
        self._started = False
        self._in_optimizer_step = False
        self._saved_step = -1
        self._stopping: str | None = None
        self._requeue_on: str | None = None  # the name of SLURM's requeue signal, under srun

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        _check_writable(trainer)
        save_stepped_over_multiples(trainer)
        if self.lock:
            self._lock = RunLock.acquire_for(trainer, Path(trainer.default_root_dir))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # optimizers are configured, the checkpoint (if any) is not restored yet
        self._configured_optim = optimizer_settings(trainer)
        self._started, self._stopping, self._in_optimizer_step = False, None, False
        clear_stop_request()
        requeue = requeue_signal(trainer)
        self._requeue_on = None if requeue is None else requeue.name
        self._restore_signals = install_stop_handlers(() if requeue is None else (requeue,))

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        notes = _hparam_changes("model", checkpoint.get("hyper_parameters"), pl_module)
        notes += _hparam_changes(
            "data", checkpoint.get("datamodule_hyper_parameters"), trainer.datamodule
        )
        self._weights_note = _weights_note(notes)
        self._resume_notes = [n for n in notes if not _is_weight_source(n)]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reassert_stop_handlers()  # Lightning composed ours into its own (see that function)
        if trainer.ckpt_path:  # another optimizer class: one line, before anything is saved
            check_same_optimizer(trainer, self._configured_optim)
        self._started = True
        self._saved_step = trainer.global_step  # a fresh start has nothing new; a resume is on disk
        if trainer.ckpt_path:
            _continue_last(trainer)
            notes = self._resume_notes + apply_optimizer_settings(trainer, self._configured_optim)
            head = f"Resuming from {trainer.ckpt_path} at update {trainer.global_step}"
            if notes:
                head += "; the config applies where it differs from the checkpoint:"
            weights = [self._weights_note] if self._weights_note else []
            _say(trainer, "\n  ".join([head, *notes, *weights]))

    # ------------------------------------------------------------------ between updates
    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._in_optimizer_step = True

    @override
    def on_dapo_update(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]
    ) -> None:
        self._in_optimizer_step = False  # the update and its counters are complete

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stopping is not None:  # should_stop was overruled (min_steps): stop anyway
            raise StopRequested(self._stopping)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._in_optimizer_step = False
        reason = _stop_on_any_rank(trainer)
        if reason is not None:
            self._stopping = reason
            trainer.should_stop = True

    # ------------------------------------------------------------------ saving
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = _model_checkpoint(trainer)
        why = f"stopped ({self._stopping})" if self._stopping else "final"
        with saving():  # a second signal never cuts the save
            if checkpoint is not None and trainer.global_step > 0:  # checkpointing on, trained
                if self._already_saved(trainer, checkpoint):
                    self._report(trainer, _last_path(checkpoint), why)
                else:
                    self._save(trainer, checkpoint, why)
            self._requeue_if_asked(trainer, self._stopping)  # also with nothing saved

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        as_batch_end_state(checkpoint)  # a save between two steps resumes its step count

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:  # the handlers stay while it saves: a second signal never cuts the save
            with saving():
                checkpoint = _model_checkpoint(trainer)
                why_not = self._why_not_save(trainer, checkpoint, exception)
                if why_not is None and checkpoint is not None:
                    self._save(trainer, checkpoint, f"saved on {_describe(exception)}")
                elif why_not:
                    _say(trainer, f"{_describe(exception)}: {why_not}")
                self._requeue_if_asked(trainer, stop_requested())
        finally:
            self._stop_guarding()
            self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_guarding()
        self._release()

    def _why_not_save(
        self, trainer: pl.Trainer, checkpoint: ModelCheckpoint | None, exception: BaseException
    ) -> str | None:
        """None when the state can be saved now, else why not ('' for: nothing to say)."""
        if checkpoint is None or not self._started or trainer.sanity_checking:
            return ""  # checkpointing is off, or training has not started
        where = _last_path(checkpoint).parent
        if trainer.global_step == 0:
            return "nothing to save yet (no update was made)."
        if isinstance(exception, NonFiniteCheckpointError):
            return str(exception)
        if isinstance(exception, NonFiniteUpdatesError):
            last = newest_checkpoint(where)
            kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
            return f"not saved; {kept}."
        if self._already_saved(trainer, checkpoint):
            return f"update {trainer.global_step} is already saved in {where}."
        if isinstance(exception, CheckpointWriteError):
            return f"not saved again ({exception.why}); the complete checkpoints are in {where}."
        if self._in_optimizer_step:
            return (
                "not saved: it came in the middle of an optimizer step (the weights may be half "
                f"updated); resume from the checkpoints in {where}."
            )
        if trainer.world_size > 1 and not isinstance(exception, _COLLECTIVE_STOPS):
            return (
                f"not saved: an exception on one rank of {trainer.world_size} leaves the others "
                f"unable to join a collective save; resume from the checkpoints in {where}."
            )
        return None

    def _save(self, trainer: pl.Trainer, checkpoint: ModelCheckpoint, why: str) -> None:
        """Write ``last.ckpt`` through ``checkpoint`` (collective; rank 0 writes); non-finite
        weights are not written (the message names the last good checkpoint)."""
        try:
            self._write_last(trainer, checkpoint)
        except NonFiniteCheckpointError as refused:
            _say(trainer, f"{why}: {refused}")
            return
        self._saved_step = trainer.global_step
        self._report(trainer, _last_path(checkpoint), why)

    @staticmethod
    def _write_last(trainer: pl.Trainer, checkpoint: ModelCheckpoint) -> None:
        if checkpoint.save_last:
            save_last_as_model_checkpoint(checkpoint, trainer)
        else:
            trainer.save_checkpoint(_last_path(checkpoint))

    @staticmethod
    def _report(trainer: pl.Trainer, path: Path, why: str) -> None:
        metrics = trainer.callback_metrics
        shown = "".join(f", {k}={float(metrics[k]):.4g}" for k in ("val/acc",) if k in metrics)
        _say(
            trainer,
            f"Saved {path} ({why}, update {trainer.global_step}{shown}). "
            "Resume with the same command plus --ckpt_path auto.",
        )

    def _already_saved(self, trainer: pl.Trainer, checkpoint: ModelCheckpoint) -> bool:
        """This update is on disk: saved by the guard, or as ``last`` by the ModelCheckpoint
        (which writes ``last`` whenever it saves, with ``save_last``)."""
        by_checkpoint = (
            bool(checkpoint.save_last)
            and last_saved_step(checkpoint) == trainer.global_step
            and bool(checkpoint.last_model_path)
        )
        return self._saved_step == trainer.global_step or by_checkpoint

    def _requeue_if_asked(self, trainer: pl.Trainer, reason: str | None) -> None:
        """After the save of a stop on SLURM's requeue signal: requeue the job (rank 0)."""
        if reason is not None and reason == self._requeue_on and trainer.is_global_zero:
            _say(trainer, requeue_job())

    def _stop_guarding(self) -> None:
        if self._restore_signals is not None:
            self._restore_signals()
            self._restore_signals = None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _model_checkpoint(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The trainer's ModelCheckpoint that keeps ``last.ckpt`` (else its first one; None: the
    trainer has none, i.e. ``enable_checkpointing=False``, and the guard saves nothing)."""
    found = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return next((c for c in found if c.save_last), found[0] if found else None)


def _last_path(checkpoint: ModelCheckpoint) -> Path:
    if checkpoint.last_model_path:
        return Path(checkpoint.last_model_path)
    return Path(checkpoint.dirpath or ".") / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt"


def _check_writable(trainer: pl.Trainer) -> None:
    """:func:`~dapo_lightning.run_lock.check_run_dirs_writable` for the run directory and the
    configured checkpoint folders, on global rank 0; every rank raises alike."""
    problem = None
    if trainer.is_global_zero:
        folders = [c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
        try:
            check_run_dirs_writable(trainer.default_root_dir, folders)
        except ConfigError as error:
            problem = str(error)
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise ConfigError(problem)


def _continue_last(trainer: pl.Trainer) -> None:
    """After a resume, let each ``save_last`` ModelCheckpoint write ``last.ckpt`` again.

    Lightning versions the name (``last-v1.ckpt``) when ``last.ckpt`` exists but is not the
    ``last_model_path`` of its restored state, and ``ModelCheckpoint.load_state_dict`` drops
    that path whenever the checkpoint's ``dirpath`` differs from the current one: after a copy
    or a move of the run directory, every resume wrote ``last-v1.ckpt`` and left ``last.ckpt``
    behind, stale. When the fit resumed from a checkpoint of this run directory (its checkpoint
    folder, or a requeue's ``hpc_ckpt`` in the run directory: what ``--ckpt_path auto`` picks,
    the highest update there), that ``last.ckpt`` is this run's and the one to continue; a
    resume from a checkpoint elsewhere leaves Lightning's naming as it is.
    """
    resumed_in = Path(str(trainer.ckpt_path)).absolute().parent.resolve()
    for checkpoint in trainer.checkpoint_callbacks:
        if not isinstance(checkpoint, ModelCheckpoint) or not checkpoint.save_last:
            continue
        here = {Path(str(checkpoint.dirpath)).resolve(), Path(trainer.default_root_dir).resolve()}
        if resumed_in not in here:
            continue
        last = checkpoint.format_checkpoint_name(
            monitor_candidates(checkpoint, trainer), checkpoint.CHECKPOINT_NAME_LAST
        )
        if checkpoint.last_model_path != last and os.path.exists(last):
            checkpoint.last_model_path = last


def _stop_on_any_rank(trainer: pl.Trainer) -> str | None:
    """The stop request of any rank, recorded on every rank (a collective: a signal that
    reached one rank stops all of them after the same step, with the same exit status)."""
    reason = stop_requested()
    if trainer.world_size == 1:
        return reason
    code = exit_code(reason) - 128 if reason is not None else 0  # the signal number, or -127
    gathered = trainer.strategy.all_gather(
        torch.tensor([code], device=trainer.strategy.root_device)
    )
    codes = [int(c) for c in gathered.flatten().tolist() if int(c) != 0]
    if reason is None and codes:
        signals = [c for c in codes if c > 0]
        reason = signal.Signals(max(signals)).name if signals else "stop requested on another rank"
        request_stop(reason)
    return reason


def _describe(exception: BaseException) -> str:
    if isinstance(exception, StopRequested):
        return exception.reason
    if isinstance(exception, SIGTERMException):
        return "SIGTERM"
    lost = lost_rank(exception)
    if lost is not None:
        return lost
    if isinstance(exception, ONE_LINE_FAULTS):  # the CLI's error line says the message
        return type(exception).__name__
    text = str(exception).splitlines()[0] if str(exception) else ""
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__


class _Group:
    """A config group's dict, seen as an object with ``hparams`` (for the recursion)."""

    def __init__(self, hparams: dict) -> None:
        self.hparams = hparams


def _hparam_changes(section: str, saved: Any, obj: Any) -> list[str]:
    """``section.key: old (checkpoint) -> new (config)`` for each differing hyper-parameter."""
    current = getattr(obj, "hparams", None)
    if not isinstance(saved, dict) or current is None:
        return []
    out = []
    for key, value in current.items():
        if key.startswith("_") or key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):  # a config group
            out += _hparam_changes(f"{section}.{key}", saved[key], _Group(value))
            continue
        try:
            differs = bool(saved[key] != value)
        except Exception:  # noqa: BLE001 - values without a plain comparison are not reported
            continue
        if differs:
            out.append(f"{section}.{key}: {saved[key]!r} (checkpoint) -> {value!r} (config)")
    return out


#: The settings naming the model the run was started from (``data``'s is linked to ``model``'s).
_WEIGHT_SOURCES = ("model.model_name_or_path: ", "data.model_name_or_path: ")


def _is_weight_source(note: str) -> bool:
    return note.startswith(_WEIGHT_SOURCES)


def _weights_note(notes: list[str]) -> str | None:
    """What a changed ``model_name_or_path`` on a resume means, said truthfully: the weights
    continue from the checkpoint (Lightning restores the module's ``state_dict``); the new
    path gave the architecture and the tokenizer only."""
    changed = next((n for n in notes if n.startswith(_WEIGHT_SOURCES[0])), None)
    changed = changed or next((n for n in notes if _is_weight_source(n)), None)
    if changed is None:
        return None
    return (
        f"{changed}: the weights continue from the checkpoint, not "
        "from that model (it gave the architecture and the tokenizer only). To train from its "
        "weights, start a fresh run: another --trainer.default_root_dir, no --ckpt_path."
    )


def _say(trainer: pl.Trainer, message: str) -> None:
    if trainer.is_global_zero:
        print(message, file=sys.stderr, flush=True)


__all__ = ["RunDirLockedError", "RunGuard"]
