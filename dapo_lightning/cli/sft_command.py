"""``dapo-lightning sft``: the cold start's command line (:mod:`dapo_lightning.sft` does the
work), in ``fit``'s style: ``--config`` files applied in order, options spelled out in full
(:class:`~dapo_lightning.cli.parser.StrictArgumentParser`), ``--print_config``, and a bad
setting said in one line naming it (an unknown key with the closest valid one, a non-finite
number, a value a class refuses), printed as ``dapo-lightning: error: ...`` with exit status 2
(:func:`~dapo_lightning.cli.errors.run_reporting_errors`).
"""

from __future__ import annotations

import sys
from argparse import ArgumentError
from collections.abc import Callable, Sequence
from pathlib import Path

from jsonargparse import ActionConfigFile

from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.config_files import check_config_files
from dapo_lightning.cli.errors import class_error
from dapo_lightning.cli.parser import (
    DAPOHelpFormatter,
    StrictArgumentParser,
    bad_key_message,
    known_keys,
    nonfinite_message,
)
from dapo_lightning.data.prompts.config import PromptConfig
from dapo_lightning.sft import SFTConfig, run_sft

#: ``dapo-lightning sft``'s usage line (the form of ``fit``'s).
SFT_USAGE = "dapo-lightning sft [--config FILE ...] [--print_config] [OPTIONS]"


def sft_parser() -> StrictArgumentParser:
    """The parser of ``dapo-lightning sft``: :class:`~dapo_lightning.sft.SFTConfig`'s fields
    as options (its
    ``prompts`` a :class:`~dapo_lightning.data.prompts.config.PromptConfig` group), ``--config`` files,
    ``--print_config``; options spelled out in full, as ``fit``'s
    (:class:`~dapo_lightning.cli.parser.StrictArgumentParser`). Errors are raised, not printed
    (:func:`parse_sft_config` makes each one line)."""
    parser = StrictArgumentParser(
        exit_on_error=False,
        prog="dapo-lightning sft",
        usage=SFT_USAGE,
        description="Supervised warm-up on the demonstrations an environment writes (the cold "
        "start of agent RL); writes a model folder fit can load.",
        formatter_class=DAPOHelpFormatter,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="an sft YAML file")
    parser.add_class_arguments(SFTConfig, as_group=False, skip={"prompts"})
    parser.add_class_arguments(PromptConfig, "prompts")
    return parser


def parse_sft_config(argv: Sequence[str]) -> SFTConfig:
    """The :class:`~dapo_lightning.sft.SFTConfig` of ``dapo-lightning sft``'s arguments.

    Raises:
        ConfigError: one line naming the setting, as ``fit`` says it: an unknown key (the
            closest valid one suggested), a non-finite number, a value a class refuses.
    """
    check_config_files(argv)  # a binary, empty or tab-indented file, a key given twice
    parser = sft_parser()
    try:
        args = parser.parse_args(list(argv))
    except ArgumentError as err:
        message = str(err)
        short = nonfinite_message(message) or bad_key_message(
            message, lambda class_path: known_keys(parser, class_path)
        )
        raise ConfigError(short or " ".join(message.split())) from None
    try:
        init = parser.instantiate_classes(args)
    except ValueError as err:  # a dataclass's own check (ConfigError included)
        refused = class_error(err)
        raise (refused or ConfigError(" ".join(str(err).split()))) from None
    values = {k: v for k, v in vars(init).items() if k not in ("config", "__path__")}
    return SFTConfig(**values)


def sft_main(
    argv: Sequence[str] | None = None, *, run: Callable[[SFTConfig], Path] = run_sft
) -> Path:
    """``dapo-lightning sft --config SFT.yaml [--key value ...]``
    (:class:`~dapo_lightning.sft.SFTConfig`, :func:`parse_sft_config`): ``run`` on the parsed config (``argv`` None: ``sys.argv[1:]``)."""
    return run(parse_sft_config(sys.argv[1:] if argv is None else argv))


__all__ = ["SFT_USAGE", "parse_sft_config", "sft_main", "sft_parser"]
