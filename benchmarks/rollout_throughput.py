"""Response-token throughput of the HF and vLLM rollout engines, side by side.

Both engines sample from the same checkpoint, prompts, ``n`` and ``max_tokens``; each cell is
the median over repeats of ``response tokens generated / wall seconds`` (after one warm-up
call per engine). Prints a rich table and writes ``benchmarks/out/rollout_throughput.png``.
Several ``--prompts`` values measure how a call's rate depends on its size (a generation
round's prompt count: dynamic sampling's sized rounds can be small); the table then adds each
size's rate relative to the largest.

Usage::

    python -m benchmarks.rollout_throughput --quick          # < 1 minute on 2 CPU cores
    python -m benchmarks.rollout_throughput --model-path /path/to/ckpt --dtype bfloat16
    # SmolLM2-135M-Instruct on the recipe's chat prompts (folder from make-model):
    python -m benchmarks.rollout_throughput --model-path benchmarks/out/smollm2-135m-instruct \
        --dtype bfloat16 --word-problems --prompts 16 --n 8 16 --max-tokens 128 512
    # rate against round size, vLLM only, the reasoning-gym recipe's n and max_tokens:
    python -m benchmarks.rollout_throughput --model-path runs/smollm2/model --dtype bfloat16 \
        --word-problems --engines vllm --prompts 2 4 8 16 32 --n 8 --max-tokens 32

The HF engine is measured first, before vLLM's CPU worker binds threads and memory in this
process (its log says it reduces torch threads to 1), so vLLM's start cannot handicap it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dapo_lightning.rollout import HFRolloutEngine, RolloutEngine, SamplingConfig, create_engine
from dapo_lightning.testing import make_tiny_checkpoint

OUT_DIR = Path(__file__).parent / "out"


def make_prompts(num_prompts: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` token-id prompts of 8..40 tokens (ids 3..258: the tiny vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (num_prompts,), generator=g)
    return [torch.randint(3, 259, (int(k),), generator=g).tolist() for k in lengths]


def word_problem_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """The SmolLM2 recipe's prompts: word problems through the model's chat template."""
    from dapo_lightning.tasks.word_problems import make_word_problem_rows

    rows = make_word_problem_rows(num_prompts, seed=seed)
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def measure(
    engine: RolloutEngine, prompts: list[list[int]], n: int, max_tokens: int, repeats: int
) -> tuple[float, float]:
    """Median response tokens/s and median seconds per call over ``repeats`` calls."""
    sampling = SamplingConfig(max_tokens=max_tokens)
    rates, secs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, n, sampling)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for group in out for c in group)
        rates.append(tokens / elapsed)
        secs.append(elapsed)
    return statistics.median(rates), statistics.median(secs)


Cell = tuple[str, int, int, int]  # engine, prompts per call, n, max_tokens


def main(argv: list[str] | None = None) -> dict[Cell, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small grid, finishes in < 1 min")
    parser.add_argument("--model-path", default=None, help="checkpoint (default: tiny one)")
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (HF model: same)")
    parser.add_argument("--prompts", type=int, nargs="+", default=None, help="prompts per call")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=None)
    parser.add_argument("--n", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument(
        "--word-problems",
        action="store_true",
        help="prompts: the word-problem task through the model's chat template (real models)",
    )
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM CPU KV cache, GiB")
    args = parser.parse_args(argv)
    sizes = args.prompts or ([4] if args.quick else [16])
    num_prompts = max(sizes)
    repeats = args.repeats or (2 if args.quick else 3)
    lengths = args.max_tokens or ([32] if args.quick else [64, 256])

    from transformers import AutoModelForCausalLM

    tmp = None
    model_path = args.model_path
    if model_path is None:
        tmp = tempfile.TemporaryDirectory()
        model_path = str(make_tiny_checkpoint(Path(tmp.name) / "tiny"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if args.word_problems:
        prompts = word_problem_prompts(tokenizer, num_prompts)
    else:
        prompts = make_prompts(num_prompts)
    dtype = getattr(torch, args.dtype)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[Cell, tuple[float, float]] = {}
    threads: dict[str, int] = {}
    for kind in args.engines:
        if kind == "hf":
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            engine: RolloutEngine = HFRolloutEngine(model, tokenizer, seed=0)
        else:
            engine = create_engine(
                "vllm",
                model_path=model_path,
                dtype=args.dtype,
                seed=0,
                kv_cache_space_gb=args.kv_cache_gb,
            )
        threads[kind] = torch.get_num_threads()
        engine.generate(prompts[:2], 2, SamplingConfig(max_tokens=8))  # warm-up
        for size in sizes:
            for n in args.n:
                for length in lengths:
                    cell = (kind, size, n, length)
                    results[cell] = measure(engine, prompts[:size], n, length, repeats)
        del engine

    print(f"load average at end: {os.getloadavg()}", flush=True)
    _print_table(results, args, repeats, threads)
    _plot(results, args)
    if tmp is not None:
        tmp.cleanup()
    return results


def _print_table(results, args, repeats, threads) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Rollout throughput: prompts x n per call, median of {repeats}, "
        f"dtype {args.dtype}, torch threads {threads}"
    )
    cols = ("prompts", "n", "max_tokens", "engine", "response tok/s", "s / call", "vLLM / HF")
    for col in (*cols, "vs largest call"):
        table.add_column(col, justify="right")
    largest = max(size for _, size, _, _ in results)
    for size, n, length in sorted({cell[1:] for cell in results}):
        hf = results.get(("hf", size, n, length))
        for kind in args.engines:
            rate, sec = results[(kind, size, n, length)]
            speedup = f"{rate / hf[0]:.2f}x" if kind == "vllm" and hf else ""
            top = results[(kind, largest, n, length)][0]
            table.add_row(
                str(size), str(n), str(length), kind, f"{rate:,.0f}", f"{sec:.2f}", speedup,
                f"{rate / top:.2f}x",
            )  # fmt: skip
    Console().print(table)


def _plot(results, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    cells = sorted({cell[1:] for cell in results})
    many = len({size for size, _, _ in cells}) > 1
    labels = [(f"{size} prompts\n" if many else "") + f"n={n}\nT={t}" for size, n, t in cells]
    width = 0.8 / len(args.engines)
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(cells)), 3.5))
    for i, kind in enumerate(args.engines):
        xs = [j + i * width for j in range(len(cells))]
        ax.bar(xs, [results[(kind, *cell)][0] for cell in cells], width, label=kind)
    ax.set_xticks([j + width * (len(args.engines) - 1) / 2 for j in range(len(cells))], labels)
    ax.set_ylabel("response tokens / s")
    ax.set_title("Rollout throughput (median)")
    ax.legend()
    fig.tight_layout()
    path = OUT_DIR / "rollout_throughput.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
