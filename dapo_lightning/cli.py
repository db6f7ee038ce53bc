"""The ``dapo-lightning`` command: LightningCLI for ``fit`` / ``validate``, plus ``plot``.

Examples::

    dapo-lightning fit --config configs/quickstart.yaml
    dapo-lightning fit --config configs/quickstart.yaml --trainer.max_steps 20 --print_config
    dapo-lightning plot runs/quickstart            # writes runs/quickstart/metrics.png

Arguments that must agree between the model and the data are linked, not repeated:
``model.model_name_or_path`` -> ``data.model_name_or_path``, ``data.max_response_length`` ->
``model.max_response_length`` and ``data.temperature`` -> ``model.temperature``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from lightning.pytorch.cli import LightningCLI

from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.module import DAPOModule


class DAPOLightningCLI(LightningCLI):
    """LightningCLI with DAPO's argument links and on-first-use model creation.

    ``--create_model_if_missing tiny-arithmetic`` writes the quickstart's tiny checkpoint to
    ``model.model_name_or_path`` when that folder does not exist yet (nothing is downloaded).
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
            from dapo_lightning.testing import make_quickstart_checkpoint, make_tiny_checkpoint

            seed = config.get("seed_everything")
            seed = 0 if seed in (None, True, False) else int(seed)
            if kind == "tiny":
                make_tiny_checkpoint(path, seed=seed)
            else:
                make_quickstart_checkpoint(path, seed=seed)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dapo-lightning`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "plot":
        from dapo_lightning.plot import plot_main

        plot_main(argv[1:])
        return
    DAPOLightningCLI(
        DAPOModule,
        DAPODataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
