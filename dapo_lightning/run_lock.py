"""One fit per run directory: a lock file naming the process that holds it.

Two fits writing into one run directory interleave their checkpoints and metrics, and the
second one's ``--ckpt_path auto`` may resume from the first one's state. :class:`RunLock` keeps
``<run dir>/.dapo-run.lock`` (JSON: pid, host, process start time, command) while a fit runs
(:class:`~dapo_lightning.callbacks.RunGuard` holds it from ``setup`` to the end of fit). A lock
whose process is gone (killed, crashed, the node rebooted) is stale and taken over: on the same
host the PID is checked, together with its start time so a reused PID does not count. A lock
held from another host cannot be checked, except under SLURM: the lock records the job id
(``SLURM_JOB_ID``), and a requeued job keeps its id, so a lock of the same job, left on
another node by the run that was pre-empted, is taken over. Any other lock of another host
stays; the error says how to remove it (see docs/design.md, "Stopping and resuming").

:func:`check_run_dirs_writable` tries the run directory and the checkpoint folder for real at
the start, so an unwritable one fails before any training time is spent.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dapo_lightning.checks import ConfigError

#: The lock file's name inside the run directory.
LOCK_NAME = ".dapo-run.lock"


class RunDirLockedError(RuntimeError):
    """Another live fit holds the run directory."""


class MissingMainGuardError(RuntimeError):
    """A fit started in a process that ``multiprocessing`` spawned, while it re-ran the main
    script's top level (see :func:`check_not_a_spawned_rerun`)."""


#: ``multiprocessing.spawn`` functions that run the parent's main script in a new process.
_SPAWN_RERUNS = ("_fixup_main_from_path", "_fixup_main_from_name")


def check_not_a_spawned_rerun() -> None:
    """Raise :class:`MissingMainGuardError` when called from a script's top level that a spawned
    process (a reward worker) is re-running to import the parent's ``__main__``.

    A spawned process imports the parent's main script before it runs its target; a script that
    starts training at its top level, without ``if __name__ == "__main__":``, would start a
    second fit there (and meet this run directory's lock, or start workers of its own).

    Raises:
        MissingMainGuardError: Naming the guard.
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _SPAWN_RERUNS and code.co_filename.endswith(
            os.path.join("multiprocessing", "spawn.py")
        ):
            raise MissingMainGuardError(
                "this process was started by multiprocessing (e.g. a reward worker) and is "
                "re-running your script's top level, which starts a fit: put the training "
                'code under `if __name__ == "__main__":` (worker processes import the main '
                "script; see the README's Python example)."
            )
        frame = frame.f_back


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``, field 22), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


class RunLock:
    """``<directory>/.dapo-run.lock``, held by this process between :meth:`acquire` and
    :meth:`release`.

    Args:
        directory: The run directory (created if missing).

    Raises:
        RunDirLockedError: From :meth:`acquire`, naming the PID and host that hold it.

    Example::

        lock = RunLock("runs/quickstart")
        lock.acquire()
        try:
            ...
        finally:
            lock.release()
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.held = False

    def _record(self) -> dict[str, Any]:
        pid = os.getpid()
        return {
            "pid": pid,
            "host": socket.gethostname(),
            "start": _process_start(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        }

    def _holder(self) -> dict[str, Any] | None:
        """The lock's record; None when it vanished; {} when it cannot be read yet."""
        for _ in range(20):  # a lock being written right now: give its writer a moment
            try:
                return json.loads(self.path.read_text())
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                time.sleep(0.05)
        return {}

    def acquire(self) -> None:
        """Take the lock, taking over a stale one (see the module docstring); in a spawned
        process re-running the main script, raise :class:`MissingMainGuardError` instead."""
        check_not_a_spawned_rerun()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile: try again
                self._check_stale(holder)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
            self.held = True
            return
        raise RunDirLockedError(
            f"could not take the run-directory lock {self.path}: it keeps changing."
        )

    def _check_stale(self, holder: dict[str, Any]) -> None:
        """Return when ``holder`` is gone (a stale lock); raise when it may be alive."""
        pid, host = holder.get("pid"), holder.get("host")
        if not isinstance(pid, int):
            return  # unreadable: a writer that died mid-write
        if pid == os.getpid() and host == socket.gethostname():
            return  # ours, left by an earlier fit of this process
        if host == socket.gethostname() and not _alive(pid, holder.get("start")):
            print(
                f"Taking over the stale run-directory lock {self.path} of PID {pid} (no longer running).",
                file=sys.stderr,
            )
            return
        job = os.environ.get("SLURM_JOB_ID")
        if host != socket.gethostname() and job and holder.get("slurm_job_id") == job:
            print(
                f"Taking over the run-directory lock {self.path} of PID {pid} on host {host}: "
                f"it is this SLURM job's ({job}) from before its requeue.",
                file=sys.stderr,
            )
            return
        where = "" if host == socket.gethostname() else f" on host {host}"
        raise RunDirLockedError(
            f"{self.path.parent} is in use by another fit: PID {pid}{where}, running since "
            f"{holder.get('since', '?')} ({holder.get('command', '?')}). Two fits in one run "
            "directory would mix their checkpoints: wait for it to finish, stop it, or give this "
            f"run its own --trainer.default_root_dir. If that process is gone, delete {self.path}."
        )

    def release(self) -> None:
        """Remove the lock file if this process holds it."""
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    @classmethod
    def acquire_for(cls, trainer: Any, directory: Path) -> RunLock | None:
        """Acquire on global rank 0 and fail on every rank alike; returns the held lock on rank 0.

        Raises:
            RunDirLockedError: On every rank, when the directory is held by another fit.
        """
        lock, error = None, None
        if trainer.is_global_zero:
            lock = cls(directory)
            try:
                lock.acquire()
            except RunDirLockedError as exc:
                error = str(exc)
        error = trainer.strategy.broadcast(error)
        if error is not None:
            raise RunDirLockedError(error)
        return lock


def unwritable(directory: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be created in ``directory`` (where it does not exist yet: in the
    nearest folder above it, where it would be created), or None when one can.

    Tried for real (a probe file created and removed at once), so file modes, ACLs, a read-only
    mount and root's exemption from modes all count as they will at the first save.
    """
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".dapo-write-test-", dir=path)
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    os.close(fd)
    os.unlink(probe)
    return None


def check_run_dirs_writable(
    root: str | os.PathLike[str] | None, checkpoint_dirs: list[str | os.PathLike[str]]
) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` unless files can be written into the
    run directory ``root`` (None: the working directory, Lightning's default) and into each
    checkpoint folder (see :func:`unwritable`).

    Raises:
        ConfigError: Naming the setting (``trainer.default_root_dir`` or
            ``ModelCheckpoint.dirpath``), the folder, why, and the fix.
    """
    where = os.getcwd() if root is None else root
    why = unwritable(where)
    if why is not None:
        raise ConfigError(
            f"trainer.default_root_dir: the run directory {where} is not writable ({why}). "
            "Fix: make it writable, or give the run another --trainer.default_root_dir."
        )
    for folder in checkpoint_dirs:
        why = unwritable(folder)
        if why is not None:
            raise ConfigError(
                f"ModelCheckpoint.dirpath: the checkpoint folder {folder} is not writable "
                f"({why}): no checkpoint could be saved. Fix: make it writable, or point the "
                "ModelCheckpoint's dirpath at a writable folder."
            )
