"""The ``dapo-lightning`` command: LightningCLI for ``fit`` / ``validate``, plus ``plot``,
``inspect``, ``export``, ``make-model`` and ``sft``.

Examples::

    dapo-lightning fit --config configs/quickstart.yaml
    dapo-lightning fit --config configs/quickstart.yaml --trainer.default_root_dir runs/try2
    dapo-lightning fit --config configs/quickstart.yaml --ckpt_path auto   # resume if possible
    dapo-lightning validate --config configs/quickstart.yaml --ckpt_path auto
    dapo-lightning plot runs/quickstart            # writes runs/quickstart/metrics.png
    dapo-lightning inspect runs/quickstart         # writes runs/quickstart/samples.html

Several ``--config`` files apply in order, later ones overriding earlier ones (lists such as
``trainer.callbacks`` are replaced whole), e.g.
``--config configs/quickstart.yaml --config configs/grpo_baseline.yaml``.

**The run directory** is ``trainer.default_root_dir``. A *relative* ``save_dir`` of a logger,
``dirpath`` of a callback (``ModelCheckpoint``) and ``create_model_if_missing.path`` are taken
relative to it (a relative path that already starts with it is left as it is), so
``--trainer.default_root_dir X`` moves logs, checkpoints and the quickstart's model under ``X``.
Absolute paths stay where they are.

**Resuming**: ``--ckpt_path auto`` (``fit`` and ``validate``) resumes from the checkpoint with
the highest update (read from each file, never taken from its modification time) that loads,
among the ``last*.ckpt`` of the run's ``ModelCheckpoint`` (``last-previous.ckpt`` included) and
the ``hpc_ckpt_*.ckpt`` of Lightning's SLURM requeue, and says which file it took and why (a
file written after it at a lower update, a fresh run's beside a stale run's, is named with how
to resume it instead); with none it starts fresh. The same
command line is therefore right for the first start and for every requeue (see ``slurm/``),
and for a run directory that was copied or moved (it goes on writing ``last.ckpt``). A
``--ckpt_path`` that names a file is checked first: a missing, unloadable or plain folder is
one error line. On a resume the config applies, never the checkpoint's hyper-parameters: the
:class:`~dapo_lightning.callbacks.RunGuard` that every fit gets prints each value that differs
(learning rate included); the weights are the checkpoint's, also when
``model.model_name_or_path`` changed (it then gives the architecture and tokenizer only).

**validate** runs at the checkpoint's update (its fit-loop counters are restored: "validation
at update 170", logged at step 169) and logs into ``<logger name>-validate`` (e.g.
``runs/quickstart/logs-validate/``), so ``plot`` never mixes it into the fit's curves.

**Threads**: ``--threads auto`` (the default) or a count; see :mod:`dapo_lightning.threads`.
One line on stderr says the choice.

**Options are spelled out**: a prefix of an option (``--trainer.max_ste``) is refused, never
taken for the option it begins (:class:`StrictArgumentParser`).

**Where it lives**: :mod:`~dapo_lightning.cli.app` (the LightningCLI subclass),
:mod:`~dapo_lightning.cli.parser` (options), :mod:`~dapo_lightning.cli.run_setup` (run paths,
threads, checks before the ranks start, resuming), :mod:`~dapo_lightning.cli.model_source`
(the first-use model, the model path check), :mod:`~dapo_lightning.cli.errors` (the error
contract), :mod:`~dapo_lightning.cli.sft_command` (``sft``'s options, in ``fit``'s style);
``plot``, ``export``, ``make-model`` and ``sft`` are :mod:`dapo_lightning.plot`,
:mod:`dapo_lightning.export`, :mod:`dapo_lightning.models` and :mod:`dapo_lightning.sft`.

**Exit status**: 0 when the fit finished; 143 / 130 when SIGTERM / SIGINT stopped it (after
saving); 2 for a bad configuration (one ``error:`` line, no traceback), found before training
starts where it can be: a ``--config`` file that is no YAML mapping of settings (binary,
empty, tab-indented, a key given twice: :mod:`~dapo_lightning.cli.config_files`), a value of
the wrong type, an unwritable run directory or checkpoint folder, a model path that cannot be
loaded, batch sizes that do not split over the ranks; 1 otherwise.

**Precision**: ``trainer.precision: auto`` becomes ``bf16-mixed`` where the device computes
bf16 natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX) and ``32-true`` elsewhere, before
the Trainer is built, with one line saying which and why (:mod:`dapo_lightning.precision`; the
vLLM engine's ``dtype: auto`` decides the same way).

The model path is given once and linked: ``model.model_name_or_path`` ->
``data.model_name_or_path``. The sampling temperature and maximum response length are the
data's (``data.sampling``); every batch carries them to the module. The data's ``seed``, when
null, is the run's ``seed_everything``.
"""

from __future__ import annotations

import difflib
import sys

from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.app import DAPOLightningCLI, build_cli
from dapo_lightning.cli.config_files import check_config_files
from dapo_lightning.cli.errors import run_reporting_errors
from dapo_lightning.cli.model_source import CreateModel
from dapo_lightning.cli.parser import StrictArgumentParser, nested_nulls
from dapo_lightning.cli.run_setup import AUTO_CKPT, VALIDATE_LOG_SUFFIX, run_path
from dapo_lightning.cli.sft_command import sft_main
from dapo_lightning.export import export_main
from dapo_lightning.interrupt import NOTHING_SAVED, exit_at_once_on_stop_signals, exit_on_stop
from dapo_lightning.logging_setup import quiet_known_warnings
from dapo_lightning.models import make_model_main
from dapo_lightning.plot import plot_main
from dapo_lightning.sample_page import inspect_main

__all__ = [
    "AUTO_CKPT",
    "VALIDATE_LOG_SUFFIX",
    "ConfigError",
    "CreateModel",
    "DAPOLightningCLI",
    "StrictArgumentParser",
    "build_cli",
    "main",
    "run_path",
    "top_level_help",
]

#: Subcommands outside LightningCLI: name -> one line of help (dispatched in :func:`main`).
OTHER_COMMANDS = {
    "plot": "draw a run's metrics.csv into RUN_DIR/metrics.png",
    "inspect": "write a run's samples (SampleLog) as one HTML page, RUN_DIR/samples.html",
    "export": "write a checkpoint's policy as a Hugging Face model folder",
    "make-model": "write a real model folder from a file an installed package ships",
    "sft": "supervised warm-up on an environment's demonstrations (agent RL's cold start)",
}


#: Every subcommand: name -> one line of help (LightningCLI's, then :data:`OTHER_COMMANDS`).
COMMANDS = {
    "fit": "train (dapo-lightning fit --help)",
    "validate": "score a checkpoint on the held-out prompts",
    **OTHER_COMMANDS,
}


def top_level_help() -> str:
    """What ``dapo-lightning --help`` prints."""
    lines = [f"  {name:<12}{text}" for name, text in COMMANDS.items()]
    return "\n".join(
        [
            f"usage: dapo-lightning {{{','.join(COMMANDS)}}} ...",
            "",
            "DAPO reinforcement learning for LLMs, on PyTorch Lightning.",
            "",
            "subcommands:",
            *lines,
            "",
            "example: dapo-lightning fit --config configs/quickstart.yaml",
        ]
    )


def _run_lightning(args: list[str] | None) -> None:
    """``fit`` / ``validate``, with the exit status of the module docstring."""

    if args is None:  # the console script: LightningCLI reads sys.argv (an args list warns)
        sys.argv[1:] = nested_nulls(sys.argv[1:])
    else:
        args = nested_nulls(list(args))

    def command() -> None:  # a stop before (or after) a fit guards its run: one line, 143 / 130
        check_config_files(sys.argv[1:] if args is None else args)  # one line per bad file
        with exit_on_stop(), exit_at_once_on_stop_signals(NOTHING_SAVED):
            build_cli(args)

    run_reporting_errors(command)


def _sft_main(argv: list[str]) -> None:
    """``dapo-lightning sft`` (:mod:`dapo_lightning.cli.sft_command`), with the error contract
    of ``fit``."""
    run_reporting_errors(lambda: sft_main(argv))


def unknown_command_message(name: str) -> str:
    """The error line for a subcommand that does not exist: every subcommand, the closest."""
    match = difflib.get_close_matches(name, list(COMMANDS), n=1)
    hint = f" Did you mean {match[0]}?" if match else ""
    return (
        f"unknown subcommand {name!r}.{hint} The subcommands: {', '.join(COMMANDS)} "
        "(dapo-lightning --help says what each does)."
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dapo-lightning`` console script."""
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        print(top_level_help())
        return
    # Before Lightning and vLLM print them, and before export / make-model load a model
    # (transformers imports deepspeed, which logs its CPU-accelerator line): logging_setup.py.
    quiet_known_warnings()
    other = {
        "plot": plot_main,
        "inspect": inspect_main,
        "export": export_main,
        "make-model": make_model_main,
        "sft": _sft_main,
    }
    if argv[0] in other:  # the commands of OTHER_COMMANDS
        other[argv[0]](argv[1:])
        return
    if not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"dapo-lightning: error: {unknown_command_message(argv[0])}", file=sys.stderr)
        sys.exit(2)
    _run_lightning(args)
