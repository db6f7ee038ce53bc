"""Running code in the sandbox: :class:`Sandbox` (a warm pool of sandboxed interpreters) and
:class:`SandboxResult` (what one call gives back).

A call takes a waiting interpreter (or starts one), writes the code to its stdin and reads
its stdout and stderr (each kept up to ``max_output_bytes``; the rest is read and dropped, so
a program that prints without end cannot stall), until the interpreter exits or the wall
deadline ``timeout_s`` passes. Then the sandbox's process group is killed (under bwrap the pid
namespace goes with it: every process the code started dies, daemons included) and reaped.
A replacement interpreter is started when a call takes one from the pool, so the next call
finds one ready.

The sandbox is checked when it is built (:func:`check_isolation`): where ``bwrap`` is missing
or cannot make its namespaces, building it raises :class:`SandboxUnavailableError` (one
``error:`` line in the CLI) naming the cause and the fix; ``isolation: none`` is the explicit
way to run without isolation, and says so in a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
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
from dapo_lightning.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)

#: The statuses of a call.
STATUSES = ("ok", "error", "timeout")
#: Bytes read from a pipe at a time.
_CHUNK = 1 << 16
#: Most seconds to wait for a killed sandbox to be gone.
KILL_WAIT_S = 2.0


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


def first_child(pid: int) -> int | None:
    """The first child of process ``pid`` (``/proc/PID/task/PID/children``), None if none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def process_state(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc/PID/stat`` (state ``"Z"``: a
    zombie, done), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


class _Proc:
    """One started interpreter (under bwrap: bwrap, whose one child is the pid namespace's
    init, whose child is the interpreter) and, under ``isolation: none``, its scratch folder."""

    def __init__(self, popen: subprocess.Popen[bytes], scratch: str | None) -> None:
        self.popen = popen
        self.scratch = scratch
        self.init: tuple[int, int] | None = None  # the namespace's init: pid, start time

    def find_init(self) -> None:
        """Note the namespace's init (bwrap's child) once it exists."""
        if self.init is None and self.scratch is None:
            pid = first_child(self.popen.pid)
            state = process_state(pid) if pid is not None else None
            if pid is not None and state is not None:
                self.init = (pid, state[1])

    def kill(self) -> None:
        """End every process of the sandbox, reap them, remove the scratch folder.

        Under bwrap the namespace's init is killed (the kernel then kills every process of
        the namespace) and waited for: it is done (a zombie, or gone) only once every process
        of the namespace is gone. bwrap itself may exit earlier (it passes on the code's exit
        status as soon as init reports it). Then bwrap's process group (the whole sandbox
        under ``isolation: none``, which has no namespace) is killed and bwrap reaped.
        """
        if self.popen.poll() is None:
            self.find_init()
        if self.init is not None:
            pid, started = self.init
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if process_state(pid) is not None and process_state(pid)[1] == started:
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=KILL_WAIT_S)
        if self.init is not None:
            give_up = time.monotonic() + KILL_WAIT_S
            while time.monotonic() < give_up:
                state = process_state(self.init[0])
                if state is None or state[1] != self.init[1] or state[0] in "ZX":
                    break
                time.sleep(0.001)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


_STARTER: tuple[int, ThreadPoolExecutor] | None = None
_STARTER_LOCK = threading.Lock()


def starter() -> ThreadPoolExecutor:
    """The one long-lived thread that starts this process's sandboxes.

    ``--die-with-parent`` kills a sandbox when the *thread* that started bwrap ends (the
    kernel's parent-death signal follows the thread), so a sandbox started from a short-lived
    thread (a thread pool's, an episode's call thread) would be killed while it waits in the
    pool. A forked child of this process gets a thread of its own.
    """
    global _STARTER
    with _STARTER_LOCK:
        if _STARTER is None or _STARTER[0] != os.getpid():
            _STARTER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="sandbox-starter"))
        return _STARTER[1]


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
                "sandbox: bubblewrap (bwrap) is not installed, and model-written code is run "
                "only inside it. Fix: bash scripts/setup.sh as root installs it (or apt-get "
                "install -y bubblewrap, dnf install bubblewrap); or set sandbox.isolation: none "
                "to run the code without isolation (unsafe)."
            )
        result = Sandbox(config, pool_size=0, checked=True).run("print('sandbox-ok')")
        if result.status != "ok" or result.stdout.strip() != "sandbox-ok":
            said = (result.stderr.strip().splitlines() or [result.reason or result.status])[-1]
            raise SandboxUnavailableError(
                f"sandbox: bwrap cannot start a sandbox here ({said[:300]}; {result.reason}). "
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
        from dapo_lightning.sandbox.config import as_sandbox_config

        self.config = as_sandbox_config(config)
        self.pool_size = self.config.pool_size if pool_size is None else pool_size
        if not checked:
            check_isolation(self.config)
        self._bwrap = shutil.which("bwrap") if self.config.isolation == "bwrap" else None
        self._as_root = os.geteuid() == 0
        self._pool: deque[_Proc] = deque()
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
        start = time.monotonic()
        with self._lock:
            proc = self._pool.popleft() if self._pool else None
        if proc is None:
            proc = starter().submit(self._start).result()
        starter().submit(self._fill)  # a replacement, started while this call runs
        try:
            result = self._communicate(proc, code.encode("utf-8", "replace"), start)
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

    def _start(self) -> _Proc:
        """Start one interpreter, waiting for code on its stdin (call it on :func:`starter`'s
        thread)."""
        scratch = None
        if self._bwrap is not None:
            argv = bwrap_argv(self.config, self._bwrap, self._as_root, sandbox_uid())
            env, cwd = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "/"
        else:
            scratch = tempfile.mkdtemp(prefix="dapo-sandbox-")
            argv = child_argv(self.config, interpreter()[0], -1)
            env, cwd = child_env(self.config, home=scratch), scratch
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        return _Proc(popen, scratch)

    def _communicate(self, proc: _Proc, code: bytes, start: float) -> SandboxResult:
        """Send ``code``, collect the output until the interpreter exits or the deadline."""
        cap = self.config.max_output_bytes
        deadline = start + self.config.timeout_s
        popen = proc.popen
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        stdout_fd, stderr_fd = popen.stdout.fileno(), popen.stderr.fileno()
        out = {stdout_fd: bytearray(), stderr_fd: bytearray()}
        cut = dict.fromkeys(out, False)
        selector = selectors.DefaultSelector()
        for fd in out:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        stdin = popen.stdin.fileno()
        os.set_blocking(stdin, False)
        pending = memoryview(code)
        selector.register(stdin, selectors.EVENT_WRITE)
        open_fds = set(out) | {stdin}
        timed_out = False
        try:
            while out.keys() & open_fds:
                proc.find_init()
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=left):
                    fd = key.fd
                    if fd == stdin:
                        try:
                            pending = pending[os.write(fd, pending) :]
                        except (BrokenPipeError, BlockingIOError) as err:
                            if isinstance(err, BlockingIOError):
                                continue
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(fd)
                            popen.stdin.close()
                            open_fds.discard(fd)
                        continue
                    try:
                        chunk = os.read(fd, _CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    room = cap - len(out[fd])
                    out[fd] += chunk[: max(room, 0)]
                    cut[fd] = cut[fd] or len(chunk) > room
            if not timed_out:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                timed_out = popen.returncode is None
        finally:
            selector.close()
        if timed_out:
            proc.kill()
        exit_code = popen.returncode if popen.returncode is not None else popen.poll()
        if self._bwrap is not None and exit_code is not None and 128 < exit_code < 160:
            exit_code = 128 - exit_code  # bwrap reports signal N as exit status 128 + N
        if timed_out:
            status, reason = "timeout", f"ran over its deadline of {self.config.timeout_s:g} s"
        elif exit_code == 0:
            status, reason = "ok", ""
        else:
            status, reason = "error", describe_exit(exit_code)
        return SandboxResult(
            status=status,
            exit_code=exit_code,
            stdout=bytes(out[stdout_fd]).decode("utf-8", "replace"),
            stderr=bytes(out[stderr_fd]).decode("utf-8", "replace"),
            stdout_truncated=cut[stdout_fd],
            stderr_truncated=cut[stderr_fd],
            wall_s=time.monotonic() - start,
            reason=reason,
        )
