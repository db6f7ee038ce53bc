"""The ``dapo-lightning`` command: LightningCLI for ``fit`` / ``validate``, plus ``plot``,
``export`` and ``make-model``.

Examples::

    dapo-lightning fit --config configs/quickstart.yaml
    dapo-lightning fit --config configs/quickstart.yaml --trainer.default_root_dir runs/try2
    dapo-lightning fit --config configs/quickstart.yaml --ckpt_path auto   # resume if possible
    dapo-lightning validate --config configs/quickstart.yaml --ckpt_path auto
    dapo-lightning plot runs/quickstart            # writes runs/quickstart/metrics.png

Several ``--config`` files apply in order, later ones overriding earlier ones (lists such as
``trainer.callbacks`` are replaced whole), e.g.
``--config configs/quickstart.yaml --config configs/grpo_baseline.yaml``.

**The run directory** is ``trainer.default_root_dir``. A *relative* ``save_dir`` of a logger,
``dirpath`` of a callback (``ModelCheckpoint``) and ``create_model_if_missing.path`` are taken
relative to it (a relative path that already starts with it is left as it is), so
``--trainer.default_root_dir X`` moves logs, checkpoints and the quickstart's model under ``X``.
Absolute paths stay where they are.

**Resuming**: ``--ckpt_path auto`` (``fit`` and ``validate``) resumes from the newest checkpoint
that loads among the ``last*.ckpt`` of the run's ``ModelCheckpoint`` (``last-previous.ckpt``
included) and the ``hpc_ckpt_*.ckpt`` of Lightning's SLURM requeue; with none it starts fresh.
The same command line is therefore right for the first start and for every requeue (see
``slurm/``). On a resume the config applies, never the checkpoint's hyper-parameters: the
:class:`~dapo_lightning.callbacks.RunGuard` that every fit gets prints each value that differs
(learning rate included).

**validate** runs at the checkpoint's update (its fit-loop counters are restored: "validation
at update 170", logged at step 169) and logs into ``<logger name>-validate`` (e.g.
``runs/quickstart/logs-validate/``), so ``plot`` never mixes it into the fit's curves.

**Threads**: ``--threads auto`` (the default) or a count; see :mod:`dapo_lightning.threads`.
One line on stderr says the choice.

**Options are spelled out**: a prefix of an option (``--trainer.max_ste``) is refused, never
taken for the option it begins (:class:`StrictArgumentParser`).

**Exit status**: 0 when the fit finished; 143 / 130 when SIGTERM / SIGINT stopped it (after
saving); 2 for a bad configuration (one ``error:`` line, no traceback); 1 otherwise.

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

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from dapo_lightning import plot
from dapo_lightning.callbacks import RunGuard
from dapo_lightning.callbacks.summary import replace_default_summary
from dapo_lightning.checkpoint import (
    CheckpointDiskFullError,
    NonFiniteCheckpointError,
    check_ckpt_path,
    find_resume_checkpoint,
)
from dapo_lightning.checks import ConfigError
from dapo_lightning.data.datamodule import DAPODataModule
from dapo_lightning.export import atomic_folder, export_main
from dapo_lightning.interrupt import STOP_SIGNALS, exit_on_stop
from dapo_lightning.logging_setup import quiet_known_warnings
from dapo_lightning.models import make_model_main
from dapo_lightning.module import DAPOModule
from dapo_lightning.plot import plot_main
from dapo_lightning.precision import resolve_trainer_precision
from dapo_lightning.run_lock import RunDirLockedError, check_run_dirs_writable
from dapo_lightning.step_guard import NonFiniteUpdatesError
from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
from dapo_lightning.testing import make_tiny_checkpoint, tiny_num_parameters
from dapo_lightning.threads import configure_threads

#: ``--ckpt_path`` value that picks the newest loadable checkpoint (see :func:`resolve_auto_checkpoint`).
AUTO_CKPT = "auto"

#: Subcommands outside LightningCLI: name -> one line of help (dispatched in :func:`main`).
OTHER_COMMANDS = {
    "plot": "draw a run's metrics.csv into RUN_DIR/metrics.png",
    "export": "write a checkpoint's policy as a Hugging Face model folder",
    "make-model": "write a real model folder from a file an installed package ships",
}

#: The top of ``fit --help`` / ``validate --help``: where the DAPO options are.
SUBCOMMAND_HELP = """{what}

DAPO options (the Trainer's follow below):
  --model.help DAPOModule          the policy update: clip ratios, loss aggregation, optimizer
  --data.help DAPODataModule       prompts, rewards, rollout engine, group size, dynamic sampling
  --create_model_if_missing ...    write the quickstart's tiny model on first use
  --ckpt_path auto                 resume from the run's newest loadable checkpoint
  --print_config                   the whole resolved config, as YAML
"""


class _HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description's own line breaks kept."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class StrictArgumentParser(LightningArgumentParser):
    """A parser that refuses abbreviated options (``allow_abbrev=False``): argparse would take
    ``--model.init_args.loss.clip_ratio_hi 0.3`` for ``clip_ratio_high`` without a word, so a
    typo could set another option. jsonargparse builds the parsers of subcommands and of
    subclass arguments (``--model.init_args.*``) with the class of their parent, so one class
    covers all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """jsonargparse's error, with a non-finite number said in one line
        (:func:`nonfinite_message`; by the parser that prints it, not by the nested parsers
        whose messages it quotes)."""
        shorter = nonfinite_message(message) if self.exit_on_error else None
        super().error(shorter or message, ex)


_NONFINITE = r"[+-]?(?:nan|inf|infinity)"
#: The innermost line of a type error naming the value, when it is a NaN / infinity spelled
#: plainly (``nan``: YAML reads it as a string; ``.nan`` reaches the class's own check).
_NONFINITE_VALUE = re.compile(rf"^( *).*\b(?:Given|Got) value: ({_NONFINITE})\s*$", re.I | re.M)
#: The outer line of a nested one: ``Given value: NestedArg(key='loss.eps', val='nan')``.
_NONFINITE_NESTED = re.compile(rf"NestedArg\(key='([^']+)', val='({_NONFINITE})'\)", re.I)
_PARSER_KEY = re.compile(r'^( *)(?:- )?Parser key "([^"]+)"')


def nonfinite_message(message: str) -> str | None:
    """``model.gradient_clip_val=nan is not finite...`` for jsonargparse's 12-17-line union dump
    of a plain ``nan`` / ``inf`` given for a number; None for any other message. The field is
    the chain of ``Parser key`` lines the value line is nested in (by indentation)."""
    found = _NONFINITE_VALUE.search(message)
    if found is not None:
        depth, keys = len(found.group(1)), []
        for line in reversed(message[: found.start()].splitlines()):
            key = _PARSER_KEY.match(line)
            if key is not None and len(key.group(1)) < depth:
                depth = len(key.group(1))
                keys.insert(0, key.group(2))
        field, value = ".".join(keys), found.group(2)
    elif (nested := _NONFINITE_NESTED.search(message)) is not None:
        outer = _PARSER_KEY.match(message)
        field = ".".join([outer.group(2), nested.group(1)] if outer else [nested.group(1)])
        value = nested.group(2)
    else:
        return None
    return f"{field or 'a setting'}={value} is not finite. Give a finite number."


@dataclass
class CreateModel:
    """``create_model_if_missing``: write a tiny model folder when it does not exist yet.

    Args:
        kind: ``tiny`` (random weights) or ``tiny-arithmetic`` (the quickstart's warmed-up model).
        path: The folder; relative: under ``trainer.default_root_dir``. When
            ``model.model_name_or_path`` is unset or this same string, it becomes this folder;
            when it names anything else, nothing is written. None: ``model.model_name_or_path``
            itself (it must be a local-looking path, never a hub id).
    """

    kind: Literal["tiny", "tiny-arithmetic"]
    path: str | None = None


def resolve_auto_checkpoint(trainer: Trainer) -> str | None:
    """The checkpoint ``--ckpt_path auto`` resumes ``trainer`` from, or None to start fresh:
    :func:`~dapo_lightning.checkpoint.find_resume_checkpoint`, reporting skipped files."""

    def report(line: str) -> None:
        if trainer.is_global_zero:
            print(f"--ckpt_path auto: {line}", file=sys.stderr)

    return find_resume_checkpoint(trainer, report)


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
        parser.link_arguments(
            "model.init_args.model_name_or_path", "data.init_args.model_name_or_path"
        )
        allow_auto_precision(parser)

    def _parse_ckpt_path(self) -> None:
        """Nothing: on a resume the config applies (LightningCLI would overwrite the model's
        arguments with the checkpoint's; the RunGuard prints what differs instead)."""

    def before_instantiate_classes(self) -> None:  # noqa: D102
        config = self.config[self.subcommand] if self.subcommand else self.config
        resolve_run_paths(config)
        trainer = config.get("trainer")
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
            original, owner = _root_cause(error)
            if original is error:
                raise
            text = str(original)  # "Class.field ..." names its owner already
            raise ConfigError(
                text if text.startswith(f"{owner}.") else f"{owner}: {text}"
            ) from original
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
            raise ConfigError(f"trainer: {error}{_trainer_fix(str(error))}") from None
        if not any(isinstance(c, RunGuard) for c in trainer.callbacks):
            trainer.callbacks.insert(0, RunGuard())
        replace_default_summary(trainer)  # no "Total FLOPs: 0" (DAPOModelSummary)
        return trainer

    def _resolve_ckpt_path(self, ckpt_path: Any) -> Any:
        if ckpt_path != AUTO_CKPT:
            check_ckpt_path(ckpt_path)  # missing, a plain folder, cut short: one error line
            return ckpt_path
        resolved = resolve_auto_checkpoint(self.trainer)
        if self.trainer.is_global_zero:
            found = f"resuming from {resolved}" if resolved else "no checkpoint yet, starting fresh"
            print(f"--ckpt_path auto: {found}", file=sys.stderr)
        return resolved

    def fit(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``trainer.fit`` with ``ckpt_path="auto"`` resolved first, the batch sizes checked
        against the ranks before any rank is started."""
        check_world_split(self.trainer, datamodule)
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
        """``trainer.validate`` with ``ckpt_path="auto"`` resolved first, at the checkpoint's
        update (:func:`continue_update_count`)."""
        resolved = self._resolve_ckpt_path(ckpt_path)
        if resolved is not None:
            continue_update_count(self.trainer, resolved)
        return self.trainer.validate(model, datamodule=datamodule, ckpt_path=resolved, **kwargs)


# ----------------------------------------------------------------------------- config rewriting
def allow_auto_precision(parser: Any) -> None:
    """Let ``trainer.precision`` take ``"auto"`` (the Trainer's own type has no such value;
    :func:`~dapo_lightning.precision.resolve_trainer_precision` replaces it before the Trainer
    is built)."""
    for action in parser._actions:
        if action.dest == "trainer.precision" and hasattr(action, "_typehint"):
            action._typehint = Literal["auto"] | action._typehint


def run_path(root: str | None, value: str) -> str:
    """Where a configured path ``value`` points for the run directory ``root``
    (``trainer.default_root_dir``): relative paths are under it unless they already start with
    it; absolute paths and URLs are themselves (see the module docstring)."""
    if not root or "://" in value or os.path.isabs(value):
        return value
    norm_root, norm = os.path.normpath(root), os.path.normpath(value)
    if norm == norm_root or norm.startswith(norm_root + os.sep):
        return value  # already under it
    return os.path.normpath(os.path.join(root, value))


def _sections(value: Any) -> list[Namespace]:
    items = value if isinstance(value, list) else [value]
    return [
        v for v in items if isinstance(v, Namespace) and isinstance(v.get("init_args"), Namespace)
    ]


def resolve_run_paths(config: Namespace) -> None:
    """Put relative logger ``save_dir`` and callback ``dirpath`` under ``trainer.default_root_dir``."""
    trainer = config.get("trainer") or Namespace()
    root = trainer.get("default_root_dir")
    for key, sections in (
        ("save_dir", trainer.get("logger")),
        ("dirpath", trainer.get("callbacks")),
    ):
        for section in _sections(sections):
            value = section.init_args.get(key)
            if isinstance(value, str | os.PathLike):
                section.init_args[key] = run_path(root, os.fspath(value))


#: What ``validate`` appends to each logger's ``name``: its metrics go to a folder of their own
#: (``runs/quickstart/logs-validate/version_*``), never a new version of the fit's logs.
VALIDATE_LOG_SUFFIX = plot.VALIDATE_LOG_SUFFIX


def separate_validate_logs(config: Namespace) -> None:
    """``validate``: every logger's ``name`` gets :data:`VALIDATE_LOG_SUFFIX` (a logger without
    one: Lightning's default ``lightning_logs``), so a validation never adds a ``version_*`` to
    the fit's log folder, where ``plot`` would take it for a resume from step 0."""
    trainer = config.get("trainer") or Namespace()
    for section in _sections(trainer.get("logger")):
        name = section.init_args.get("name")
        name = "lightning_logs" if name is None else str(name)
        if name and not name.endswith(VALIDATE_LOG_SUFFIX):
            section.init_args["name"] = name + VALIDATE_LOG_SUFFIX


def continue_update_count(trainer: Trainer, ckpt_path: str | os.PathLike[str]) -> int:
    """Restore the fit loop's counters from ``ckpt_path`` (Lightning restores them for ``fit``
    only), so that a validation of an update-170 checkpoint says "validation at update 170" and
    logs at step 169, where the fit logged its validation after update 170 (ValidateAtStart's
    "updates done = step + 1"). Returns the update."""
    state = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    loops = state.get("loops", {}).get("fit_loop")
    if loops is not None:
        trainer.fit_loop.load_state_dict(loops)
    update = int(state.get("global_step", 0))
    trainer.fit_loop.epoch_loop._batches_that_stepped = update - 1  # the logging step
    return update


def fill_data_seed(config: Namespace) -> None:
    """``data.seed: null`` -> the run's ``seed_everything`` (an int once LightningCLI seeded)."""
    data = (config.get("data") or Namespace()).get("init_args")
    seed = config.get("seed_everything")
    if isinstance(data, Namespace) and "seed" in data and data.seed is None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            data.seed = seed


#: ``org/name`` as the hub spells model ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _refuse_hub_id(value: str) -> None:
    if _HUB_ID.fullmatch(value) and not Path(value).exists():
        raise ConfigError(
            f"create_model_if_missing: {value!r} looks like a Hugging Face hub id, not a folder "
            f"to write a tiny model into. To load that model, drop create_model_if_missing; to "
            f"write a tiny model into a local folder of that name, write './{value}'."
        )


def _model_target(config: Namespace, option: Any) -> Path | None:
    """Where ``create_model_if_missing`` writes (setting ``model_name_or_path`` to it when the
    config names the same folder), or None when the model path names another one."""
    model_args = config.model.init_args
    given = model_args.get("model_name_or_path")
    if isinstance(option, str) or option.path is None:
        if given is None:
            return None  # DAPOModule reports the missing model path
        _refuse_hub_id(str(given))
        return Path(given)
    _refuse_hub_id(option.path)
    target = run_path(config.trainer.get("default_root_dir"), option.path)
    if given not in (None, option.path, target):
        print(
            f"create_model_if_missing: nothing written, model.model_name_or_path is {given!r}, "
            f"not the folder it creates ({target!r}).",
            file=sys.stderr,
        )
        return None
    model_args.model_name_or_path = target
    data_args = (config.get("data") or Namespace()).get("init_args")
    if isinstance(data_args, Namespace):
        data_args.model_name_or_path = target
    return Path(target)


def model_to_create(config: Namespace) -> tuple[str, Path] | None:
    """``(kind, folder)`` when ``create_model_if_missing`` asks for a folder that does not exist
    yet (``model.model_name_or_path`` set to it), else None."""
    option = config.get("create_model_if_missing")
    if option is None:
        return None
    target = _model_target(config, option)
    if target is None or target.exists():
        return None
    return (option if isinstance(option, str) else option.kind), target


def write_model(config: Namespace, kind: str, target: Path) -> None:
    """Write the tiny ``kind`` model at ``target`` atomically (a temporary folder beside it,
    renamed when complete), one progress line per stage."""
    seed = config.get("seed_everything")
    # not `seed in (None, True, False)`: 1 == True would map seed 1 to 0
    seed = 0 if seed is None or isinstance(seed, bool) else int(seed)
    say = lambda line: print(f"create_model_if_missing: {line}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.monotonic()
    for stale in remove_stale_temp_folders(target):
        say(f"removed {stale}, left by an interrupted write")
    say(f"{target} does not exist: writing the {kind!r} model (seed {seed}; nothing is downloaded)")
    # SIGTERM / SIGINT: the temporary folder is removed, the next run writes the model again
    stopped = f"{target} was not written (the next run writes it)"
    with _stop_signals_exit(stopped), atomic_folder(target) as tmp:
        if kind == "tiny":
            make_tiny_checkpoint(tmp, seed=seed)
        else:
            say(f"warming it up on the task's problems in {tmp}")
            make_quickstart_checkpoint(tmp, seed=seed, report=say, **_warmup_task_kwargs(config))
    say(f"done in {time.monotonic() - t0:.1f} s: {target}")


def remove_stale_temp_folders(target: Path) -> list[Path]:
    """Delete the temporary folders an interrupted (killed) write of ``target`` left beside it
    (``.NAME.tmp-PID-*`` of :func:`~dapo_lightning.export.atomic_folder` whose process is gone);
    returns them."""
    removed = []
    for tmp in sorted(target.parent.glob(f".{target.name}.tmp-*")):
        pid = tmp.name.removeprefix(f".{target.name}.tmp-").split("-")[0]
        if tmp.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from before (this process writes a new one)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _stop_signals_exit(outcome: str) -> Iterator[None]:
    """SIGTERM / SIGINT raise ``SystemExit(128 + signum)`` inside (143 / 130, as a stopped fit
    exits), after one line saying ``outcome`` (what is left undone): SIGTERM's default would kill
    the process at once, leaving a half-written folder behind, and SIGINT's
    ``KeyboardInterrupt`` would print a traceback. The previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: a handler may interrupt a print to the same stream
        os.write(2, f"\n{name} received: stopped; {outcome}.\n".encode())
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, _exit) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_dirs(config: Namespace) -> tuple[str | None, list[str]]:
    """The run directory (``trainer.default_root_dir``) and the ``dirpath`` of each configured
    ``ModelCheckpoint``, as :func:`resolve_run_paths` left them."""
    trainer = config.get("trainer") or Namespace()
    folders = [
        str(section.init_args.dirpath)
        for section in _sections(trainer.get("callbacks"))
        if str(section.get("class_path", "")).endswith("ModelCheckpoint")
        and section.init_args.get("dirpath")
    ]
    root = trainer.get("default_root_dir")
    return (None if root is None else str(root)), folders


def check_model_source(value: str | None) -> None:
    """Raise :class:`ConfigError` when ``model.model_name_or_path`` can be neither a local
    folder nor a reachable hub model: a path that does not exist, or a hub id that is not in
    the local cache while the hub cannot be reached (or has no such model). Without this the
    first sign was three chained tracebacks from the tokenizer's loader."""
    if value is None or Path(value).expanduser().exists():
        return  # None: DAPOModule says what is missing
    fix = (
        "Fix: give the folder of a model written by save_pretrained, or a hub id "
        "such as Qwen/Qwen2.5-0.5B-Instruct; --create_model_if_missing tiny writes the tiny "
        "test model."
    )
    if value.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(value):
        raise ConfigError(f"model.model_name_or_path: {value} does not exist. {fix}")
    problem = hub_problem(value)
    if problem is not None:
        raise ConfigError(
            f"model.model_name_or_path: {value!r} is no local folder and {problem}. Fix: correct "
            f"the path, or download the model where there is network (`hf download {value} "
            "--local-dir DIR`) and give DIR."
        )


def hub_problem(repo_id: str) -> str | None:
    """Why the hub model ``repo_id`` cannot be loaded here, or None when it can (it is in the
    local cache, or the hub answers that it exists, or says something this check cannot judge,
    such as a gated model)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "it is not in the local hub cache (HF_HUB_OFFLINE is set)"
    host = constants.ENDPOINT.split("://", 1)[-1].split("/", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        return f"the hub ({constants.ENDPOINT}) cannot be reached ({error})"
    try:
        HfApi().model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        return f"the hub ({constants.ENDPOINT}) has no such model"
    except Exception:  # noqa: BLE001 - gated, rate limited...: the loader will say
        return None
    return None


def check_world_split(trainer: Trainer, datamodule: Any) -> None:
    """Raise :class:`ConfigError` before any rank starts when the data's batch sizes do not
    split over ``trainer.world_size`` ranks (each rank would raise it alone, with a traceback
    each). The prompt count is checked later, when the data is loaded."""
    sampling = getattr(datamodule, "dynamic_sampling", None)
    if sampling is None or trainer.world_size <= 1:
        return
    try:  # the prompts are not loaded yet: only the split over ranks is checked here
        sampling.check_split(trainer.world_size, num_prompts=sys.maxsize)
    except ValueError as error:
        raise ConfigError(
            f"data.dynamic_sampling.{error} Or run on a number of ranks (trainer.devices x "
            f"trainer.num_nodes, now {trainer.world_size}) that divides it."
        ) from None


def _local_processes(config: Namespace) -> int:
    """Training processes of the run on this machine: ``trainer.devices`` on CPU, else 1."""
    trainer = config.get("trainer") or Namespace()
    devices = trainer.get("devices")
    if trainer.get("accelerator") != "cpu" or isinstance(devices, bool):
        return 1
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and devices > 1 else 1


#: Fixes for Lightning's Trainer errors our configs can reach: (a phrase of its message, fix).
TRAINER_FIXES = (
    (
        "enable_progress_bar=False",
        "set trainer.enable_progress_bar: true, or remove the progress bar from trainer.callbacks",
    ),
)


def _trainer_fix(message: str) -> str:
    """`` Fix: ...`` for a Lightning Trainer error of :data:`TRAINER_FIXES`, else ``""``."""
    return next((f" Fix: {fix}." for phrase, fix in TRAINER_FIXES if phrase in message), "")


def choose_run_threads(config: Namespace, to_create: tuple[str, Path] | None) -> None:
    """Set the intra-op thread count for the run (:func:`~dapo_lightning.threads.choose_threads`
    on the size of the model it trains: the tiny one it writes, or the local folder's) and say
    it in one line (rank 0)."""
    model: str | int | None = tiny_num_parameters() if to_create is not None else None
    if to_create is None:
        model_args = (config.get("model") or Namespace()).get("init_args", Namespace())
        model = model_args.get("model_name_or_path") if isinstance(model_args, Namespace) else None
    try:
        choice = configure_threads(
            model, setting=config.get("threads", "auto"), processes=_local_processes(config)
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0":
        print(choice.line(), file=sys.stderr, flush=True)


def _warmup_task_kwargs(config: Namespace) -> dict[str, Any]:
    """The warm-up sees the problems the data module will serve."""
    data = (config.get("data") or Namespace()).get("init_args") or Namespace()
    task_kwargs = dict(data.get("task_kwargs") or {})
    task_kwargs.setdefault("task_seed", task_kwargs.pop("seed", data.get("seed") or 0))
    chat = (data.get("prompts") or Namespace()).get("apply_chat_template")
    if chat is not None:
        task_kwargs["apply_chat_template"] = bool(chat)
    return task_kwargs


def _root_cause(error: BaseException) -> tuple[BaseException, str]:
    """The exception a class's ``__init__`` raised under jsonargparse's wrapping, and the class."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    owner = "config"
    tb = cause.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            owner = type(frame.f_locals["self"]).__name__
        tb = tb.tb_next
    return cause, owner


# ----------------------------------------------------------------------------- entry point
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
        | {"formatter_class": _HelpFormatter},  # the main parser's: subcommands inherit it
        run=run,
        args=args,
    )


def top_level_help() -> str:
    """What ``dapo-lightning --help`` prints."""
    commands = {
        "fit": "train (dapo-lightning fit --help)",
        "validate": "score a checkpoint on the held-out prompts",
        **OTHER_COMMANDS,
    }
    lines = [f"  {name:<12}{text}" for name, text in commands.items()]
    return "\n".join(
        [
            f"usage: dapo-lightning {{{','.join(commands)}}} ...",
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
    try:
        with exit_on_stop():
            build_cli(args)
    except (
        ConfigError,
        RunDirLockedError,
        CheckpointDiskFullError,
        NonFiniteCheckpointError,
        NonFiniteUpdatesError,
    ) as error:
        print(f"dapo-lightning: error: {error}", file=sys.stderr)
        sys.exit(2 if isinstance(error, ConfigError) else 1)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dapo-lightning`` console script."""
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        print(top_level_help())
        return
    # Before Lightning and vLLM print them, and before export / make-model load a model
    # (transformers imports deepspeed, which logs its CPU-accelerator line): logging_setup.py.
    quiet_known_warnings()
    if argv and argv[0] == "plot":
        plot_main(argv[1:])
        return
    if argv and argv[0] == "export":
        export_main(argv[1:])
        return
    if argv and argv[0] == "make-model":
        make_model_main(argv[1:])
        return
    _run_lightning(args)


if __name__ == "__main__":
    main()
