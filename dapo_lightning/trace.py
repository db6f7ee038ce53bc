"""Wall-clock spans of a run's phases, per thread, in Chrome's trace event format.

The library marks its phases with :func:`phase`: ``rollout`` (generate, score, filter one
batch), ``update`` (a rollout step's optimizer updates), ``weight push`` (the policy's weights
into the engine), ``validation`` (its engine calls) and ``wait for batch`` (the update waiting
for the one-step-off rollout thread). While a :class:`PhaseRecorder` is active (the
:class:`~dapo_lightning.callbacks.PhaseTrace` callback starts one) each marked block is kept as
one complete event::

    {"name": phase, "ph": "X", "ts": start_us, "dur": end_us - start_us, "pid": pid, "tid": thread}

with ``ts`` in microseconds since the recorder started, plus one ``thread_name`` metadata event
per thread. ``chrome://tracing`` and https://ui.perfetto.dev open the JSON; with
``pipeline: one_step_off`` the rollout thread's ``rollout`` spans lie under the main thread's
``update`` spans. With no recorder active a phase costs one global read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: The recorder phases go to (None: not recording).
_ACTIVE: PhaseRecorder | None = None


class PhaseRecorder:
    """Collects :func:`phase` spans from every thread while active (one at a time per process)."""

    def __init__(self) -> None:
        self.origin_ns = time.perf_counter_ns()
        self.events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int) -> None:
        """One span of ``name`` on the calling thread, from ``start_ns`` to ``end_ns``
        (``time.perf_counter_ns``)."""
        thread = threading.current_thread()
        event = {
            "name": name,
            "ph": "X",
            "ts": (start_ns - self.origin_ns) / 1e3,
            "dur": (end_ns - start_ns) / 1e3,
            "pid": os.getpid(),
            "tid": thread.ident,
        }
        with self._lock:
            self._threads.setdefault(thread.ident or 0, thread.name)
            self.events.append(event)

    def trace(self) -> dict[str, Any]:
        """The Chrome trace: the spans in start order, after a ``thread_name`` event each."""
        with self._lock:
            names = [
                {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid,
                 "args": {"name": name}}
                for tid, name in self._threads.items()
            ]  # fmt: skip
            spans = sorted(self.events, key=lambda e: e["ts"])
        return {"traceEvents": names + spans, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`trace` as JSON to ``path`` (its folder created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.trace()))
        return path

    def __enter__(self) -> PhaseRecorder:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a PhaseRecorder is already recording in this process")
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Record the enclosed block as a span ``name`` on this thread while a
    :class:`PhaseRecorder` is active; otherwise run it as is."""
    recorder = _ACTIVE
    if recorder is None:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        recorder.add(name, start, time.perf_counter_ns())


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The spans of a trace :meth:`PhaseRecorder.write` wrote, each with its thread's name as
    ``"thread"`` (``ts`` and ``dur`` in microseconds)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return [dict(e, thread=names.get(e["tid"], str(e["tid"]))) for e in events if e["ph"] == "X"]
