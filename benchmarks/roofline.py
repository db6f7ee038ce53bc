"""Roofline of this CPU: measured GEMM FLOP/s (float32, bfloat16), memory bandwidth, and the
model-FLOP formula used to turn an update's time into model FLOP utilisation (MFU).

Run::

    .venv/bin/python -m benchmarks.roofline [--quick]

Prints a table and writes ``benchmarks/out/roofline.png`` (attainable FLOP/s against arithmetic
intensity, with the measured GEMM points). :func:`measure_gemm_flops`, :func:`update_model_flops`
and :func:`mfu` are imported by ``update_throughput.py`` to put MFU in its table.

Model FLOPs of one optimizer update (forward + backward, PaLM appendix B convention)::

    FLOPs = 6 * N * D + 12 * L * H * Q * S * D
      N  matmul parameters: non-embedding parameters + the LM head (vocab x hidden; counted once
         even when tied to the input embedding, whose lookup is free)
      D  tokens processed (sequences x sequence length, padding included: it is computed)
      L  layers, H query heads, Q head dim, S sequence length (attention scores and values,
         counted as full, non-causal attention)

The recomputed forward of gradient checkpointing is *not* model work (it is hardware work), so
MFU = FLOPs / seconds / peak GEMM FLOP/s does not credit it.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import bar_chart, out_dir, print_table
from benchmarks._shared.flops import (
    DTYPES,
    measure_bandwidth,
    measure_gemm_flops,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per size")
    args = parser.parse_args(argv)
    sizes = (128, 256, 512) if args.quick else (256, 512, 1024, 2048, 3072)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )

    results = {dt: measure_gemm_flops(dt, sizes, repeats) for dt in DTYPES}
    bandwidth = measure_bandwidth(64 * 2**20 if args.quick else 512 * 2**20, repeats)
    rows = []
    for n in sizes:
        f32, bf16 = results["float32"][n], results["bfloat16"][n]
        rows.append([f"{n}x{n}", f32 / 1e9, bf16 / 1e9, bf16 / f32])
    peak = {dt: max(v.values()) for dt, v in results.items()}
    rows.append(
        [
            "peak (best size)",
            peak["float32"] / 1e9,
            peak["bfloat16"] / 1e9,
            peak["bfloat16"] / peak["float32"],
        ]
    )
    print_table(
        "Square GEMM throughput (median of repeats)",
        ["size", "float32 GFLOP/s", "bfloat16 GFLOP/s", "bf16 / fp32"],
        rows,
        caption=f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; ridge point (fp32) "
        f"{peak['float32'] / bandwidth:.1f} FLOP/byte",
    )

    # Roofline figure: attainable = min(peak, bandwidth * intensity).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [2.0**k for k in range(-2, 11)]
    for dt, color in (("float32", "tab:blue"), ("bfloat16", "tab:orange")):
        item = 4 if dt == "float32" else 2
        ax.plot(
            xs, [min(peak[dt], bandwidth * x) / 1e9 for x in xs], color=color, label=f"roof {dt}"
        )
        pts = [(2 * n**3 / (3 * n * n * item), results[dt][n] / 1e9) for n in sizes]
        ax.scatter(
            *zip(*pts), color=color, marker="o", label=f"GEMM {dt} (n={sizes[0]}..{sizes[-1]})"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"CPU roofline ({torch.get_num_threads()} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir() / ("roofline_quick.png" if args.quick else "roofline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    bar_chart(
        out_dir() / ("gemm_quick.png" if args.quick else "gemm.png"),
        "Square GEMM GFLOP/s",
        [str(n) for n in sizes],
        {dt: [results[dt][n] / 1e9 for n in sizes] for dt in DTYPES},
        ylabel="GFLOP/s",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
