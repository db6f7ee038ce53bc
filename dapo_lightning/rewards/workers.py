"""Where a reward runs: a worker process (killable) or a thread of the training process.

Both speak one protocol over their ``conn``: the worker sends ``"ready"`` once it holds the
reward, then answers each job ``(job_id, responses, ground_truths, kw)`` with
``(job_id, "ok", results)`` or ``(job_id, "error", traceback text)``.

* :class:`ProcessWorker` (``data.scoring.in_process: false``): a hung reward is killed with its
  process. The stop signals (:data:`~dapo_lightning.interrupt.STOP_SIGNALS`: SIGTERM, SIGINT,
  SIGHUP, ...) are blocked while it starts and ignored once it runs: a signal sent to the whole process group (SLURM, ``timeout``, Ctrl-C) is the training
  process's to honour; it kills its workers itself. A worker whose parent is gone exits on them.
* :class:`ThreadWorker` (``in_process: true``): the reward runs on a daemon thread, so the
  training process keeps its deadline and its stop checks while the reward hangs. A hung thread
  cannot be killed: it is abandoned (an exception is raised in it, which ends a pure-Python
  loop at its next bytecode; a sleep or a C call ends first). A reward stuck in C code that
  holds the GIL blocks the whole process: score such rewards in worker processes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

from dapo_lightning.checks import ConfigError
from dapo_lightning.interrupt import STOP_SIGNALS, StopRequested, stop_requested

#: Most seconds a fresh worker may take to import the reward before the run fails.
WORKER_START_S = 120.0

#: The worker processes alive in this process (killed at exit, see :func:`_kill_at_exit`).
_LIVE: weakref.WeakSet[ProcessWorker] = weakref.WeakSet()


def _kill_at_exit() -> None:
    """Kill the worker processes still alive when the training process exits (an exception
    that skipped :meth:`RewardRunner.close`): they ignore SIGTERM, so ``multiprocessing``'s own
    exit handler (terminate, then wait) would wait for a hung one forever. Registered after
    that handler (``multiprocessing.util`` is imported first), so it runs before it."""
    for worker in list(_LIVE):
        with contextlib.suppress(Exception):
            worker.kill()


atexit.register(_kill_at_exit)


class WorkerAbandoned(SystemExit):
    """Raised inside an abandoned reward thread (a SystemExit: the thread ends silently)."""


def ended_how(ended: BaseException) -> str:
    """What a reward that ended its scoring with ``SystemExit`` / ``KeyboardInterrupt`` did,
    in words (``"called sys.exit(3)"``, ``"raised KeyboardInterrupt"``)."""
    if isinstance(ended, SystemExit):
        return f"called sys.exit({'' if ended.code is None else repr(ended.code)})"
    return f"raised {type(ended).__name__}"


def worker_loop(conn: Any, reward: Any) -> None:
    """Receive ``(job_id, responses, ground_truths, kw)`` jobs, send the results back; a job
    that raises is answered with its traceback; a reward that calls ``sys.exit`` or raises
    ``KeyboardInterrupt`` is answered with ``(job_id, "ended", what it did)`` and ends the
    loop (it is a bug of the reward, reported at once; no thread traceback). None (or a closed
    pipe) ends the loop."""
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, responses, gts, kw = msg
        try:
            out = reward(responses, gts, **kw)
            conn.send((job_id, "ok", out))
        except WorkerAbandoned:
            raise  # the parent gave up on this thread: end silently
        except Exception:  # noqa: BLE001 - reported to the parent as a failure
            conn.send((job_id, "error", traceback.format_exc(limit=3)))
        except (SystemExit, KeyboardInterrupt) as ended:
            with contextlib.suppress(OSError):
                conn.send((job_id, "ended", ended_how(ended)))
            return


#: What a whole process group or SLURM job step gets (SLURM signals every process of the step,
#: SIGUSR1 before the time limit included; a closed terminal sends SIGHUP): the parent decides,
#: a worker ignores them.
PARENTS_SIGNALS = STOP_SIGNALS


def _process_main(conn: Any, reward: Any, parent: int) -> None:  # pragma: no cover - a child
    """A worker process: the stop signals and SLURM's requeue signal are its parent's (ignored
    while the parent lives), then :func:`worker_loop`."""

    def _on_stop(signum: int, frame: Any) -> None:
        if os.getppid() != parent:  # orphaned: nobody will kill it
            os._exit(128 + signum)

    for sig in PARENTS_SIGNALS:
        signal.signal(sig, _on_stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENTS_SIGNALS)
    worker_loop(conn, reward)


def check_picklable(reward: Any) -> None:
    """Raise :class:`ConfigError` naming the reward and the fix when it cannot be sent to a
    worker process (the ``spawn`` start method pickles it)."""
    try:
        pickle.dumps(reward)
    except Exception as err:  # noqa: BLE001 - TypeError, PicklingError, AttributeError, ...
        raise ConfigError(
            f"reward {type(reward).__name__} cannot be sent to a reward worker process "
            f"(pickling it failed: {err}). Fix: set data.scoring.in_process: true to score in "
            "the training process (on a thread: a hang in C code cannot be cut there), or make "
            "the reward picklable (no locks, open files or lambdas among its attributes; a "
            "module-level class)."
        ) from err


class ProcessWorker:
    """One worker process, started without waiting: it is ``ready`` once its first message
    (sent after it unpickled the reward) arrives."""

    def __init__(self, ctx: Any, reward: Any) -> None:
        self.reward_name = type(reward).__name__
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_process_main, args=(child, reward, os.getpid()), daemon=True
        )
        # blocked across the start (inherited through fork / exec, delivered here afterwards):
        # a process-group SIGTERM must not kill the child before it can ignore it
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, PARENTS_SIGNALS)
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        _LIVE.add(self)
        self.started = time.monotonic()
        self.ready = False
        self.job: tuple[int, list[int], float, float] | None = None  # id, samples, start, limit

    def alive(self) -> bool:
        return self.proc.is_alive()

    def died_how(self) -> str:
        """The worker's end in words: its exit code, or the signal that killed it."""
        self.proc.join(5)  # its pipe can close before is_alive turns False
        code = self.proc.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name} (exit code {code})"
        return f"exit code {code}"

    def check_started(self, now: float) -> None:
        """Raise when the worker died or has not taken the reward within WORKER_START_S: a stop
        request as :class:`StopRequested` (the stop came first), else an error naming the fix."""
        if self.ready or (now - self.started <= WORKER_START_S and self.alive()):
            return
        self.fail_start()

    def fail_start(self) -> None:
        """Raise for a worker that did not start: :class:`StopRequested` when a stop was
        requested meanwhile, else an error telling a hang, a missing ``__main__`` guard or a
        broken import from a kill by a signal (exit code or signal named)."""
        died = None if self.alive() else self.died_how()
        self.kill()
        reason = stop_requested()
        if reason is not None:
            raise StopRequested(reason)
        if died is None:
            raise RuntimeError(
                f"reward worker for {self.reward_name} did not start within "
                f"{WORKER_START_S:.0f} s: check that the reward is picklable and importable in "
                "a fresh process, or set data.scoring.in_process: true."
            )
        raise RuntimeError(
            f"reward worker for {self.reward_name} ended before it started ({died}); its error, "
            "if any, is above. When it says the script re-ran its top level (bootstrapping "
            'phase), put the training code under `if __name__ == "__main__":`; otherwise make '
            "the reward importable and picklable in a fresh process, or set "
            "data.scoring.in_process: true."
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def close(self) -> None:
        """Ask the worker to exit; kill it when it does not within 2 s."""
        with contextlib.suppress(OSError):  # the worker may already be gone
            self.conn.send(None)
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
        self.conn.close()


class _ThreadEnd:
    """The parent's end of a :class:`ThreadWorker`'s channel: ``send`` queues a job for the
    thread; ``recv`` takes the thread's next message (``fileno`` is readable when there is one,
    for :func:`multiprocessing.connection.wait`)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.messages: deque[Any] = deque()
        self._read, self._write = os.pipe()
        self._lock = threading.Lock()  # a post never writes to a closed (reused) descriptor
        self.closed = False

    def fileno(self) -> int:
        return self._read

    def send(self, msg: Any) -> None:
        self.jobs.put(msg)

    def recv(self) -> Any:
        os.read(self._read, 1)
        return self.messages.popleft()

    def post(self, msg: Any) -> None:
        """The thread's send: ignored once the parent closed the channel (abandoned)."""
        with self._lock:
            if not self.closed:
                self.messages.append(msg)
                os.write(self._write, b"m")

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self._read)
                os.close(self._write)


class _ThreadSide:
    """The thread's end of the channel (what :func:`worker_loop` sends and receives on)."""

    def __init__(self, end: _ThreadEnd) -> None:
        self._end = end

    def send(self, msg: Any) -> None:
        self._end.post(msg)

    def recv(self) -> Any:
        return self._end.jobs.get()


class ThreadWorker:
    """A worker thread of the training process (``in_process`` scoring), with the surface of
    :class:`ProcessWorker`; killing it abandons the thread (see the module docstring)."""

    def __init__(self, reward: Any) -> None:
        self.reward_name = type(reward).__name__
        self.conn = _ThreadEnd()
        self.thread = threading.Thread(
            target=worker_loop, args=(_ThreadSide(self.conn), reward), daemon=True,
            name=f"reward-{self.reward_name}",
        )  # fmt: skip
        self.thread.start()
        self.started = time.monotonic()
        self.ready = False
        self.job: tuple[int, list[int], float, float] | None = None

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.conn.closed

    def died_how(self) -> str:
        return "its thread ended"

    def check_started(self, now: float) -> None:
        """A thread holds the reward at once: nothing to check."""

    def fail_start(self) -> None:
        raise RuntimeError(f"reward thread for {self.reward_name} ended before it started.")

    def kill(self) -> None:
        """Abandon the thread: close the channel, raise :class:`WorkerAbandoned` in it."""
        self.conn.close()
        if self.thread.is_alive() and self.thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread.ident), ctypes.py_object(WorkerAbandoned)
            )

    def close(self) -> None:
        self.conn.send(None)
        self.conn.close()


def start_worker(reward: Any, start_method: str | None) -> ProcessWorker | ThreadWorker:
    """A :class:`ThreadWorker` when ``start_method`` is None (in-process scoring), else a
    process started with that ``multiprocessing`` start method."""
    if start_method is None:
        return ThreadWorker(reward)
    return ProcessWorker(mp.get_context(start_method), reward)
