"""The command line of one sandboxed interpreter: bubblewrap's flags and the child's limits.

Under ``isolation: bwrap`` the interpreter runs in ``bwrap`` with

* its own namespaces: no network (a new network namespace holds only a down loopback), its own
  processes (a new pid namespace: the code sees no other process, and when the interpreter
  exits or is killed every process it started dies with the namespace), IPC, hostname and
  cgroup view, a new session (``--new-session``: no terminal to push input into) and
  ``--die-with-parent``;
* a root file system of its own holding only read-only binds of ``/usr`` (with the usual
  ``/bin``, ``/lib*`` links or binds) and of the interpreter's prefix, a fresh ``/proc`` and
  a minimal ``/dev`` (read-only), and a private tmpfs of ``scratch_mb`` at ``/tmp``: the only
  writable place, the working folder and ``$HOME``;
* an empty environment (``--clearenv``) plus ``HOME``, ``PATH``, ``LANG``, ``TMPDIR`` and
  ``sandbox.env``;
* the resource limits of :class:`~dapo_lightning.sandbox.config.SandboxConfig`, which the
  child sets on itself before it reads the code (:mod:`dapo_lightning.sandbox._child`);
* a seccomp filter (x86-64) that stops the code from making namespaces of its own, mounting,
  and a few of the kernel's larger attack surfaces (:mod:`dapo_lightning.sandbox.seccomp`).

Run by root, ``bwrap`` maps uid 0 to itself in a user namespace, and the kernel never enforces
``RLIMIT_NPROC`` for host uid 0: a fork bomb would not stop. So as root the user namespace is
left out (``--unshare-all`` less ``--unshare-user``), bwrap keeps only ``CAP_SETUID`` and
``CAP_SETGID`` and the child drops to a uid of its own (:func:`sandbox_uid`, no capabilities)
before it reads the code. Any other user gets ``--unshare-all`` with a user namespace (and
``--disable-userns`` where bwrap has it, so the code cannot make another).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from functools import cache
from pathlib import Path

from dapo_lightning.sandbox.config import SandboxConfig

#: Where the scratch tmpfs is mounted (working folder, ``$HOME``, ``$TMPDIR``).
SCRATCH = "/tmp"
#: Uids the root-run sandboxes drop to: one drawn at random per interpreter from
#: ``[UID_BASE, UID_BASE + UID_SPAN)``, so that ``RLIMIT_NPROC`` counts the processes of one
#: sandbox only (two sandboxes alive at once share a uid with odds ~1e-6 per pair).
UID_BASE = 200_000
UID_SPAN = 1_000_000


def sandbox_uid() -> int:
    """A uid for the next root-run sandbox: ``UID_BASE + randbelow(UID_SPAN)`` (no user has
    it: no files, no other processes)."""
    return UID_BASE + secrets.randbelow(UID_SPAN)


def interpreter() -> tuple[str, list[str]]:
    """This process's Python interpreter (symlinks resolved, a virtual environment's base) and
    the folders it needs bound read-only (its prefixes outside ``/usr``)."""
    python = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    return python, sorted(r for r in roots if not _under(r, "/usr"))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@cache
def child_source() -> str:
    """The text of :mod:`dapo_lightning.sandbox._child` (the child's first code)."""
    return (Path(__file__).with_name("_child.py")).read_text()


def child_argv(config: SandboxConfig, python: str, uid: int) -> list[str]:
    """``python -I -S -B -c CHILD CPU AS FSIZE NPROC NOFILE UID``: an isolated interpreter (no
    site-packages, no environment variables read, no bytecode written) that sets ``config``'s
    limits, drops to ``uid`` when it is >= 0 and runs the code it reads from stdin."""
    mib = 1 << 20
    limits = (
        config.cpu_limit_s,
        config.memory_mb * mib,
        config.max_file_mb * mib,
        config.max_processes,
        config.max_open_files,
        uid,
    )
    return [python, "-I", "-S", "-B", "-c", child_source(), *map(str, limits)]


def child_env(config: SandboxConfig, home: str = SCRATCH) -> dict[str, str]:
    """The code's whole environment: ``HOME`` and ``TMPDIR`` (``home``), ``PATH``, ``LANG``,
    then ``config.env``."""
    base = {"HOME": home, "TMPDIR": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return {**base, **config.env}


@cache
def bwrap_has(flag: str, bwrap: str) -> bool:
    """True when ``bwrap --help`` lists ``flag`` (``--disable-userns`` came in 0.8)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout + out.stderr


def _read_only(path: str) -> list[str]:
    """Flags that bind ``path`` read-only, its missing parents made traversable (0755)."""
    flags: list[str] = []
    parents = list(Path(path).parents)[::-1][1:]  # "/" itself exists
    for parent in parents:
        if not _under(str(parent), "/usr"):
            flags += ["--perms", "0755", "--dir", str(parent)]
    return flags + ["--ro-bind", path, path]


def bwrap_argv(
    config: SandboxConfig, bwrap: str, as_root: bool, uid: int, seccomp_fd: int | None = None
) -> list[str]:
    """The whole command line of one sandboxed interpreter (module docstring); ``uid`` is the
    one the child drops to (as root), -1 for none; ``seccomp_fd`` an open descriptor bwrap
    reads the seccomp filter from (:mod:`dapo_lightning.sandbox.seccomp`), None for none."""
    python, roots = interpreter()
    if as_root:
        spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        spaces += ["--unshare-cgroup-try", "--cap-drop", "ALL"]
        spaces += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        spaces = ["--unshare-all", "--unshare-user"]
        spaces += ["--disable-userns"] if bwrap_has("--disable-userns", bwrap) else []
    argv = [bwrap, *spaces, "--new-session", "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        top = f"/{name}"
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for root in roots:
        argv += _read_only(root)
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--perms", "1777", "--size", str(config.scratch_mb << 20), "--tmpfs", SCRATCH]
    argv += ["--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    argv += ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    for name, value in child_env(config).items():
        argv += ["--setenv", name, value]
    return argv + child_argv(config, python, uid if as_root else -1)
