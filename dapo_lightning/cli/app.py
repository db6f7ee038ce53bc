"""The LightningCLI of ``fit`` and ``validate`` (:class:`DAPOLightningCLI`, built by
:func:`build_cli`); what each step does is in the modules it calls (see the package docstring).
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from dapo_lightning.callbacks.collapse import raise_if_collapsed
from dapo_lightning.callbacks.run_guard import RunGuard
from dapo_lightning.callbacks.summary import replace_default_summary
from dapo_lightning.checkpoint.checks import check_ckpt_path
from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.errors import class_error, trainer_fix
from dapo_lightning.cli.model_source import (
    CreateModel,
    check_model_source,
    model_to_create,
    write_model,
)
from dapo_lightning.cli.parser import (
    SUBCOMMAND_HELP,
    DAPOHelpFormatter,
    StrictArgumentParser,
    allow_auto_precision,
)
from dapo_lightning.cli.run_setup import (
    AUTO_CKPT,
    check_resume_ranks,
    check_world_split,
    choose_run_threads,
    continue_update_count,
    fill_data_seed,
    resolve_auto_checkpoint,
    resolve_run_paths,
    run_dirs,
    separate_validate_logs,
)
from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.interrupt import NOTHING_SAVED, exit_at_once_on_stop_signals
from dapo_lightning.module import DAPOModule
from dapo_lightning.precision import resolve_trainer_precision
from dapo_lightning.run_lock import check_run_dirs_writable
from dapo_lightning.slurm import array_task_run, check_task_count


class DAPOLightningCLI(LightningCLI):
    """LightningCLI with DAPO's argument links, run-directory paths, on-first-use model creation,
    a :class:`~dapo_lightning.callbacks.RunGuard` on every fit and ``--ckpt_path auto``
    (see the module docstring)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` (Lightning's ``test`` / ``predict`` have no DAPO meaning)."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    def add_core_arguments_to_parser(self, parser) -> None:
        """As LightningCLI does, except that the module's ``policy`` (an already built
        ``nn.Module``, for Python callers) is no CLI option: a config cannot build one, and its
        help listed every ``torch.nn.Module`` subclass before the first DAPO option."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults(
            {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        )
        parser.add_subclass_arguments(
            self._model_class, "model", fail_untyped=False, required=True, skip={"policy"}
        )
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=True)

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        parser.add_argument(
            "--create_model_if_missing",
            type=CreateModel | Literal["tiny", "tiny-arithmetic"] | None,
            default=None,
            help="Write a tiny model folder on first use: {kind: tiny|tiny-arithmetic, path: "
            "FOLDER} (relative: under trainer.default_root_dir), or just the kind to write it at "
            "model.model_name_or_path.",
        )
        parser.add_argument(
            "--threads",
            type=int | Literal["auto"],
            default="auto",
            help="Intra-op threads of torch: auto (1 for a model of at most 2M parameters, "
            "else the usable cores shared by the CPU processes of the run) or a count. "
            "OMP_NUM_THREADS / MKL_NUM_THREADS, when set, win over auto "
            "(dapo_lightning/threads.py).",
        )
        parser.add_argument(
            "--seed_per_array_task",
            type=bool,
            default=False,
            help="In a SLURM job array (sbatch --array): seed_everything = SLURM_ARRAY_TASK_ID and "
            "the run directory trainer.default_root_dir/seed_<id> (slurm/dapo.sbatch sets it).",
        )
        parser.link_arguments(
            "model.init_args.model_name_or_path", "data.init_args.model_name_or_path"
        )
        allow_auto_precision(parser)

    def _parse_ckpt_path(self) -> None:
        """Nothing: on a resume the config applies (LightningCLI would overwrite the model's
        arguments with the checkpoint's; the RunGuard prints what differs instead)."""

    def _set_seed(self) -> None:
        """As LightningCLI does, after ``--seed_per_array_task`` set the seed and run directory
        of this job array task (:func:`~dapo_lightning.slurm.array_task_run`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        task = array_task_run(config.trainer.get("default_root_dir"))
        if config.get("seed_per_array_task") and task is not None:
            config.seed_everything, config.trainer.default_root_dir = task
        super()._set_seed()

    def before_instantiate_classes(self) -> None:  # noqa: D102
        config = self.config[self.subcommand] if self.subcommand else self.config
        resolve_run_paths(config)
        trainer = config.get("trainer")
        if isinstance(trainer, Namespace):  # under srun: one task per rank
            check_task_count(trainer.get("devices"), trainer.get("num_nodes"))
        if isinstance(trainer, Namespace):  # precision: auto -> bf16-mixed | 32-true
            trainer.precision = resolve_trainer_precision(
                trainer.get("precision"), trainer.get("accelerator", "auto")
            )
        if self.subcommand == "validate":
            separate_validate_logs(config)
        fill_data_seed(config)
        if self.subcommand == "fit":  # before a model is written or loaded
            check_run_dirs_writable(*run_dirs(config))
        self._model_to_create = model_to_create(config)
        choose_run_threads(config, self._model_to_create)

    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does, then write the first-use model (the classes check
        their arguments first: a bad setting fails at once, not after a warm-up). An argument
        error of one of the classes is raised as a :class:`ConfigError` with the class's own
        message (not jsonargparse's union dump)."""
        try:
            super().instantiate_classes()
        except ValueError as error:
            refused = class_error(error)
            if refused is None:
                raise
            raise refused from error.__cause__
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self._model_to_create is not None:
            write_model(config, *self._model_to_create)
        if self.subcommand in self.subcommands():  # not for run=False (parser checks)
            check_model_source(config.model.init_args.get("model_name_or_path"))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The configured Trainer, with a :class:`~dapo_lightning.callbacks.RunGuard` first
        among its callbacks when the config lists none (first: it takes the run directory's lock
        before the other callbacks write into it) and Lightning's own model summary replaced by
        :class:`~dapo_lightning.callbacks.DAPOModelSummary` (no FLOPs, never counted here). Lightning's own configuration errors
        (``MisconfigurationException``) become one :class:`ConfigError` line."""
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except MisconfigurationException as error:
            raise ConfigError(f"trainer: {error}{trainer_fix(str(error))}") from None
        if not any(isinstance(c, RunGuard) for c in trainer.callbacks):
            trainer.callbacks.insert(0, RunGuard())
        replace_default_summary(trainer)  # no "Total FLOPs: 0" (DAPOModelSummary)
        return trainer

    def _resolve_ckpt_path(self, ckpt_path: Any) -> Any:
        if ckpt_path != AUTO_CKPT:
            check_ckpt_path(ckpt_path)  # missing, a plain folder, cut short: one error line
            return ckpt_path
        resolved = resolve_auto_checkpoint(self.trainer)  # says which file it took, and why
        if self.trainer.is_global_zero and resolved is None:
            print("--ckpt_path auto: no checkpoint yet, starting fresh", file=sys.stderr)
        return resolved

    def fit(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``trainer.fit`` with ``ckpt_path="auto"`` resolved first, the batch sizes checked
        against the ranks before any rank is started. A SIGTERM / SIGINT before the
        :class:`~dapo_lightning.callbacks.RunGuard` guards the fit (the data's set-up, the
        engine's start) is one line and exit 143 / 130, not a silent end."""

        def outcome() -> str:
            done = self.trainer.global_step
            return f"the fit had ended at update {done}" if done else NOTHING_SAVED

        with exit_at_once_on_stop_signals(outcome):
            check_world_split(self.trainer, datamodule)
            ckpt_path = self._resolve_ckpt_path(ckpt_path)
            check_resume_ranks(self.trainer, datamodule, ckpt_path)  # before any rank starts
            self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)
        raise_if_collapsed(self.trainer)  # a collapse detector's stop: one line, exit 1

    def validate(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """``trainer.validate`` with ``ckpt_path="auto"`` resolved first, at the checkpoint's
        update (:func:`continue_update_count`). ``auto`` with no checkpoint to take is one
        error line (a validation of the base model would pass for the run's)."""
        if ckpt_path == AUTO_CKPT:
            resolved = resolve_auto_checkpoint(self.trainer)
            if resolved is None:
                raise ConfigError(
                    "validate --ckpt_path auto: no checkpoint found for the run in "
                    f"trainer.default_root_dir={self.trainer.default_root_dir}. Fix: give the "
                    "fit's run directory (--trainer.default_root_dir) or a checkpoint file "
                    "(--ckpt_path FILE), or leave out --ckpt_path to validate the model of "
                    "model.model_name_or_path."
                )
        else:
            resolved = self._resolve_ckpt_path(ckpt_path)
        if resolved is not None:
            continue_update_count(self.trainer, resolved)
        return self.trainer.validate(model, datamodule=datamodule, ckpt_path=resolved, **kwargs)


def build_cli(args: list[str] | None = None, *, run: bool = True) -> DAPOLightningCLI:
    """The project's LightningCLI: DAPOModule / DAPODataModule in subclass mode, manual
    optimization (no auto-configured optimizers), the saved config overwritten on a requeue.
    ``run=False`` only parses and instantiates (tests use it to check the parser)."""
    descriptions = {
        "fit": "Train: DAPO updates on rollouts generated by the data module.",
        "validate": "Score the policy on the held-out prompts (val/acc, pass@k).",
    }
    return DAPOLightningCLI(
        DAPOModule,
        DAPODataModule,
        parser_class=StrictArgumentParser,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            name: {
                "description": SUBCOMMAND_HELP.format(what=what),
                "usage": f"dapo-lightning {name} [--config FILE ...] [--print_config] [OPTIONS]",
            }
            for name, what in descriptions.items()
        }
        | {"formatter_class": DAPOHelpFormatter},  # the main parser's: subcommands inherit it
        run=run,
        args=args,
    )
