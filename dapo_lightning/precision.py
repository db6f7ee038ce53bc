"""Precision that fits the machine: ``trainer.precision: auto`` and the engines' ``dtype: auto``.

bf16 halves memory traffic and runs fast where the hardware has bf16 arithmetic; on a CPU
without it torch emulates bf16 GEMMs, and they can be ~70x slower than float32 (AMD EPYC with
AVX2 only, torch 2.13: 0.6 GFLOP/s bf16 against 43 GFLOP/s float32 at 1024 x 1024). So ``auto``
decides from the device's capabilities (:func:`decide_bf16`, a pure function of
:class:`DeviceCaps`):

* CUDA: bf16 when ``torch.cuda.is_bf16_supported()`` (Ampere and newer), else float32;
* CPU: bf16 when the CPU flags (``/proc/cpuinfo`` on Linux) have ``avx512_bf16`` or
  ``amx_bf16``, or torch's CPU capability (``torch.backends.cpu.get_cpu_capability()``) names
  AMX; else float32.

``auto`` becomes ``"bf16-mixed"`` / ``"32-true"`` for the trainer (the CLI resolves it before the
Trainer is built) and ``"bfloat16"`` / ``"float32"`` for an engine; one line on stderr says which
and why. An explicit bf16 setting on a CPU without bf16 hardware is kept, with one warning per
process that gives the measured slowdown (:func:`measure_bf16_slowdown`: a 256 x 256 GEMM in
both dtypes, on one thread) and the fix (``auto`` or float32).
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

#: CPU flags (``/proc/cpuinfo``) that mean native bf16 arithmetic.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

#: The value that asks for the decision.
AUTO = "auto"

#: Trainer precisions that compute in bf16.
BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16")

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class DeviceCaps:
    """What the decision looks at.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        cuda_bf16: ``torch.cuda.is_bf16_supported()`` (False without CUDA).
        cpu_flags: The CPU's feature flags (lower case; empty where unknown).
        cpu_capability: ``torch.backends.cpu.get_cpu_capability()`` (e.g. ``"AVX2"``).
    """

    device: Device
    cuda_bf16: bool = False
    cpu_flags: frozenset[str] = frozenset()
    cpu_capability: str = ""


@dataclass(frozen=True)
class Decision:
    """The outcome: ``bf16`` or not, and why (one phrase)."""

    bf16: bool
    reason: str


def decide_bf16(caps: DeviceCaps) -> Decision:
    """bf16 or float32 for ``caps`` (see the module docstring for the rule).

    Example::

        decide_bf16(DeviceCaps("cpu", cpu_flags=frozenset({"avx2"}))).bf16  # False
    """
    if caps.device == "cuda":
        if caps.cuda_bf16:
            return Decision(True, "CUDA device with bf16 support")
        return Decision(False, "CUDA device without bf16 support (pre-Ampere)")
    found = [f for f in CPU_BF16_FLAGS if f in caps.cpu_flags]
    if found:
        return Decision(True, f"CPU with native bf16 ({', '.join(found)})")
    if "AMX" in caps.cpu_capability.upper():
        return Decision(True, f"CPU with native bf16 (torch capability {caps.cpu_capability})")
    capability = caps.cpu_capability or "unknown"
    return Decision(
        False,
        f"CPU without avx512_bf16/amx_bf16 (torch capability {capability}): bf16 would be emulated",
    )


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The ``flags`` of the first processor in ``path``; empty when it is unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.lower().split())
    return frozenset()


def device_caps(device: Device) -> DeviceCaps:
    """This machine's :class:`DeviceCaps` for ``device``."""
    if device == "cuda":
        return DeviceCaps("cuda", cuda_bf16=bool(torch.cuda.is_bf16_supported()))
    return DeviceCaps(
        "cpu",
        cpu_flags=read_cpu_flags(),
        cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
    )


def accelerator_device(accelerator: object) -> Device:
    """The device a trainer ``accelerator`` setting trains on: ``"gpu"`` / ``"cuda"`` (or a
    CUDA accelerator object) -> ``"cuda"``, ``"auto"`` -> ``"cuda"`` when CUDA is available,
    anything else -> ``"cpu"``."""
    value = accelerator if isinstance(accelerator, str) else type(accelerator).__name__
    value = value.lower()
    if value in ("gpu", "cuda") or "cuda" in value:
        return "cuda"
    if value == "auto" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _say(what: str, value: str, decision: Decision) -> None:
    print(f"{what}: auto -> {value} ({decision.reason})", file=sys.stderr, flush=True)


def resolve_trainer_precision(precision: object, accelerator: object = "auto") -> object:
    """``trainer.precision``: ``"auto"`` -> ``"bf16-mixed"`` or ``"32-true"`` (one line says
    which and why); any other value is returned as it is (a bf16 one on a CPU without bf16
    hardware warns, see :func:`warn_if_slow_bf16`)."""
    device = accelerator_device(accelerator)
    if precision != AUTO:
        if str(precision) in BF16_PRECISIONS:
            warn_if_slow_bf16(device, f"trainer.precision={precision}")
        return precision
    decision = decide_bf16(device_caps(device))
    value = "bf16-mixed" if decision.bf16 else "32-true"
    _say("trainer.precision", value, decision)
    return value


def resolve_dtype(dtype: str, device: Device, what: str = "dtype") -> str:
    """An engine's ``dtype``: ``"auto"`` -> ``"bfloat16"`` or ``"float32"`` (one line says which
    and why); any other value is returned as it is (``"bfloat16"`` on a CPU without bf16
    hardware warns)."""
    if dtype != AUTO:
        if dtype == "bfloat16":
            warn_if_slow_bf16(device, f"{what}=bfloat16")
        return dtype
    decision = decide_bf16(device_caps(device))
    value = "bfloat16" if decision.bf16 else "float32"
    _say(what, value, decision)
    return value


def measure_bf16_slowdown(size: int = 256, repeats: int = 2) -> float:
    """How many times longer a ``size`` x ``size`` GEMM takes in bf16 than in float32 on this
    CPU: best of ``repeats`` after one warm-up each, on one thread (a multi-threaded timing on
    shared, busy cores measures the neighbours; the torch thread count is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
            a @ b
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            times[dtype] = best
    finally:
        torch.set_num_threads(threads)
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


#: Settings already warned about in this process.
_WARNED: set[str] = set()


def warn_if_slow_bf16(device: Device, setting: str) -> None:
    """Warn (once per setting and process) when ``setting`` asks for bf16 on a CPU without bf16
    hardware, with the measured slowdown."""
    if device != "cpu" or setting in _WARNED:
        return
    decision = decide_bf16(device_caps("cpu"))
    if decision.bf16:
        return
    _WARNED.add(setting)
    warnings.warn(
        f"{setting} on a {decision.reason}: a bf16 GEMM measured {measure_bf16_slowdown():.0f}x "
        "slower than float32 here. Fix: set it to auto (float32 on this machine) or to "
        "float32 / 32-true.",
        stacklevel=3,
    )


#: Per device type: the backend whose float32 matmuls may round their inputs, to what, and for
#: which compute dtypes that rounding is no coarser than the compute dtype's own.
_REDUCED_FLOAT32_GEMM = {
    "cpu": ("mkldnn", "bf16", (torch.bfloat16,)),
    "cuda": ("cuda", "tf32", (torch.bfloat16, torch.float16)),
}


@contextlib.contextmanager
def reduced_input_float32_gemm(device_type: str, compute_dtype: torch.dtype) -> Iterator[None]:
    """While active, float32 matmuls on ``device_type`` round their inputs (CPU, for a bf16
    ``compute_dtype``: to bf16 through oneDNN, ``torch.backends.mkldnn.matmul.fp32_precision =
    "bf16"``, kept float32 on a CPU without bf16 instructions; CUDA, for bf16 / fp16: to TF32 on
    tensor cores) and return float32 (sums in float32 on this AVX512-bf16 CPU; on CI's CPU the
    error reaches a bf16 GEMM's). Any other case: no change. Used for ``dL/dW`` under autocast: its
    error is no worse than the autocast head's own bf16 GEMM, the chunks accumulate in float32,
    and it runs at the reduced-precision rate (measured here: 17 ms instead of 32 ms per
    170-row chunk, V = 49152; the CUDA branch is not run on these machines)."""
    backend, precision, dtypes = _REDUCED_FLOAT32_GEMM.get(device_type, (None, None, ()))
    matmul = getattr(getattr(torch.backends, backend, None), "matmul", None) if backend else None
    usable = compute_dtype in dtypes and matmul is not None
    if not usable or (backend == "mkldnn" and not torch.backends.mkldnn.is_available()):
        yield
        return
    previous = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = previous
