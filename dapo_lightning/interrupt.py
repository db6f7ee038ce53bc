"""A process-wide stop request: set by a signal handler, polled where the run can stop cleanly.

A signal handler must not save a checkpoint itself (it may fire in the middle of an update);
it only records the request. The places where the state is consistent poll it: between
decode steps of the engines (:func:`should_stop`: the HF engine raises :class:`StopRequested`,
the vLLM engine aborts its requests first), in the reward runner's wait for its workers (it
kills them), between the micro-batches of an update (the partial update is dropped), between
generation rounds (the rollout producer) and between rollout steps
(:class:`~dapo_lightning.callbacks.RunGuard` checks :func:`stop_requested`). A
:class:`StopRequested` raised inside a rollout step discards the step's partial round (the
producer returns to the step's start state, as on any exception); the state of the last
completed update is saved.
The run guard then saves and the command exits with ``128 + signal number`` (143 for SIGTERM,
130 for SIGINT, 129 for SIGHUP), as a shell reports a process killed by that signal (see
docs/design.md, "Stopping and resuming").

Every catchable stop signal is a stop request (:data:`STOP_SIGNALS`): SIGTERM (schedulers,
``timeout``, ``kill``), SIGINT (Ctrl-C), SIGHUP (the terminal or ssh session closed), SIGQUIT
(Ctrl-\\), SIGUSR1 / SIGUSR2 (under ``srun`` SIGUSR1 is SLURM's requeue signal: the same stop,
then a requeue, :mod:`dapo_lightning.slurm`).

:func:`install_stop_handlers` installs the handlers: the first stop signal requests the stop; a
second SIGINT after a first one (Ctrl-C pressed again) before the stop's save starts raises
:class:`AbortRequested` at once, abandoning the update under way; any other later signal is
ignored with one line (the first one is being honoured). Once the save has started
(:func:`saving`) nothing interrupts it, and from the first request until :func:`exit_on_stop`
consumes it no stop signal ends the process early: the handlers stay in place after the guard's
restore, and the handlers they were composed with (Lightning's, put back at the fit's
teardown: :func:`exit_at_once_on_stop_signals`'s, :func:`exit_on_stop`'s) ignore a signal
while a stop is under way (:func:`stopping`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException


class AbortRequested(BaseException):
    """Raised by a second SIGINT (Ctrl-C pressed again): the update under way is abandoned.

    Not a ``KeyboardInterrupt``: Lightning's ``fit`` turns one into exit status 1 (the race of
    issue 53: 130 or 1, by whether the second Ctrl-C came inside ``fit``); :func:`exit_on_stop`
    turns this one into 130 wherever it is raised.
    """

    def __init__(self) -> None:
        super().__init__("Ctrl-C pressed again: aborted at once")


class StopRequested(Exception):
    """Raised at a clean point after a stop was requested (e.g. SIGTERM, SIGINT).

    Args:
        reason: What asked for the stop: a signal name (``"SIGTERM"``) or free text.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"stop requested ({reason})")
        self.reason = reason

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` for a signal (143 for SIGTERM, 130 for SIGINT), else 1."""
        return exit_code(self.reason)


_reason: str | None = None
#: The stop's save is under way (:func:`saving`): no signal interrupts it.
_saving = False
#: The line about a repeated signal was written (once per stop).
_said_again = False

#: The signals that request a stop (see the module docstring).
STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def request_stop(reason: str) -> None:
    """Ask the run to stop at its next clean point (safe to call from a signal handler)."""
    global _reason
    if _reason is None:  # the first reason is the one reported
        _reason = reason


def stop_requested() -> str | None:
    """The reason given to :func:`request_stop`, or None when no stop was requested."""
    return _reason


def should_stop() -> bool:
    """True once a stop was requested: what an engine polls between its decode / engine steps
    (then it raises :class:`StopRequested`, or aborts its requests and raises)."""
    return _reason is not None


def raise_stop() -> None:
    """Raise :class:`StopRequested` for the recorded stop (an engine that saw :func:`should_stop`)."""
    raise StopRequested(_reason or "stop requested")


def clear_stop_request() -> None:
    """Forget a stop request (a new run in the same process starts clean)."""
    global _reason, _said_again
    _reason = None
    _said_again = False


def stopping() -> bool:
    """True from a stop request until it is consumed (:func:`exit_on_stop`): a stop signal
    then changes nothing."""
    return _reason is not None


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """The stop's save (and what decides it): no signal interrupts the block, a second
    Ctrl-C included (it would otherwise raise :class:`AbortRequested`)."""
    global _saving
    outer, _saving = _saving, True
    try:
        yield
    finally:
        _saving = outer


def raise_if_stop_requested() -> None:
    """Raise :class:`StopRequested` when a stop was requested."""
    if _reason is not None:
        raise StopRequested(_reason)


def exit_code(reason: str | None) -> int:
    """The exit status for a run stopped for ``reason``: ``128 + signum`` for a signal name."""
    try:
        return 128 + int(signal.Signals[reason])  # type: ignore[misc]
    except (KeyError, TypeError):
        return 1


#: The handlers that were installed before :func:`install_stop_handlers` (while it is active).
_previous: dict[int, Any] = {}
_active = False
#: The signals :func:`install_stop_handlers` handles now (:data:`STOP_SIGNALS` and its extra).
_signals: tuple[signal.Signals, ...] = STOP_SIGNALS


def _handle(signum: int, frame: FrameType | None) -> None:
    if stopping():
        _again(signum)
        return
    if not _active:  # put back by someone else (Lightning) after the run: act as before
        _call_previous(signum, frame)
        return
    name = signal.Signals(signum).name
    request_stop(name)
    again = "; press Ctrl-C again to abort at once" if signum == signal.SIGINT else ""
    # os.write, not print: a handler may interrupt a print to the same stream
    os.write(
        2, f"\n{name} received: stopping at the next clean point, then saving{again}.\n".encode()
    )


def _again(signum: int) -> None:
    """A stop signal while a stop is under way: Ctrl-C pressed again (after a Ctrl-C) before
    the save aborts; any other is ignored, with one line per stop."""
    global _said_again
    again = signum == signal.SIGINT and _reason == signal.SIGINT.name
    if again and _active and not _saving:
        raise AbortRequested  # pressed again: abandon the update under way
    if not _said_again:
        _said_again = True
        what = "the save under way finishes first" if _saving else "the stop goes on"
        name = signal.Signals(signum).name
        os.write(2, f"\n{name} received while stopping: ignored; {what}.\n".encode())


def _call_previous(
    signum: int, frame: FrameType | None, previous: dict[int, Any] | None = None
) -> None:
    handler = (_previous if previous is None else previous).get(signum, signal.SIG_DFL)
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # SIG_DFL: die of the signal, as without a handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_stop_handlers(extra: tuple[signal.Signals, ...] = ()) -> Callable[[], None]:
    """Make the stop signals (:data:`STOP_SIGNALS` and the ``extra`` ones: SLURM's requeue
    signal, see :mod:`dapo_lightning.slurm`) request a stop (see the module docstring);
    returns a function that puts the previous handlers back. Does nothing outside the main thread (Python delivers
    signals only there).

    Lightning composes an existing SIGTERM handler into its own while ``fit`` runs and puts it
    back afterwards, possibly after the returned function ran; a handler left behind that way
    behaves like the one it replaced.

    Example::

        restore = install_stop_handlers()
        try:
            trainer.fit(module, datamodule=dm)
        finally:
            restore()
    """
    global _active, _signals
    if threading.current_thread() is not threading.main_thread() or _active:
        return lambda: None
    _signals = tuple(dict.fromkeys((*STOP_SIGNALS, *extra)))
    for sig in _signals:
        current = signal.getsignal(sig)
        if current is not _handle:  # ours, left behind by a previous run: keep what it replaced
            _previous[sig] = current
        signal.signal(sig, _handle)
    _active = True

    def restore() -> None:
        global _active
        if not _active:
            return
        _active = False
        if stopping():  # ours stay until the exit: they ignore the signals (module docstring)
            return
        for sig, handler in _previous.items():
            if signal.getsignal(sig) is _handle and handler is not None:
                signal.signal(sig, handler)

    return restore


def reassert_stop_handlers() -> None:
    """Put the stop handlers back on top after someone composed them into their own.

    Lightning's signal connector does so when ``fit`` starts, and its SIGTERM handler runs a
    ``torch.distributed.broadcast`` inside the handler: on several ranks that collective meets
    whatever collective the other ranks are in (an FSDP all-gather, say) and the run hangs
    (seen with 2 FSDP2 ranks). Ours only records the request; the ranks agree at clean points.
    """
    if _active and threading.current_thread() is threading.main_thread():
        for sig in _signals:
            signal.signal(sig, _handle)


def _hold_signals(handler: Callable[[int, FrameType | None], None]) -> dict[int, Any]:
    """Install ``handler`` for :data:`STOP_SIGNALS` (main thread only); the ones it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _put_back(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, handler)


@contextlib.contextmanager
def exit_on_stop() -> Iterator[None]:
    """Exit with :func:`exit_code` when the block was stopped by a stop request: a
    :class:`StopRequested` or Lightning's ``SIGTERMException`` raised out of it (130 for an
    :class:`AbortRequested` or a ``KeyboardInterrupt``: Ctrl-C twice), or a stop
    recorded while it ran and honoured at a clean point (``trainer.should_stop``). The request
    is cleared on the way out.

    Inside, a stop signal that no other handler takes acts as before (it ends the process),
    except while a stop is under way (:func:`stopping`): then it is ignored (a second signal
    never cuts the save or turns the exit status into the second signal's). On the way out the
    handlers are the ones it found (after the fit, Ctrl-C is Ctrl-C again).

    Example::

        with exit_on_stop():
            trainer.fit(module, datamodule=dm)   # SIGTERM: saved, then exit status 143
    """
    before: dict[int, Any] = {}

    def _late(signum: int, frame: FrameType | None) -> None:
        if stopping():
            _again(signum)
        else:
            _call_previous(signum, frame, before)

    before.update(_hold_signals(_late))
    code: int | None = None
    try:
        yield
        reason = stop_requested()
        code = None if reason is None else exit_code(reason)
    except StopRequested as stop:
        code = stop.exit_code
    except SIGTERMException:
        code = exit_code("SIGTERM")
    except (AbortRequested, KeyboardInterrupt):  # Ctrl-C twice, or once with no handler
        code = exit_code("SIGINT")
    finally:
        _put_back(before)  # the handlers as they were (before the request is cleared)
    if code is None:
        return
    clear_stop_request()  # consumed here: later runs in this process start clean
    raise SystemExit(code) from None


#: What a stop before the first update leaves undone (the RunGuard's words for the same).
NOTHING_SAVED = "nothing to save yet (no update was made)"


@contextlib.contextmanager
def exit_at_once_on_stop_signals(outcome: str | Callable[[], str]) -> Iterator[None]:
    """A stop signal (:data:`STOP_SIGNALS`) raises ``SystemExit(128 + signum)`` inside (143 for
    SIGTERM, 130 for SIGINT, 129 for SIGHUP, as a stopped fit exits), after one line saying
    ``outcome`` (what is left undone; a callable is asked when the signal comes): for the
    stretches with nothing to save (a model folder being written, the Trainer built but no
    update made), where a signal's default would end the process without a word (or leave a
    half-written folder behind) and SIGINT's ``KeyboardInterrupt`` would print a traceback.
    Handlers installed inside it (the :class:`~dapo_lightning.callbacks.RunGuard`'s, while
    ``fit`` runs) take over; while a stop is under way (:func:`stopping`: Lightning's teardown
    puts this handler back before the stop's save is over) a signal is ignored. The previous
    handlers are restored after. Nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: FrameType | None) -> None:
        if stopping():  # restored by Lightning's teardown while a stop is saved: ignore
            _again(signum)
            return
        name = signal.Signals(signum).name
        said = outcome() if callable(outcome) else outcome
        # os.write, not print: a handler may interrupt a print to the same stream
        os.write(2, f"\n{name} received: stopped; {said}.\n".encode())
        raise SystemExit(128 + signum)

    previous = _hold_signals(_exit)
    try:
        yield
    finally:
        _put_back(previous)
