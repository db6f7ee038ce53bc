"""Crash-safe checkpoint files: write to a temporary file, fsync, then atomically rename.

A run killed while writing ``last.ckpt`` (SIGKILL, OOM killer, a pre-empted node) must never
leave a truncated file where the previous good checkpoint was, or the resume that follows fails
or, worse, loads garbage. :class:`AtomicCheckpointIO` writes every checkpoint as::

    tmp = <dir>/.<name>.tmp             (same directory, hence the same file system)
    torch.save(checkpoint, tmp); flush; fsync(tmp)
    os.replace(tmp, path)                (atomic on POSIX: readers see the old or the new file)
    fsync(<dir>)                         (the rename itself survives a power loss)

so at every instant ``path`` holds either the complete previous checkpoint or the complete new
one. A leftover ``.<name>.tmp`` from a killed writer is never read; the next save of the same
file truncates and reuses it. (Only one process may write a given path at a time, as with
Lightning, where global rank 0 writes.) Remote (fsspec) paths fall back to Lightning's own transactional save.

Use it as a Trainer plugin: ``Trainer(plugins=[AtomicCheckpointIO()])``, or in a LightningCLI
config::

    trainer:
      plugins:
        - class_path: dapo_lightning.checkpoint.AtomicCheckpointIO

(:class:`~dapo_lightning.callbacks.RunGuard` installs it when the trainer has Lightning's plain
``TorchCheckpointIO``.)

The previous good checkpoint is kept: overwriting ``last.ckpt`` first hard-links the old file
to ``last-previous.ckpt`` (:func:`previous_path`), so there are always two complete states on
disk, and :func:`find_resume_checkpoint` (``--ckpt_path auto``) falls back to the older one
when the newest cannot be loaded. A full disk raises :class:`CheckpointDiskFullError`, naming
the directory and its free space, and leaves the existing checkpoints as they were (see
docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dapo_lightning.checks import ConfigError
from dapo_lightning.lightning_internals import attached_trainer, last_checkpoint_paths
from dapo_lightning.step_guard import all_finite
from dapo_lightning.weights import shape_mismatches

#: What a disk-full failure raises as (EDQUOT: a quota is full, the same to the user).
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class CheckpointDiskFullError(OSError):
    """A checkpoint did not fit on its disk; the existing checkpoints are untouched.

    Args:
        path: The checkpoint that was being written.
        written: Bytes written before the disk was full (0 if unknown).
    """

    def __init__(self, path: str | os.PathLike[str], written: int = 0) -> None:
        directory = Path(path).parent
        free = shutil.disk_usage(directory).free if directory.exists() else 0
        size = f" after {_gib(written)} of it" if written else ""
        super().__init__(
            errno.ENOSPC,
            f"No space left on device writing checkpoint {path}{size}: {directory} has "
            f"{_gib(free)} free. Free space there, or point the checkpoint directory "
            "(ModelCheckpoint dirpath / trainer.default_root_dir) at a larger disk, then resume "
            "with --ckpt_path auto; the checkpoints already there are intact.",
        )
        self.path = str(path)
        self.free_bytes = free


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**27 else f"{num_bytes / 2**20:.1f} MiB"


def _is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` or an exception it was raised from is ENOSPC / EDQUOT (torch.save
    reports a failed write as a RuntimeError raised while handling the OSError)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint that ``path`` replaces is kept: ``last.ckpt`` -> ``last-previous.ckpt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-previous{path.suffix}")


def _is_local(path: str | os.PathLike[str]) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def atomic_torch_save(
    obj: Any, path: str | os.PathLike[str], *, keep_previous: bool = False
) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` half-written (see the module docstring).

    Args:
        obj: What to save.
        path: The file to write (its folder is created).
        keep_previous: Keep the file being replaced as :func:`previous_path` (a hard link where
            the file system has them, else a rename).

    Raises:
        CheckpointDiskFullError: The disk (or quota) is full; ``path`` is unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file():
            _keep_as_previous(path)
        os.replace(tmp, path)
    except BaseException as error:
        written = tmp.stat().st_size if tmp.is_file() else 0
        tmp.unlink(missing_ok=True)
        if _is_disk_full(error):
            raise CheckpointDiskFullError(path, written) from error
        raise
    _fsync_dir(path.parent)


def _keep_as_previous(path: Path) -> None:
    previous = previous_path(path)
    staged = path.parent / f".{previous.name}.tmp"
    staged.unlink(missing_ok=True)
    try:
        os.link(path, staged)  # path stays in place: at every instant one of the two is complete
        os.replace(staged, previous)
    except OSError:  # no hard links here (some network and FUSE file systems)
        os.replace(path, previous)


def _fsync_dir(directory: Path) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory file descriptors
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def nonfinite_weight(state_dict: dict[str, Any]) -> str | None:
    """The name of the first floating-point tensor of ``state_dict`` with a NaN / inf element,
    or None (one fused check: :func:`~dapo_lightning.step_guard.all_finite`)."""
    floats = [(k, v) for k, v in state_dict.items() if torch.is_tensor(v) and v.is_floating_point()]
    if all_finite([v for _, v in floats]):
        return None
    return next(k for k, v in floats if not all_finite([v]))


def newest_checkpoint(directory: str | os.PathLike[str] | None) -> Path | None:
    """The most recently written ``*.ckpt`` file of ``directory`` (None: none, or no folder)."""
    if directory is None or not Path(directory).is_dir():
        return None
    files = [p for p in Path(directory).glob("*.ckpt") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint was not written because the weights hold NaN / inf values.

    Args:
        path: The file that was not written.
        tensor: The first non-finite weight's name.
    """

    def __init__(self, path: Any, tensor: str) -> None:
        self.path = Path(str(path).removeprefix("file://"))
        last = newest_checkpoint(self.path.parent)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        super().__init__(
            f"not saved: {self.path.name} would hold non-finite weights ({tensor} has NaN / inf "
            f"values); {kept}."
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local saves are atomic (temporary file + fsync + rename).

    Loading is Lightning's (``weights_only`` is passed through: DAPO checkpoints hold only
    tensors and plain Python containers, so ``weights_only=True`` loads them).

    Args:
        keep_previous: When a save replaces a file, keep the old one as :func:`previous_path`
            (``last.ckpt`` -> ``last-previous.ckpt``), the fallback of ``--ckpt_path auto``.
            Costs the disk space of one more checkpoint.

    Raises:
        CheckpointDiskFullError: From :meth:`save_checkpoint`, when the disk is full.
        NonFiniteCheckpointError: From :meth:`save_checkpoint`, when a weight holds NaN / inf
            (the file is not written: the previous checkpoints stay as they are).
    """

    def __init__(self, keep_previous: bool = True) -> None:
        super().__init__()
        self.keep_previous = keep_previous

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint does not take storage_options: remove them "
                "or use another CheckpointIO plugin."
            )
        bad = nonfinite_weight(checkpoint.get("state_dict", {}))
        if bad is not None:
            raise NonFiniteCheckpointError(path, bad)
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        local = str(path)[len("file://") :] if str(path).startswith("file://") else path
        atomic_torch_save(checkpoint, local, keep_previous=self.keep_previous)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` and the previous checkpoint kept beside it."""
        super().remove_checkpoint(path)
        if _is_local(path):
            previous_path(str(path).removeprefix("file://")).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- resuming
#: ``hpc_ckpt_<n>.ckpt``: what Lightning's SLURM auto-requeue writes into default_root_dir.
_HPC_CKPT = re.compile(r"hpc_ckpt_\d+\.ckpt")


def _load_header(path: Path) -> dict[str, Any]:
    """The checkpoint's top-level dict, tensors memory-mapped (reads little more than the
    file's index); a sharded folder's ``meta.pt`` (FSDP), else ``{}`` for a folder."""
    if path.is_dir():
        meta = path / "meta.pt"
        return torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def inspect_checkpoint(path: str | os.PathLike[str]) -> tuple[int | None, str | None]:
    """``(update, None)`` for a checkpoint that loads, ``(None, why)`` for one that does not.

    The update is the checkpoint's own ``global_step`` (None where it cannot be read: a sharded
    folder without ``meta.pt``, a file holding objects ``weights_only`` refuses). A file is
    opened the way a resume opens it (``torch.load`` of the whole structure, tensors
    memory-mapped): a truncated or empty file fails here. A checkpoint holding objects that
    ``weights_only`` refuses counts as loadable (its structure is complete). A folder (sharded
    FSDP / DeepSpeed checkpoint) must not be empty.
    """
    path = Path(path)
    if path.is_dir() and not any(path.iterdir()):
        return None, "empty checkpoint folder"
    try:
        header = _load_header(path)
    except Exception as error:  # noqa: BLE001 - every failure to load is a reason to skip it
        if "Weights only load failed" in str(error):
            return None, None
        if path.is_dir():
            return None, None  # a sharded folder whose metadata is not ours to judge
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    step = header.get("global_step") if isinstance(header, dict) else None
    return (int(step) if isinstance(step, int) else None), None


def checkpoint_error(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it loads
    (see :func:`inspect_checkpoint`)."""
    return inspect_checkpoint(path)[1]


def resume_candidates(trainer: Any) -> list[str]:
    """The checkpoints ``trainer`` could resume from, modified last first (the order only
    breaks ties: :func:`find_resume_checkpoint` ranks them by their update).

    Candidates: every ``last*.ckpt`` (``last-previous.ckpt`` included) in the ``dirpath`` of the
    trainer's ``ModelCheckpoint`` callbacks, and every ``hpc_ckpt_<n>.ckpt`` in
    ``trainer.default_root_dir``. Folders named ``*.ckpt`` (sharded checkpoints) count too.
    """
    found: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found |= last_checkpoint_paths(callback, trainer)
    root = Path(trainer.default_root_dir)
    if root.is_dir():
        found |= {str(p) for p in root.iterdir() if _HPC_CKPT.fullmatch(p.name)}
    existing = [p for p in found if os.path.exists(p)]
    return sorted(existing, key=lambda p: (os.path.getmtime(p), p), reverse=True)


def find_resume_checkpoint(trainer: Any, report: Callable[[str], None] | None = None) -> str | None:
    """The loadable checkpoint of :func:`resume_candidates` with the highest update, or None to
    start fresh.

    The update is read from each checkpoint (its ``global_step``), never taken from the file's
    modification time: a ``cp -r`` or ``rsync`` of a run directory gives its files new times in
    any order. Among equal updates (or updates that cannot be read) the file modified last wins.
    Each unloadable one (see :func:`inspect_checkpoint`) is skipped and reported, so a run whose
    newest checkpoint was cut short resumes from the one before it.

    Args:
        trainer: The trainer about to fit.
        report: Called with one line per skipped checkpoint (e.g. ``print``) and one saying
            which file was taken and why (:func:`resume_choice`).
    """
    loadable: list[tuple[str, int]] = []  # modified last first
    for path in resume_candidates(trainer):
        step, error = inspect_checkpoint(path)
        if error is not None:
            if report is not None:
                report(f"skipping {path}: it cannot be loaded ({error})")
            continue
        loadable.append((path, -1 if step is None else step))
    if not loadable:
        return None
    best = max(loadable, key=lambda found: found[1])  # the first of a tie: modified last
    if report is not None:
        report(resume_choice(best, loadable))
    return best[0]


def resume_choice(best: tuple[str, int], loadable: list[tuple[str, int]]) -> str:
    """Which checkpoint ``--ckpt_path auto`` took and why: ``best`` (path, update) among
    ``loadable`` (modified last first); a file written after it at a lower update (a fresh run's
    beside a stale run's) is named, with how to resume that one instead."""
    path, step = best
    of = f", the highest of {len(loadable)} loadable checkpoints; read from each file"
    line = f"resuming from {path} (update {step}{of if len(loadable) > 1 else ''})"
    later = [found for found in loadable[: loadable.index(best)] if found[1] < step]
    if later:
        other, other_step = later[0]
        line += (
            f"; {other} was written after it, at update {other_step} (a fresh run started in "
            f"this folder?): to resume that run instead, give --ckpt_path {other}"
        )
    return line


def optimizer_settings(trainer: Any) -> list[list[dict[str, Any]]]:
    """The hyper-parameters of every param group of every optimizer of ``trainer`` (everything
    but the parameters), to compare with what a resume restored."""
    return [
        [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for optimizer in trainer.optimizers
    ]


def apply_optimizer_settings(trainer: Any, configured: list[list[dict[str, Any]]]) -> list[str]:
    """Put the configured optimizer hyper-parameters back after a resume restored the
    checkpoint's; returns one line per value changed, e.g.
    ``"lr: 0.001 (checkpoint) -> 0.0005 (config)"``.

    A resumed optimizer keeps its moments (``exp_avg`` ...) from the checkpoint, but its
    hyper-parameters (learning rate, weight decay, betas) follow the config: what the saved
    ``config.yaml`` says is what runs. Under a learning-rate scheduler the configured peak is
    ``initial_lr``; the scheduler's ``base_lrs`` and the current ``lr`` are rescaled to it, so
    the schedule continues where it was, at the new peak.
    """
    changes: list[str] = []
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    for i, (optimizer, groups) in enumerate(zip(trainer.optimizers, configured)):
        if len(groups) != len(optimizer.param_groups):
            continue  # a different model: nothing to compare
        for j, (group, wanted) in enumerate(zip(optimizer.param_groups, groups)):
            name = f"optimizer {i} group {j}: " if len(trainer.optimizers) * len(groups) > 1 else ""
            scheduled = "initial_lr" in group and "initial_lr" in wanted
            for key, value in wanted.items():
                if (scheduled and key == "lr") or key not in group or _same(group[key], value):
                    continue
                shown = "lr" if key == "initial_lr" else key  # the configured (peak) lr
                changes.append(f"{name}{shown}: {group[key]} (checkpoint) -> {value} (config)")
                if scheduled and key == "initial_lr" and group[key]:
                    group["lr"] *= value / group[key]
                    for scheduler in schedulers:
                        if scheduler.optimizer is optimizer:
                            scheduler.base_lrs[j] = value
                group[key] = value
    return changes


def _same(a: Any, b: Any) -> bool:
    """Equal, counting a list and a tuple of the same items as equal (betas come back as either)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. tensors of another shape: not the same
        return False


#: Files that mark a folder as a sharded checkpoint: Lightning's FSDP (``meta.pt``), torch
#: distributed checkpoint (``.metadata``), DeepSpeed (``latest``, ``checkpoint/``).
_SHARDED_MARKERS = ("meta.pt", ".metadata", "latest", "checkpoint")


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a folder holding a sharded checkpoint (one of :data:`_SHARDED_MARKERS`)."""
    folder = Path(path)
    return folder.is_dir() and any((folder / name).exists() for name in _SHARDED_MARKERS)


def check_checkpoint_fits(module: Any, checkpoint: dict[str, Any]) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` when ``checkpoint`` (before it loads
    into ``module``, a DAPOModule) has a parameter of another shape: one line naming the file,
    the parameter, both shapes and the fix (not ~30 lines of ``size mismatch``)."""
    path, model = (
        getattr(attached_trainer(module), "ckpt_path", None),
        module.hparams.model_name_or_path,
    )
    found = shape_mismatches(checkpoint.get("state_dict", {}), module.state_dict())
    if not found:
        return
    name, old, new = found[0]
    more = f" (and {len(found) - 1} more parameters)" if len(found) > 1 else ""
    raise ConfigError(
        f"ckpt_path: {path} does not fit the model: {name} has shape {list(old)} in the "
        f"checkpoint but {list(new)} in model.model_name_or_path={model}{more}. Fix: resume "
        "with the model the checkpoint was trained from, or start a fresh run (another "
        "trainer.default_root_dir, without --ckpt_path)."
    )


#: ``ckpt_path`` values Lightning resolves itself (and ``auto``, resolved by the CLI).
_NAMED_CKPT_PATHS = ("auto", "last", "best", "hpc")


def check_ckpt_path(path: str | os.PathLike[str] | None) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` unless ``--ckpt_path`` names a
    checkpoint that loads (a file, or a sharded checkpoint folder); None, Lightning's named
    values (``last``, ``best``, ``hpc``, ``registry...``), ``auto`` and URLs pass."""
    text = None if path is None else os.fspath(path)
    if text is None or text in _NAMED_CKPT_PATHS or "://" in text or text.startswith("registry"):
        return
    fix = (
        "Fix: give a checkpoint file (e.g. RUN/checkpoints/last.ckpt), or --ckpt_path auto to "
        "resume from the run's loadable checkpoint with the highest update."
    )
    given = Path(text)
    if not given.exists():
        raise ConfigError(f"ckpt_path: {text} does not exist. {fix}")
    if given.is_dir() and not is_sharded_checkpoint(given):
        inside = sorted(p.name for p in given.glob("*.ckpt"))
        holds = f" (it holds {', '.join(inside[:4])})" if inside else ""
        raise ConfigError(f"ckpt_path: {text} is a folder, not a checkpoint{holds}. {fix}")
    error = checkpoint_error(given)
    if error is not None:
        raise ConfigError(
            f"ckpt_path: {text} cannot be loaded ({error}). Fix: give a complete checkpoint "
            "(last-previous.ckpt beside last.ckpt is the one before it), or --ckpt_path auto, "
            "which skips checkpoints that do not load."
        )
