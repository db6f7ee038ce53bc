"""Environment code run under the call timeout and the stop checks.

Every call into an environment (its constructor, ``reset``, ``step``) runs on a daemon thread
while the caller waits at most ``environment.call_timeout_s``, looking at the stop request
(:mod:`dapo_lightning.interrupt`) every :data:`STOP_POLL_S`: a constructor that takes a minute
(a tool server that does not answer) or a ``step`` that hangs never holds the fit, and a
SIGTERM stops it within a fraction of a second. A call past its limit is abandoned (its
thread cannot be killed; the environment object is no longer used).

* :func:`call_all`: several calls at once (one per episode); a fault is data (the episode
  fails);
* :func:`build_environment`: one environment, for the run's own use (the tool list, the
  declared metric names): a constructor past the limit or raising is an
  :class:`EnvironmentFailureError` naming the setting to fix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dapo_lightning.interrupt import raise_if_stop_requested

#: Longest wait between two looks at a stop request while an environment call runs.
STOP_POLL_S = 0.25


class EnvironmentFailureError(RuntimeError):
    """The environment failed the run: too many episodes of one generation failed in it, or
    it could not be built (the message names the setting to fix; the CLI's one ``error:``
    line, exit 2)."""


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[tuple[str, Any]]:
    """Run ``calls`` concurrently in daemon threads; per call ``("ok", value)``,
    ``("error", exception)`` or ``("timeout", None)`` once ``timeout_s`` has passed (a hung
    call's thread is abandoned, its environment no longer used).

    Raises:
        StopRequested: a stop was requested while the calls ran (looked at every
            :data:`STOP_POLL_S`); the calls still running are abandoned.
    """
    out: list[tuple[str, Any]] = [("timeout", None)] * len(calls)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - an environment fault is data
            out[i] = ("error", err)

    threads = [
        threading.Thread(target=run, args=(i, fn), daemon=True, name=f"env-call-{i}")
        for i, fn in enumerate(calls)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            t.join(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
            raise_if_stop_requested()
    raise_if_stop_requested()
    return [r if not t.is_alive() else ("timeout", None) for r, t in zip(out, threads)]


def error_text(err: Any) -> str:
    """An environment call's exception as one line: ``"TypeName: message"``."""
    return f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else str(err)


def build_environment(make: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """``make()`` (an environment's constructor) under ``timeout_s`` and the stop checks.

    Raises:
        EnvironmentFailureError: it ran over ``timeout_s`` (the message names
            ``environment.call_timeout_s`` and the fix).
        TypeError, ...: what the constructor raised, as it raised it.
        StopRequested: a stop was requested meanwhile.
    """
    ((status, value),) = call_all([make], timeout_s)
    if status == "ok":
        return value
    if status == "error":
        raise value
    raise EnvironmentFailureError(
        f"environment {name!r} took more than environment.call_timeout_s={timeout_s:g} s to "
        "build (its constructor did not return). Fix: make the constructor fast (connect to a "
        "tool server or load data lazily, in reset), or raise environment.call_timeout_s."
    )
