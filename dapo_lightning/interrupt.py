"""A process-wide stop request: set by a signal handler, polled where the run can stop cleanly.

A signal handler must not save a checkpoint itself (it may fire in the middle of an update);
it only records the request. The places where the state is consistent poll it: between
generation rounds (the rollout producer calls :func:`raise_if_stop_requested`) and between
optimizer updates (the run guard checks :func:`stop_requested`).
"""

from __future__ import annotations


class StopRequested(Exception):
    """Raised at a clean point after a stop was requested (e.g. SIGTERM, SIGINT)."""


_reason: str | None = None


def request_stop(reason: str) -> None:
    """Ask the run to stop at its next clean point (safe to call from a signal handler)."""
    global _reason
    _reason = reason


def stop_requested() -> str | None:
    """The reason given to :func:`request_stop`, or None when no stop was requested."""
    return _reason


def clear_stop_request() -> None:
    """Forget a stop request (a new run in the same process starts clean)."""
    global _reason
    _reason = None


def raise_if_stop_requested() -> None:
    """Raise :class:`StopRequested` when a stop was requested."""
    if _reason is not None:
        raise StopRequested(_reason)
