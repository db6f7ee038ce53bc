"""GEMM peak, model FLOPs of an update and MFU (the roofline's arithmetic, read by
``benchmarks.roofline`` and ``benchmarks.update_throughput``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure_gemm_flops(
    dtype: str = "float32", sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5
) -> dict[int, float]:
    """Median FLOP/s of square ``n x n @ n x n`` matmuls (``2 n^3`` FLOPs each) per size ``n``.

    Each size is run once untimed, then ``repeats`` times; the median time is used.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    out: dict[int, float] = {}
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(DTYPES[dtype])
        b = torch.randn(n, n, generator=gen).to(DTYPES[dtype])
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        out[n] = 2.0 * n**3 / statistics.median(times)
    return out


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Median memory bandwidth in bytes/s of copying a ``num_bytes`` float32 buffer
    (bytes read + bytes written per copy)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2.0 * num_bytes / statistics.median(times)


def matmul_params(config: Any) -> int:
    """``N`` of the formula: non-embedding matmul parameters of a Qwen2/Llama-style decoder plus
    the LM head (vocab x hidden). Norm weights and biases are ignored (negligible FLOPs)."""
    h = config.hidden_size
    q = getattr(config, "head_dim", None) or h // config.num_attention_heads
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    attn = h * heads * q + 2 * h * kv * q + heads * q * h
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attn + mlp) + config.vocab_size * h


def update_model_flops(config: Any, num_sequences: int, seq_len: int) -> float:
    """Model FLOPs of one forward + backward over ``num_sequences`` rows of ``seq_len`` tokens:
    ``6 N D + 12 L H Q S D`` (see ``benchmarks/roofline.py``'s docstring)."""
    q = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = num_sequences * seq_len
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * q * seq_len * tokens
    return 6.0 * matmul_params(config) * tokens + attn


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOP utilisation: ``model_flops / seconds / peak_flops``."""
    return model_flops / max(seconds, 1e-12) / peak_flops


def peak_flops(dtype: str = "float32", quick: bool = False) -> float:
    """The best median GEMM FLOP/s over the measured sizes (the roof MFU is taken against)."""
    sizes = (256, 512, 1024) if quick else (512, 1024, 2048)
    return max(measure_gemm_flops(dtype, sizes, repeats=3 if quick else 5).values())
