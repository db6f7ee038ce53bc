"""A sandbox for model-written code: bubblewrap namespaces, resource limits, a deadline.

* :mod:`dapo_lightning.sandbox.config`: :class:`SandboxConfig`, the settings;
* :mod:`dapo_lightning.sandbox.command`: the bwrap command line and what it isolates;
* :mod:`dapo_lightning.sandbox.runner`: :class:`Sandbox` (a warm pool of sandboxed
  interpreters, ``run(code) -> SandboxResult``) and the start check;
* :mod:`dapo_lightning.sandbox.process`: starting, talking to and killing its processes;
* :func:`shared_sandbox`: one :class:`Sandbox` per settings per process, for environments and
  rewards built once per episode or per worker.

What it blocks and what it does not: docs/environments.md, "The sandbox".
"""

from __future__ import annotations

import threading

from dapo_lightning.sandbox.config import ISOLATIONS, SandboxConfig, as_sandbox_config
from dapo_lightning.sandbox.runner import (
    STATUSES,
    Sandbox,
    SandboxResult,
    SandboxUnavailableError,
    check_isolation,
    describe_exit,
)

_SHARED: dict[tuple[object, ...], Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(config: SandboxConfig) -> Sandbox:
    """This process's :class:`Sandbox` for ``config`` (built, and checked, on first use)."""
    with _SHARED_LOCK:
        sandbox = _SHARED.get(config.key())
        if sandbox is None:
            sandbox = _SHARED[config.key()] = Sandbox(config)
        return sandbox


def close_shared_sandboxes() -> None:
    """Close this process's shared sandboxes (their waiting interpreters are killed); the next
    :func:`shared_sandbox` builds a fresh one. For the end of a run or a test module, so that
    no warm pool outlives what used it."""
    with _SHARED_LOCK:
        sandboxes = list(_SHARED.values())
        _SHARED.clear()
    for sandbox in sandboxes:
        sandbox.close()


__all__ = [
    "close_shared_sandboxes",
    "ISOLATIONS",
    "STATUSES",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "as_sandbox_config",
    "check_isolation",
    "describe_exit",
    "shared_sandbox",
]
