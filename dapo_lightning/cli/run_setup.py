"""The ``fit`` / ``validate`` run set-up: paths under the run directory, the data seed, the
thread count, the checks made before any rank starts (writable folders, batch sizes over the
ranks), and resuming (``--ckpt_path auto``, a validation at the checkpoint's update).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer

from dapo_lightning import plot
from dapo_lightning.checkpoint.checks import check_rank_count
from dapo_lightning.checkpoint.resume import find_resume_checkpoint
from dapo_lightning.checks import ConfigError
from dapo_lightning.data.streams.one_step_off import check_pipeline
from dapo_lightning.lightning_internals import restore_fit_loop
from dapo_lightning.log_step import set_logging_step
from dapo_lightning.shared_cores import SharedCores
from dapo_lightning.testing import tiny_num_parameters
from dapo_lightning.threads import configure_threads, usable_cores

#: ``--ckpt_path`` value that picks the loadable checkpoint of the highest update (see :func:`resolve_auto_checkpoint`).
AUTO_CKPT = "auto"


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


def fill_data_seed(config: Namespace) -> None:
    """``data.seed: null`` -> the run's ``seed_everything`` (an int once LightningCLI seeded)."""
    data = (config.get("data") or Namespace()).get("init_args")
    seed = config.get("seed_everything")
    if isinstance(data, Namespace) and "seed" in data and data.seed is None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            data.seed = seed


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


def _local_processes(config: Namespace) -> int:
    """Training processes of the run on this machine: ``trainer.devices`` on CPU, else 1."""
    trainer = config.get("trainer") or Namespace()
    devices = trainer.get("devices")
    if trainer.get("accelerator") != "cpu" or isinstance(devices, bool):
        return 1
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and devices > 1 else 1


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
    line = choice.line()
    if _sampling_setting(config, "pipeline") == "one_step_off":  # as the data module will
        settings = _sampling_setting(config, "one_step_off")
        lend = _setting(settings, "share_cores") is not False
        line += (
            f"; pipeline one_step_off: {SharedCores(choice.threads, usable_cores(), lend).line()}"
        )
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _sampling_setting(config: Namespace, key: str) -> Any:
    """``data.init_args.dynamic_sampling.<key>`` of ``config`` (None when not set)."""
    data = (config.get("data") or Namespace()).get("init_args", Namespace())
    return _setting(data.get("dynamic_sampling") if isinstance(data, Namespace) else None, key)


def _setting(group: Any, key: str) -> Any:
    """``group``'s ``key``, whether ``group`` is a parsed Namespace, a dict or a dataclass
    (None when not set)."""
    if isinstance(group, (Namespace, dict)):
        return group.get(key)
    return getattr(group, key, None)


def check_world_split(trainer: Trainer, datamodule: Any) -> None:
    """Raise :class:`ConfigError` before any rank starts when the data's batch sizes do not
    split over ``trainer.world_size`` ranks (each rank would raise it alone, with a traceback
    each), or the one-step-off pipeline cannot run with the strategy or engine settings. The
    prompt count is checked later, when the data is loaded."""
    sampling = getattr(datamodule, "dynamic_sampling", None)
    if getattr(sampling, "pipeline", None) == "one_step_off":  # FSDP, sleep mode: refused here
        check_pipeline(trainer, getattr(datamodule, "engine_kwargs", {}))
    if sampling is None or trainer.world_size <= 1:
        return
    try:  # the prompts are not loaded yet: only the split over ranks is checked here
        sampling.check_split(trainer.world_size, num_prompts=sys.maxsize)
    except ValueError as error:
        raise ConfigError(
            f"{error} Or run on a number of ranks (trainer.devices x "
            f"trainer.num_nodes, now {trainer.world_size}) that divides it."
        ) from None


# ----------------------------------------------------------------------------- resuming
def resolve_auto_checkpoint(trainer: Trainer) -> str | None:
    """The checkpoint ``--ckpt_path auto`` resumes ``trainer`` from, or None to start fresh:
    :func:`~dapo_lightning.checkpoint.resume.find_resume_checkpoint`, reporting skipped files."""

    def report(line: str) -> None:
        if trainer.is_global_zero:
            print(f"--ckpt_path auto: {line}", file=sys.stderr)

    return find_resume_checkpoint(trainer, report)


def check_resume_ranks(trainer: Trainer, datamodule: Any, ckpt_path: Any) -> None:
    """Raise :class:`ConfigError` before any rank starts when the checkpoint (a file or a
    sharded folder) ``ckpt_path`` holds the data state of another number of ranks than
    ``trainer.world_size`` (:func:`~dapo_lightning.checkpoint.checks.check_rank_count`; the
    data state is saved under the data module's class name, as Lightning saves it)."""
    if ckpt_path is None or datamodule is None or not os.path.exists(str(ckpt_path)):
        return
    check_rank_count(ckpt_path, trainer.world_size, type(datamodule).__qualname__)


def continue_update_count(trainer: Trainer, ckpt_path: str | os.PathLike[str]) -> int:
    """Restore the fit loop's counters from ``ckpt_path`` (Lightning restores them for ``fit``
    only), so that a validation of an update-170 checkpoint says "validation at update 170" and
    logs at step 169, where the fit logged its validation after update 170 (ValidateAtStart's
    "updates done = step + 1"). Returns the update."""
    state = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    restore_fit_loop(trainer, state)
    update = int(state.get("global_step", 0))
    set_logging_step(trainer, update - 1)
    return update
