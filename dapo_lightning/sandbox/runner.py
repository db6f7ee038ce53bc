"""Running code in the sandbox: :class:`Sandbox` (a warm pool of sandboxed interpreters) and
:class:`SandboxResult` (what one call gives back).

A call takes a waiting interpreter (or starts one), writes the code to its stdin and reads
its stdout and stderr (each kept up to ``max_output_bytes``; the rest is read and dropped, so
a program that prints without end cannot stall), until the interpreter exits or the wall
deadline ``timeout_s`` passes. Then every process of the sandbox is killed (under bwrap its
pid namespace's init: every process the code started dies with it, daemons included) and the
call returns once they are gone. A replacement interpreter is started (on one long-lived
thread) when a call takes one from the pool, so the next call finds one ready.

The sandbox is checked when it is built (:func:`check_isolation`): where ``bwrap`` is missing
or cannot make its namespaces, building it raises :class:`SandboxUnavailableError` (one
``error:`` line in the CLI) naming the cause and the fix; ``isolation: none`` is the explicit
way to run without isolation, and says so in a warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from dapo_lightning.checks import ConfigError
from dapo_lightning.sandbox.command import (
    bwrap_argv,
    child_argv,
    child_env,
    interpreter,
    sandbox_uid,
)
from dapo_lightning.sandbox.config import SandboxConfig, as_sandbox_config
from dapo_lightning.sandbox.process import Proc, exchange, starter
from dapo_lightning.sandbox.seccomp import seccomp_program

log = logging.getLogger(__name__)

#: The statuses of a call.
STATUSES = ("ok", "error", "timeout")


class SandboxUnavailableError(ConfigError):
    """The sandbox cannot run here (bwrap missing or refused): the message names the cause
    and the fix (a :class:`~dapo_lightning.checks.ConfigError`: one ``error:`` line, exit 2)."""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed call gives back.

    Args:
        status: ``"ok"`` (exit status 0), ``"error"`` (another exit status, or killed by a
            signal: an exception, a crash, a limit) or ``"timeout"`` (past ``timeout_s``:
            killed).
        exit_code: The interpreter's exit status; ``-N`` when signal N ended it (or the
            sandbox had to be killed at the deadline), None when it never started.
        stdout: What the code printed, decoded (bad bytes replaced), at most
            ``max_output_bytes`` of it.
        stderr: Likewise for stderr (a traceback, bwrap's complaints).
        stdout_truncated: More was printed than is kept.
        stderr_truncated: Likewise for stderr.
        wall_s: Seconds the call took.
        reason: Why it is not ``ok``, in words ("" when it is).
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    reason: str = ""

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited with status 0."""
        return self.status == "ok"


#: What a signal that ends the code usually means.
_SIGNAL_CAUSES = {
    signal.SIGXCPU: " (its CPU limit)",
    signal.SIGXFSZ: " (its file size limit)",
    signal.SIGSEGV: " (a crash)",
    signal.SIGKILL: "",
}


def describe_exit(exit_code: int | None) -> str:
    """An exit status in words: ``0`` -> "", ``1`` -> "exit status 1", ``-24`` -> "killed by
    SIGXCPU (its CPU limit)", None -> "did not start"."""
    if exit_code is None:
        return "did not start"
    if exit_code >= 0:
        return f"exit status {exit_code}" if exit_code else ""
    try:
        sig = signal.Signals(-exit_code)
    except ValueError:
        return f"killed by signal {-exit_code}"
    return f"killed by {sig.name}{_SIGNAL_CAUSES.get(sig, '')}"


_CHECKED: dict[tuple[Any, ...], str] = {}
_CHECK_LOCK = threading.Lock()


def check_isolation(config: SandboxConfig) -> None:
    """Refuse a sandbox that cannot isolate: under ``isolation: bwrap``, ``bwrap`` must be on
    PATH and run a trivial program with exactly the flags of a call (checked once per process
    and settings). Under ``isolation: none``, warn that nothing is isolated.

    Raises:
        SandboxUnavailableError: bwrap missing, or it failed (its own words, and the fix).
    """
    if config.isolation == "none":
        log.warning(
            "sandbox.isolation is none: model-written code runs as a plain child process of "
            "this one, with resource limits and a deadline but NO isolation (it can read and "
            "write your files, use the network and see other processes). Use isolation: bwrap "
            "for anything but trusted code."
        )
        return
    with _CHECK_LOCK:
        if config.key() in _CHECKED:
            return
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) is not installed: the sandbox runs model-written code only "
                "inside it. Fix: bash scripts/setup.sh as root installs it (or apt-get "
                "install -y bubblewrap, dnf install bubblewrap); or set sandbox.isolation: none "
                "to run the code without isolation (unsafe)."
            )
        with Sandbox(config, pool_size=0, checked=True) as probe:
            result = probe.run("print('sandbox-ok')")
        if result.status != "ok" or result.stdout.strip() != "sandbox-ok":
            said = (result.stderr.strip().splitlines() or [result.reason or result.status])[-1]
            raise SandboxUnavailableError(
                f"bwrap cannot start a sandbox here ({said[:300]}; {result.reason}). "
                "Fix: allow user namespaces (sysctl -w kernel.unprivileged_userns_clone=1 and "
                "user.max_user_namespaces=10000; on Ubuntu 24.04 also "
                "kernel.apparmor_restrict_unprivileged_userns=0), or in a container run it "
                "with --security-opt seccomp=unconfined (or --privileged); or set "
                "sandbox.isolation: none to run the code without isolation (unsafe)."
            )
        _CHECKED[config.key()] = result.stdout


class Sandbox:
    """Runs model-written Python code isolated, with limits and a deadline (module docstring).

    Thread-safe: calls from several threads run at once, each in its own interpreter.
    ``calls``, ``timeouts`` and ``errors`` count this sandbox's calls and their outcomes.

    Args:
        config: The settings (:class:`SandboxConfig`; a mapping of its fields is built).
        pool_size: Interpreters kept waiting (default ``config.pool_size``).
        checked: Skip the start check (:func:`check_isolation`), e.g. inside it.

    Raises:
        SandboxUnavailableError: the sandbox cannot run here (:func:`check_isolation`).
    """

    def __init__(
        self,
        config: SandboxConfig | dict[str, Any] | None = None,
        *,
        pool_size: int | None = None,
        checked: bool = False,
    ) -> None:
        self.config = as_sandbox_config(config)
        self.pool_size = self.config.pool_size if pool_size is None else pool_size
        if not checked:
            check_isolation(self.config)
        self._bwrap = shutil.which("bwrap") if self.config.isolation == "bwrap" else None
        self._as_root = os.geteuid() == 0
        self._pool: deque[Proc] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.calls = 0
        self.timeouts = 0
        self.errors = 0
        starter().submit(self._fill).result()

    # ------------------------------------------------------------------ public
    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (Python source) in a fresh sandboxed interpreter; never raises for
        anything the code does. Its stdin is empty; its working folder is the scratch."""
        if self._closed:
            raise RuntimeError("this Sandbox is closed.")
        if not isinstance(code, str):
            raise TypeError(f"Sandbox.run takes Python source as text, got {type(code).__name__}.")
        start = time.monotonic()
        proc = self._take()
        if proc is None:
            proc = starter().submit(self._start).result()
        starter().submit(self._fill)  # a replacement, started while this call runs
        try:
            source = code.encode("utf-8", "replace")
            result = self._communicate(proc, b"%d\n" % len(source) + source, start)
        finally:
            proc.kill()
        with self._lock:
            self.calls += 1
            self.timeouts += result.status == "timeout"
            self.errors += result.status == "error"
        return result

    def close(self) -> None:
        """Kill the waiting interpreters."""
        self._closed = True
        with self._lock:
            pool, self._pool = list(self._pool), deque()
        for proc in pool:
            proc.kill()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: module globals may be gone
            pass

    # ------------------------------------------------------------------ helpers
    def _take(self) -> Proc | None:
        """A waiting interpreter that is still alive (one that died waiting is reaped), or
        None when the pool has none."""
        while True:
            with self._lock:
                proc = self._pool.popleft() if self._pool else None
            if proc is None or proc.popen.poll() is None:
                return proc
            proc.kill()

    def _fill(self) -> None:
        """Start interpreters until ``pool_size`` wait (on the starter thread)."""
        while not self._closed:
            with self._lock:
                if len(self._pool) >= self.pool_size:
                    return
            proc = self._start()
            with self._lock:
                if not self._closed:
                    self._pool.append(proc)
                    continue
            proc.kill()

    def _start(self) -> Proc:
        """Start one interpreter, waiting for code on its stdin (call it on :func:`starter`'s
        thread)."""
        scratch, passed = None, []
        if self._bwrap is not None:
            program = seccomp_program()
            if program is not None:
                read, write = os.pipe()
                os.write(write, program)
                os.close(write)
                passed.append(read)
            uid = sandbox_uid()
            argv = bwrap_argv(self.config, self._bwrap, self._as_root, uid, *passed)
            env, cwd = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "/"
        else:
            scratch = tempfile.mkdtemp(prefix="dapo-sandbox-")
            argv = child_argv(self.config, interpreter()[0], -1)
            env, cwd = child_env(self.config, home=scratch), scratch
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=passed,
            )
        finally:
            for fd in passed:
                os.close(fd)
        return Proc(popen, scratch)

    def _communicate(self, proc: Proc, code: bytes, start: float) -> SandboxResult:
        """Send ``code``, collect the output until the interpreter exits or the deadline."""
        io = exchange(proc, code, start + self.config.timeout_s, self.config.max_output_bytes)
        if io.timed_out:
            proc.kill()
        popen = proc.popen
        exit_code = popen.returncode if popen.returncode is not None else popen.poll()
        if self._bwrap is not None and exit_code is not None and 128 < exit_code < 160:
            exit_code = 128 - exit_code  # bwrap reports signal N as exit status 128 + N
        if io.timed_out:
            status, reason = "timeout", f"ran over its deadline of {self.config.timeout_s:g} s"
        elif exit_code == 0:
            status, reason = "ok", ""
        else:
            status, reason = "error", describe_exit(exit_code)
        return SandboxResult(
            status=status,
            exit_code=exit_code,
            stdout=io.stdout.decode("utf-8", "replace"),
            stderr=io.stderr.decode("utf-8", "replace"),
            stdout_truncated=io.stdout_cut,
            stderr_truncated=io.stderr_cut,
            wall_s=time.monotonic() - start,
            reason=reason,
        )
