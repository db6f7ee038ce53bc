"""Every use of a Lightning internal, in one file: the functions the library calls instead.

Lightning's public API does not reach everything a DAPO fit needs: the fit loop's counters (a
rollout step is one batch of several optimizer updates), the trainer a module is attached to
before ``module.trainer`` may be read, ``ModelCheckpoint``'s own save of ``last``, the validation
loop run by hand before the first update. Each function here is named for what it does and
says which internal it touches and why. Internals are private names (a leading underscore) of
Lightning's objects and modules, the fit and epoch loops (``trainer.fit_loop``), their state
in a checkpoint (``checkpoint["loops"]["fit_loop"]``) and ``lightning.pytorch.trainer.call``;
``tests/test_structure.py`` fails on any of them outside this file. A subclass of a Lightning
class using its base class's underscore members through ``self`` (``StepCheckpoint``,
``DAPOProgressBar``, the CLI) extends that class and is not counted.

Checked against Lightning 2.6.6: on an upgrade, read this file against the new release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments.slurm import SLURMEnvironment, _is_srun_used
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

__all__ = [
    "RICH_AVAILABLE",
    "as_batch_end_state",
    "attached_trainer",
    "cluster_environment",
    "format_summary_table",
    "last_checkpoint_paths",
    "last_saved_step",
    "monitor_candidates",
    "optimizer_step_progress",
    "replace_srun_check",
    "restore_fit_loop",
    "run_validation_loop",
    "save_last_as_model_checkpoint",
    "set_batches_that_stepped",
    "srun_used",
    "summary_settings",
]

#: Whether ``rich`` is installed (``lightning.pytorch.utilities.imports._RICH_AVAILABLE``), as
#: Lightning's own rich callbacks decide it.
RICH_AVAILABLE = bool(_RICH_AVAILABLE)

#: ``lightning.pytorch.utilities.model_summary.model_summary._format_summary_table``: the text
#: table of ``ModelSummary`` (``DAPOModelSummary`` prints it without the FLOPs column).
format_summary_table = _format_summary_table


# ----------------------------------------------------------------------------- trainer
def attached_trainer(module: Any) -> Any:
    """The trainer ``module`` (a LightningModule) is attached to, or None: reads
    ``LightningModule._trainer``, because ``module.trainer`` raises when there is none (a
    module used without a fit, as the unit tests and ``StrategyAdapter(None)`` do)."""
    return module._trainer


def cluster_environment(trainer: Any) -> Any:
    """The trainer's cluster environment (``SLURMEnvironment`` under srun): reads
    ``trainer._accelerator_connector.cluster_environment``, which the Trainer exposes only
    through its strategy once set up; the requeue signal is needed before."""
    return trainer._accelerator_connector.cluster_environment


def srun_used() -> bool:
    """Whether this process was started by ``srun``: Lightning's
    ``lightning.fabric.plugins.environments.slurm._is_srun_used`` (the same test Lightning
    makes, so the CLI's task-count check agrees with it)."""
    return bool(_is_srun_used())


def replace_srun_check(check: Callable[[], None]) -> None:
    """Make ``check`` Lightning's srun check: writes ``SLURMEnvironment._validate_srun_used``
    (Lightning's warns on every run inside a SLURM job, also one that is no srun task)."""
    SLURMEnvironment._validate_srun_used = staticmethod(check)  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- fit loop
def optimizer_step_progress(trainer: Any) -> Any:
    """Lightning's count of manual optimizer steps (``global_step`` is read from it), a
    stateful object: ``trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress``;
    a rollout step's start copy holds its state so that a stop can undo the step's updates."""
    return trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress


def set_batches_that_stepped(trainer: Any, step: int) -> None:
    """Write the step Lightning logs ``self.log`` values (and validations) at: the fit epoch
    loop's ``_batches_that_stepped`` (:mod:`~dapo_lightning.log_step` says why it moves)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def restore_fit_loop(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Load the fit loop's counters of ``checkpoint`` (``checkpoint["loops"]["fit_loop"]``)
    into ``trainer.fit_loop``, as Lightning does for ``fit`` only (a ``validate`` of a
    checkpoint then knows its update); nothing when it holds none."""
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if loops is not None:
        trainer.fit_loop.load_state_dict(loops)


def as_batch_end_state(checkpoint: dict[str, Any]) -> bool:
    """Write the fit loop's batch counters of ``checkpoint`` as Lightning's own end-of-batch
    saves have them (``n`` batches ready, started and processed, ``n - 1`` completed: the last
    one's end not yet counted), ``n`` the rollout steps done; returns whether it changed them.

    Touches the fit loop's state in a checkpoint: ``checkpoint["loops"]["fit_loop"]``, its
    ``epoch_loop.batch_progress`` counters and ``epoch_loop.state_dict["_batches_that_stepped"]``.

    The guard saves a stop or the end of the fit between two rollout steps (every counter
    equal) or inside a step it undid (that batch counted ready and started). Lightning resumes
    the first as "the end of an epoch" and the second with its total count one batch ahead
    (it winds back only the current epoch's counters): either way ``val_check_interval`` then
    validates one rollout step early for the rest of the run and EarlyStopping ends it
    elsewhere than an uninterrupted run (issue 53). Periodic saves, already of this form,
    resume right; so does any save once written so. An epoch's real last batch is left
    alone."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_loop.batch_progress")
    if not progress or progress.get("is_last_batch"):
        return False
    total = progress["total"]
    done = total["processed"]
    batch_end = total["ready"] == total["started"] == done == total["completed"] + 1
    if done < 1 or batch_end:
        return False
    all_equal = len(set(total.values())) == 1
    for counts in (total, progress["current"]):
        n = counts["processed"]
        counts.update(ready=n, started=n, completed=max(0, n - 1))
    state = loop.get("epoch_loop.state_dict", {})
    if all_equal and "_batches_that_stepped" in state:
        state["_batches_that_stepped"] -= 1  # Lightning adds it back on such a resume
    return True


def run_validation_loop(trainer: Any) -> None:
    """Run the fit's validation loop now, as the training loop runs a periodic one: keeps the
    logger connector's ``_first_loop_iter``, sets ``trainer.validating``, calls the module's
    ``on_validation_model_zero_grad`` through ``lightning.pytorch.trainer.call`` and runs
    ``trainer.fit_loop.epoch_loop.val_loop``; then back to training (``ValidateAtStart``)."""
    first_loop_iter = trainer._logger_connector._first_loop_iter
    trainer.validating = True
    call._call_lightning_module_hook(trainer, "on_validation_model_zero_grad")
    trainer.fit_loop.epoch_loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


# ----------------------------------------------------------------------------- callbacks
def last_checkpoint_paths(checkpoint: ModelCheckpoint, trainer: Any) -> set[str]:
    """The ``last*.ckpt`` paths ``checkpoint`` may have written (``last-previous.ckpt`` too):
    ``ModelCheckpoint._find_last_checkpoints`` (its file naming is Lightning's)."""
    return set(checkpoint._find_last_checkpoints(trainer))


def monitor_candidates(checkpoint: ModelCheckpoint, trainer: Any) -> dict[str, Any]:
    """The metrics ``checkpoint`` formats its file names with: ``_monitor_candidates``."""
    return checkpoint._monitor_candidates(trainer)


def last_saved_step(checkpoint: ModelCheckpoint) -> int:
    """The update ``checkpoint`` last saved at: ``ModelCheckpoint._last_global_step_saved``."""
    return int(checkpoint._last_global_step_saved)


def save_last_as_model_checkpoint(checkpoint: ModelCheckpoint, trainer: Any) -> None:
    """Save ``last`` of this update as ``checkpoint`` (with ``save_last``) would: through
    ``_save_last_checkpoint`` (its name, its link or copy, its bookkeeping), after writing a
    top-k file of this update through ``_save_checkpoint`` where ``save_last`` is ``"link"``
    (``last.ckpt`` points at the newest top-k file)."""
    candidates = checkpoint._monitor_candidates(trainer)
    if checkpoint.save_last == "link" and checkpoint.save_top_k != 0:
        checkpoint._save_checkpoint(trainer, checkpoint.format_checkpoint_name(candidates))
    checkpoint._save_last_checkpoint(trainer, candidates)


def summary_settings(summary: ModelSummary) -> tuple[int, dict[str, Any]]:
    """A ``ModelSummary``'s depth and other arguments (``_max_depth``,
    ``_summarize_kwargs``), to build a ``DAPOModelSummary`` in its place."""
    return summary._max_depth, dict(summary._summarize_kwargs)
