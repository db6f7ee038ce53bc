"""Crash-safe checkpoint files: write to a temporary file, fsync, then atomically rename.

A run killed while writing ``last.ckpt`` (SIGKILL, OOM killer, a pre-empted node) must never
leave a truncated file where the previous good checkpoint was, or the resume that follows fails
or, worse, loads garbage. :func:`atomic_torch_save` writes every checkpoint as::

    tmp = <dir>/.<name>.tmp             (same directory, hence the same file system)
    torch.save(checkpoint, tmp); flush; fsync(tmp)
    os.replace(tmp, path)                (atomic on POSIX: readers see the old or the new file)
    fsync(<dir>)                         (the rename itself survives a power loss)

so at every instant ``path`` holds either the complete previous checkpoint or the complete new
one. A leftover ``.<name>.tmp`` from a killed writer is never read; the next save of the same
file truncates and reuses it. (Only one process may write a given path at a time, as with
Lightning, where global rank 0 writes.)

The previous good checkpoint is kept: overwriting ``last.ckpt`` first hard-links the old file
to ``last-previous.ckpt`` (:func:`previous_path`), so there are always two complete states on
disk. A full disk raises :class:`CheckpointDiskFullError`, naming the directory and its free
space, and a folder that refuses the write (read-only, immutable, another owner)
:class:`CheckpointNotWritableError`; either leaves the existing checkpoints as they were (see
docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

#: What a disk-full failure raises as (EDQUOT: a quota is full, the same to the user).
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
#: What a folder that refuses writes raises as (a mode, ``chattr +i``, a read-only mount).
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the existing checkpoints are untouched. The run
    guard does not try to save again after one (see :class:`CheckpointDiskFullError`,
    :class:`CheckpointNotWritableError`)."""

    #: What went wrong, in a few words (the run guard's "not saved again (...)").
    why = "the checkpoint could not be written"


class CheckpointDiskFullError(CheckpointWriteError):
    """A checkpoint did not fit on its disk; the existing checkpoints are untouched.

    Args:
        path: The checkpoint that was being written.
        written: Bytes written before the disk was full (0 if unknown).
    """

    why = "the disk is full"

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


class CheckpointNotWritableError(CheckpointWriteError):
    """The checkpoint folder refused the write (read-only, immutable, owned by another user);
    the existing checkpoints are untouched.

    Args:
        path: The checkpoint that was being written.
        error: The refusal (its ``errno`` and ``strerror`` are kept).
    """

    why = "the checkpoint folder is not writable"

    def __init__(self, path: str | os.PathLike[str], error: OSError) -> None:
        directory = Path(path).parent
        super().__init__(
            error.errno,
            f"cannot write checkpoint {path}: the checkpoint folder {directory} is not "
            f"writable ({error.strerror}). Fix: make it writable (or point ModelCheckpoint "
            "dirpath / trainer.default_root_dir at a writable folder), then resume with "
            "--ckpt_path auto; the checkpoints already there are intact.",
        )
        self.path = str(path)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**27 else f"{num_bytes / 2**20:.1f} MiB"


def _os_error(error: BaseException | None, codes: set[int]) -> OSError | None:
    """The first of ``error`` and the exceptions it was raised from that is an OSError with
    one of ``codes`` (torch.save reports a failed write as a RuntimeError raised while handling
    the OSError), or None."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in codes:
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint that ``path`` replaces is kept: ``last.ckpt`` -> ``last-previous.ckpt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-previous{path.suffix}")


def is_local(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on the local file system (no URL scheme, or ``file://``)."""
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
        CheckpointNotWritableError: The folder refused the write; ``path`` is unchanged.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file():
            _keep_as_previous(path)
        os.replace(tmp, path)
    except BaseException as error:
        written = tmp.stat().st_size if tmp.is_file() else 0
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if _os_error(error, _DISK_FULL) is not None:
            raise CheckpointDiskFullError(path, written) from error
        refused = _os_error(error, _NOT_WRITABLE)
        if refused is not None:
            raise CheckpointNotWritableError(path, refused) from error
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


def newest_checkpoint(directory: str | os.PathLike[str] | None) -> Path | None:
    """The most recently written ``*.ckpt`` file of ``directory`` (None: none, or no folder)."""
    if directory is None or not Path(directory).is_dir():
        return None
    files = [p for p in Path(directory).glob("*.ckpt") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)
