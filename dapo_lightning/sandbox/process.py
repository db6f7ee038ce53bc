"""The processes of a sandbox: starting them on one long-lived thread, talking to one over
its pipes with a deadline and an output cap (:func:`exchange`), and ending all of them
(:meth:`Proc.kill`)."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: Bytes read from a pipe at a time.
CHUNK = 1 << 16
#: Most seconds to wait for a killed sandbox to be gone.
KILL_WAIT_S = 2.0


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


class Proc:
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


@dataclass(frozen=True)
class Exchange:
    """What :func:`exchange` collected: the kept output, whether each stream was cut, and
    whether the deadline passed first."""

    stdout: bytes
    stderr: bytes
    stdout_cut: bool
    stderr_cut: bool
    timed_out: bool


def exchange(proc: Proc, code: bytes, deadline: float, cap: int) -> Exchange:
    """Write ``code`` to ``proc``'s stdin (then close it) and read its stdout and stderr,
    keeping ``cap`` bytes of each (the rest is read and dropped), until both close and it
    exits, or until ``deadline`` (``time.monotonic()``): then ``timed_out``."""
    popen = proc.popen
    assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
    streams = (popen.stdout.fileno(), popen.stderr.fileno())
    out = {fd: bytearray() for fd in streams}
    cut = dict.fromkeys(streams, False)
    stdin, pending = popen.stdin.fileno(), memoryview(code)
    selector = selectors.DefaultSelector()
    for fd in (*streams, stdin):
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_WRITE if fd == stdin else selectors.EVENT_READ)
    reading, timed_out = set(streams), False
    try:
        while reading:
            proc.find_init()
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=left):
                if key.fd == stdin:
                    try:
                        pending = pending[os.write(stdin, pending) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(stdin)
                        popen.stdin.close()
                    continue
                try:
                    chunk = os.read(key.fd, CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    reading.discard(key.fd)
                    continue
                room = cap - len(out[key.fd])
                out[key.fd] += chunk[: max(room, 0)]
                cut[key.fd] = cut[key.fd] or len(chunk) > room
        if not timed_out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = popen.returncode is None
    finally:
        selector.close()
    return Exchange(bytes(out[streams[0]]), bytes(out[streams[1]]), *cut.values(), timed_out)
