"""The sandbox's settings: one frozen dataclass, every value checked when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from dapo_lightning.checks import (
    ConfigError,
    check_choice,
    check_count,
    check_finite,
    choices_of,
)

#: How model-written code is isolated: ``bwrap`` (bubblewrap namespaces, the default) or
#: ``none`` (a plain child process with the same resource limits: no isolation, warned at start).
#: How the sandbox isolates the code (SandboxConfig.isolation).
Isolation = Literal["bwrap", "none"]
ISOLATIONS = choices_of(Isolation)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed call (``sandbox: {timeout_s, memory_mb, ...}`` in YAML).

    Args:
        timeout_s: Wall-clock deadline of one call, from the moment it starts; past it the
            whole sandbox (every process in it) is killed and the call is a ``timeout``.
        cpu_s: CPU seconds of each process in the sandbox (``RLIMIT_CPU``; SIGXCPU, then
            SIGKILL one second later). None: ``ceil(timeout_s) + 1``, so that the wall
            deadline ends a single-threaded busy loop first.
        memory_mb: Address space of each process in the sandbox (``RLIMIT_AS``), in MiB.
        scratch_mb: Size of the private tmpfs at ``/tmp`` (the working folder and ``$HOME``),
            the only writable place, in MiB.
        max_file_mb: Largest file a process may write (``RLIMIT_FSIZE``), in MiB.
        max_processes: Processes and threads the code may run at once, the interpreter's own
            included (``RLIMIT_NPROC``; a fork or thread bomb stops there).
        max_open_files: Open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: Bytes of stdout and of stderr kept each; the rest is read and
            dropped (``SandboxResult.stdout_truncated``).
        pool_size: Interpreters started ahead and waiting for code (a *warm pool*: a call
            takes one and a replacement starts at once); 0 starts one per call.
        isolation: ``"bwrap"`` (bubblewrap: no network, a read-only view of the interpreter
            only, its own processes, an empty environment) or ``"none"`` (a plain child
            process with the same limits and deadline but no isolation: it sees the files and
            network of the host; a warning at start says so).
        env: Environment variables of the code (the environment is otherwise empty but for
            ``HOME``, ``PATH``, ``LANG``, ``TMPDIR``).

    Raises:
        ConfigError: a value out of range, naming the field (``sandbox.<field>``) and the fix.
    """

    timeout_s: float = 5.0
    cpu_s: float | None = None
    memory_mb: int = 512
    scratch_mb: int = 64
    max_file_mb: int = 16
    max_processes: int = 32
    max_open_files: int = 256
    max_output_bytes: int = 65536
    pool_size: int = 2
    isolation: Isolation = "bwrap"
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite("sandbox.timeout_s", self.timeout_s, "Give the seconds a call may take.")
        if not self.timeout_s > 0:
            raise ConfigError(f"sandbox.timeout_s must be > 0 seconds, got {self.timeout_s}.")
        check_finite("sandbox.cpu_s", self.cpu_s, "Give CPU seconds > 0, or null.", none_ok=True)
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ConfigError(f"sandbox.cpu_s must be > 0 seconds or null, got {self.cpu_s}.")
        check_count("sandbox.memory_mb", self.memory_mb, 64, "MiB of address space")
        check_count("sandbox.scratch_mb", self.scratch_mb, 1, "MiB of /tmp")
        check_count("sandbox.max_file_mb", self.max_file_mb, 1, "MiB per file")
        check_count("sandbox.max_processes", self.max_processes, 2, "processes and threads")
        check_count("sandbox.max_open_files", self.max_open_files, 16, "descriptors")
        check_count("sandbox.max_output_bytes", self.max_output_bytes, 1, "bytes per stream")
        check_count("sandbox.pool_size", self.pool_size, 0, "0: start one per call")
        check_choice("sandbox.isolation", self.isolation, ISOLATIONS)
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str)
            for k, v in self.env.items()
        ):
            raise ConfigError(
                f"sandbox.env must map variable names to text, got {self.env!r}: write "
                "env: {NAME: value}."
            )

    @property
    def cpu_limit_s(self) -> int:
        """``RLIMIT_CPU`` in whole seconds: ``ceil(cpu_s)``, or ``ceil(timeout_s) + 1``
        without it."""
        if self.cpu_s is not None:
            return max(1, math.ceil(self.cpu_s))
        return math.ceil(self.timeout_s) + 1

    def key(self) -> tuple[Any, ...]:
        """A hashable form of the settings (the key of a process's shared sandboxes)."""
        values = [getattr(self, name) for name in self.__dataclass_fields__]
        return tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in values)


def as_sandbox_config(value: Any, where: str = "sandbox") -> SandboxConfig:
    """``value`` as a :class:`SandboxConfig`: one as it is, a mapping of its fields built,
    None the defaults.

    Raises:
        ConfigError: anything else, or a field it does not have (named with ``where``).
    """
    if value is None:
        return SandboxConfig()
    if isinstance(value, SandboxConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(SandboxConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"{where} has no setting {unknown[0]!r}: the settings are "
                f"{sorted(SandboxConfig.__dataclass_fields__)}."
            )
        return SandboxConfig(**value)
    raise ConfigError(
        f"{where} is a group of settings, got {value!r}: write {where}: {{timeout_s: 5, "
        "memory_mb: 512}}."
    )
