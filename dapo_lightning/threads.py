"""How many intra-op threads torch uses, chosen for the cores this process may run on and the
model it trains, and OpenMP threads that sleep instead of spinning while they wait.

Why: on a machine shared with other work, OpenMP worker threads that spin-wait between
parallel regions compete with every other process for the same cores; measured on 2 cores with
one other busy process, the quickstart's warm-up took 135-147 s with 2 spinning threads and
10.5 s with one. A tiny model gains nothing from a second thread even on idle cores (its
matrix products are too small to split); a 135M-parameter model does.

The rule (:func:`choose_threads`), first match wins:

1. an explicit setting (the CLI's ``--threads N``, a config's ``threads: N``);
2. ``OMP_NUM_THREADS``, then ``MKL_NUM_THREADS`` from the environment;
3. ``auto``: 1 thread for a model of at most :data:`SINGLE_THREAD_MAX_PARAMS` parameters,
   otherwise the usable cores (``os.sched_getaffinity``) divided by the processes of this
   machine's run (``trainer.devices`` on CPU), at least 1.

OpenMP's wait policy is read once, when torch's OpenMP runtime (GNU libgomp in the CPU wheels)
loads, i.e. at ``import torch``: :func:`prefer_passive_wait` therefore runs when
``dapo_lightning`` is imported (this module, first) and sets ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is set
or torch was imported first (then it is too late, and the start-up line says so). For the same
reason this module does not import torch at its top: :func:`apply_threads` imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

#: Environment variables that set the thread count, in the order they are honoured.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: ``auto`` uses 1 thread for models of at most this many parameters. The issue's measurement
#: (2 cores, one other busy process): the quickstart's 0.3M model warmed up in 10.5 s on one
#: thread and 135-147 s on two. The crossover by size (``python -m benchmarks.threads
#: --crossover``) could not be measured this session (load 20-24 on 2 cores: noise larger
#: than the effect, benchmarks/RESULTS.md "Threads"); 2M is a conservative bound between the
#: tiny models (0.3M) and the smallest real one (SmolLM2-135M), which uses the cores.
SINGLE_THREAD_MAX_PARAMS = 2_000_000

#: The wait policy :func:`prefer_passive_wait` sets.
PASSIVE = "PASSIVE"

#: What :func:`prefer_passive_wait` found or set when ``dapo_lightning`` was imported.
wait_policy = "OMP_WAIT_POLICY unchecked"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where the OS
    has no affinity call), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def prefer_passive_wait(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` when it is unset and torch is not imported yet; returns
    the policy in effect (also kept in :data:`wait_policy` for the start-up line). A set
    ``GOMP_SPINCOUNT`` (libgomp's spin before sleeping; PASSIVE would make it 0) is the user's
    own wait policy and is kept as it is: docs/running.md, "Threads"."""
    global wait_policy
    if "OMP_WAIT_POLICY" in environ:
        wait_policy = f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    elif "GOMP_SPINCOUNT" in environ:
        wait_policy = f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}"
    elif "torch" in sys.modules:
        wait_policy = "OMP_WAIT_POLICY unset: torch was imported before dapo_lightning"
    else:
        environ["OMP_WAIT_POLICY"] = PASSIVE
        wait_policy = f"OMP_WAIT_POLICY={PASSIVE}"
    return wait_policy


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count and why (see the module docstring)."""

    threads: int
    reason: str

    def line(self) -> str:
        """The start-up line: ``threads: 1 (auto: ...; OMP_WAIT_POLICY=PASSIVE)``."""
        return f"threads: {self.threads} ({self.reason}; {wait_policy})"


def _env_threads(environ: Mapping[str, str]) -> tuple[str, int] | None:
    for name in THREAD_ENV_VARS:
        value = environ.get(name, "").strip()
        if value:
            try:
                count = int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: expected a positive integer.") from None
            if count < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer.")
            return name, count
    return None


def choose_threads(
    num_params: int | None,
    *,
    setting: int | str = "auto",
    processes: int = 1,
    cores: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ThreadChoice:
    """The intra-op thread count by the rule of the module docstring.

    Args:
        num_params: Parameters of the model the process trains; None when unknown (then the
            cores are used).
        setting: ``"auto"`` or a positive thread count (the CLI's ``--threads``).
        processes: Training processes of this run on this machine (each gets its share).
        cores: Usable cores; default :func:`usable_cores`.
        environ: Where ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are read.

    Raises:
        ValueError: ``setting`` is neither ``"auto"`` nor a positive int, or a thread variable
            of the environment is not a positive integer.

    Example::

        choose_threads(300_000, cores=2, environ={})  # ThreadChoice(1, "auto: ...")
    """
    if setting != "auto":
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f"threads must be 'auto' or a positive integer, got {setting!r}.")
        return ThreadChoice(setting, f"threads: {setting} set")
    from_env = _env_threads(environ)
    if from_env is not None:
        return ThreadChoice(from_env[1], f"{from_env[0]}={from_env[1]} from the environment")
    cores = usable_cores() if cores is None else cores
    share = max(1, cores // max(1, processes))
    where = f"{cores} usable cores" + (f" / {processes} processes" if processes > 1 else "")
    if num_params is None:
        return ThreadChoice(share, f"auto: model size unknown, {where}")
    size = f"{num_params / 1e6:.1f}M parameters"
    if num_params <= SINGLE_THREAD_MAX_PARAMS:
        limit = f"{SINGLE_THREAD_MAX_PARAMS / 1e6:g}M"
        return ThreadChoice(1, f"auto: {size}, at most {limit} run fastest on one thread")
    return ThreadChoice(share, f"auto: {size}, {where}")


def count_parameters(model_dir: str | os.PathLike[str]) -> int | None:
    """Parameters of a local model folder, from its safetensors headers (nothing is loaded);
    None when the folder holds no ``*.safetensors`` (a hub id, another format)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is no mapping
                shape = handle.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total if files else None


def apply_threads(
    choice: ThreadChoice, *, export: bool = True, environ: MutableMapping[str, str] = os.environ
) -> None:
    """Use ``choice.threads`` in this process; with ``export``, also as ``OMP_NUM_THREADS`` of
    the processes it starts (rank processes, reward workers) unless the variable is set."""
    import torch  # not at the top: see the module docstring

    torch.set_num_threads(choice.threads)
    if export:
        environ.setdefault("OMP_NUM_THREADS", str(choice.threads))


def configure_threads(
    model: str | os.PathLike[str] | int | None, *, setting: int | str = "auto", processes: int = 1
) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and apply (:func:`apply_threads`) the thread count for
    ``model`` (a local folder, a parameter count, or None when unknown), as the CLI does.

    Example::

        print(configure_threads("runs/quickstart/model").line())  # threads: 1 (auto: 0.3M ...)
    """
    num_params = model if isinstance(model, int) or model is None else count_parameters(model)
    choice = choose_threads(num_params, setting=setting, processes=processes)
    apply_threads(choice)
    return choice


# At import (dapo_lightning/__init__.py imports this module first, before torch): see the
# module docstring.
prefer_passive_wait()
