"""The ``dapo-lightning`` command: LightningCLI for ``fit`` / ``validate``, plus ``plot``.

Examples::

    dapo-lightning fit --config configs/quickstart.yaml
    dapo-lightning fit --config configs/quickstart.yaml --trainer.max_steps 20 --print_config
    dapo-lightning fit --config configs/quickstart.yaml --ckpt_path auto   # resume if possible
    dapo-lightning validate --config configs/quickstart.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt
    dapo-lightning plot runs/quickstart            # writes runs/quickstart/metrics.png

Several ``--config`` files apply in order, later ones overriding earlier ones (lists such as
``trainer.callbacks`` are replaced whole), e.g.
``--config configs/quickstart.yaml --config configs/grpo_baseline.yaml``.

``--ckpt_path auto`` (``fit`` and ``validate``) resumes from the newest of the ``last*.ckpt`` files
of the run's ``ModelCheckpoint`` callbacks and the ``hpc_ckpt_*.ckpt`` that Lightning's SLURM
auto-requeue writes into ``trainer.default_root_dir``; with neither it starts fresh. The same
command line is therefore right for the first start and for every requeue (see ``slurm/``).

Arguments that must agree between the model and the data are linked, not repeated:
``model.model_name_or_path`` -> ``data.model_name_or_path``, ``data.max_response_length`` ->
``model.max_response_length`` and ``data.temperature`` -> ``model.temperature``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.module import DAPOModule

#: ``--ckpt_path`` value that picks the newest resumable checkpoint (see :func:`resolve_auto_checkpoint`).
AUTO_CKPT = "auto"


def resolve_auto_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint to resume ``trainer`` from, or None to start fresh.

    Candidates: every ``last*.ckpt`` in the ``dirpath`` of the trainer's ``ModelCheckpoint``
    callbacks, and every ``hpc_ckpt_<n>.ckpt`` in ``trainer.default_root_dir`` (written by
    Lightning's SLURM auto-requeue on the requeue signal). The one modified last wins, so a
    requeue never resumes from an older state than the newest one saved. Directories count too
    (sharded FSDP / DeepSpeed checkpoints are folders named ``*.ckpt``).
    """
    candidates: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    root = Path(trainer.default_root_dir)
    if root.is_dir():
        candidates |= {
            str(p) for p in root.iterdir() if re.fullmatch(r"hpc_ckpt_\d+\.ckpt", p.name)
        }
    existing = [p for p in candidates if os.path.exists(p)]
    if not existing:
        return None
    return max(existing, key=os.path.getmtime)


class DAPOLightningCLI(LightningCLI):
    """LightningCLI with DAPO's argument links, on-first-use model creation and ``--ckpt_path auto``.

    ``--create_model_if_missing tiny-arithmetic`` writes the quickstart's tiny checkpoint to
    ``model.model_name_or_path`` when that folder does not exist yet (nothing is downloaded).
    ``--ckpt_path auto`` resumes from :func:`resolve_auto_checkpoint` (or starts fresh).
    """

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        parser.add_argument(
            "--create_model_if_missing",
            type=Literal["tiny", "tiny-arithmetic"] | None,
            default=None,
            help="Write a tiny checkpoint at model.model_name_or_path if the folder is missing: "
            "'tiny' (random weights) or 'tiny-arithmetic' (the quickstart's format-warmed model).",
        )
        parser.link_arguments(
            "model.init_args.model_name_or_path", "data.init_args.model_name_or_path"
        )
        parser.link_arguments(
            "data.init_args.max_response_length", "model.init_args.max_response_length"
        )
        parser.link_arguments("data.init_args.temperature", "model.init_args.temperature")

    def before_instantiate_classes(self) -> None:  # noqa: D102
        config = self.config[self.subcommand] if self.subcommand else self.config
        kind = config.get("create_model_if_missing")
        path = config.model.init_args.get("model_name_or_path")
        if kind and path and not Path(path).exists():
            from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
            from dapo_lightning.testing import make_tiny_checkpoint

            seed = config.get("seed_everything")
            # not `seed in (None, True, False)`: 1 == True would map seed 1 to 0
            seed = 0 if seed is None or isinstance(seed, bool) else int(seed)
            if kind == "tiny":
                make_tiny_checkpoint(path, seed=seed)
            else:
                # Warm up on the same problems the data module will serve.
                data = config.get("data", {}).get("init_args", {}) or {}
                task_kwargs = dict(data.get("task_kwargs") or {})
                task_kwargs.setdefault("task_seed", task_kwargs.pop("seed", data.get("seed", 0)))
                if data.get("apply_chat_template") is not None:
                    task_kwargs["apply_chat_template"] = bool(data.get("apply_chat_template"))
                make_quickstart_checkpoint(path, seed=seed, **task_kwargs)

    def _resolve_ckpt_path(self, ckpt_path: Any) -> Any:
        if ckpt_path != AUTO_CKPT:
            return ckpt_path
        resolved = resolve_auto_checkpoint(self.trainer)
        if self.trainer.is_global_zero:
            print(
                f"--ckpt_path auto: {'resuming from ' + resolved if resolved else 'no checkpoint yet, starting fresh'}",
                file=sys.stderr,
            )
        return resolved

    def fit(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``trainer.fit`` with ``ckpt_path="auto"`` resolved first."""
        self.trainer.fit(
            model, datamodule=datamodule, ckpt_path=self._resolve_ckpt_path(ckpt_path), **kwargs
        )

    def validate(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """``trainer.validate`` with ``ckpt_path="auto"`` resolved first."""
        return self.trainer.validate(
            model, datamodule=datamodule, ckpt_path=self._resolve_ckpt_path(ckpt_path), **kwargs
        )


def build_cli(args: list[str] | None = None, *, run: bool = True) -> DAPOLightningCLI:
    """The project's LightningCLI: DAPOModule / DAPODataModule in subclass mode, manual
    optimization (no auto-configured optimizers), the saved config overwritten on a requeue.
    ``run=False`` only parses and instantiates (tests use it to check the parser)."""
    return DAPOLightningCLI(
        DAPOModule,
        DAPODataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        run=run,
        args=args,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dapo-lightning`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "plot":
        from dapo_lightning.plot import plot_main

        plot_main(argv[1:])
        return
    if argv and argv[0] == "export":
        from dapo_lightning.export import export_main

        export_main(argv[1:])
        return
    if argv and argv[0] == "make-model":
        from dapo_lightning.models import make_model_main

        make_model_main(argv[1:])
        return
    build_cli(args)


if __name__ == "__main__":
    main()
