"""Threads on a shared machine: the quickstart's warm-up and first 12 updates with 0 and 1
competing busy processes, under the default thread choice (dapo_lightning/threads.py) and
under a fixed 2 threads; and where a second thread starts to pay off, by model size.

Run::

    .venv/bin/python -m benchmarks.threads                 # the quickstart table (4 runs)
    .venv/bin/python -m benchmarks.threads --spin          # + 2 spinning threads (the old default)
    .venv/bin/python -m benchmarks.threads --crossover     # 1 vs 2 threads by parameter count
    .venv/bin/python -m benchmarks.threads --quick         # CI smoke sizes

What is measured:

* **Quickstart** (one fresh ``dapo-lightning fit --config configs/quickstart.yaml
  --trainer.max_steps 12`` per configuration, a new run directory each, so every run writes
  and warms up its model): the warm-up's seconds (its own ``done in X s`` line) and the seconds
  from then to the end of the process (12 updates, their validations, the final checkpoint).
  "busy 1" starts one ``while True: pass`` process before the run and kills it after.
  Configurations: ``default`` (no thread setting: ``--threads auto``, idle OpenMP threads
  sleep), ``2 threads`` (``--threads 2``, still sleeping), and with ``--spin`` ``2 spinning``
  (``OMP_NUM_THREADS=2 OMP_WAIT_POLICY=ACTIVE``: what torch does by itself).
* **Crossover**: forward + backward of a Qwen2-shaped model on a quickstart-sized batch (64 rows
  x 22 tokens) at 1 and at 2 threads, alternating in one process, best of 3 rounds.

The machine is shared: the table prints ``os.getloadavg()`` before and after each run; read the
ratios with it. Outputs ``benchmarks/out/threads[_quick].png`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT, bar_chart, out_dir, print_table

CLI = str(Path(sys.executable).parent / "dapo-lightning")
#: (label, extra CLI arguments, extra environment) of each quickstart configuration.
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "2 threads": (["--threads", "2"], {}),
}
SPIN = ("2 spinning", ([], {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}))
#: (hidden, intermediate, layers) of the crossover's models, smallest = the quickstart's.
SHAPES = [
    (128, 256, 2),
    (192, 384, 2),
    (256, 512, 2),
    (256, 768, 4),
    (384, 1024, 4),
    (512, 1536, 6),
]


def busy_process() -> subprocess.Popen:
    """One process spinning on a core until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_quickstart(label: str, busy: int, updates: int, root: Path) -> dict[str, Any]:
    """One fit of the quickstart config (see the module docstring)."""
    args, env_extra = (dict([SPIN]) | CONFIGS)[label]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(TOKENIZERS_PARALLELISM="false", **env_extra)
    run_dir = root / f"{label.replace(' ', '_')}_busy{busy}"
    argv = [CLI, "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", str(updates),
            "--trainer.default_root_dir", str(run_dir), *args]  # fmt: skip
    load_before = os.getloadavg()[0]
    spinners = [busy_process() for _ in range(busy)]
    try:
        start = time.monotonic()
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        total = time.monotonic() - start
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    warmup = float(re.search(r"create_model_if_missing: done in ([\d.]+) s", proc.stderr)[1])
    threads_line = next(x for x in proc.stderr.splitlines() if x.startswith("threads: "))
    return {"config": label, "busy": busy, "warmup_s": warmup, "updates_s": total - warmup,
            "total_s": total, "load_before": load_before, "load_after": os.getloadavg()[0],
            "threads_line": threads_line}  # fmt: skip


def crossover(repeats: int = 3) -> list[dict[str, Any]]:
    """1 vs 2 threads for forward + backward by model size (see the module docstring)."""
    import dapo_lightning  # noqa: F401 - first: sets OMP_WAIT_POLICY before torch loads

    # isort: split
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rows = []
    for hidden, inter, layers in SHAPES:
        config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                             vocab_size=259, tie_word_embeddings=True)  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        ids = torch.randint(0, 259, (64, 22))
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(repeats):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                model(input_ids=ids).logits.logsumexp(-1).mean().backward()
                best[threads] = min(best[threads], time.perf_counter() - start)
        params = sum(p.numel() for p in model.parameters())
        rows.append({"params": params, "one_s": best[1], "two_s": best[2],
                     "speedup": best[1] / best[2], "load": os.getloadavg()[0]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spin", action="store_true", help="also 2 spinning threads")
    parser.add_argument("--crossover", action="store_true", help="1 vs 2 threads by model size")
    parser.add_argument("--quick", action="store_true", help="CI smoke: 2 updates, idle only")
    args = parser.parse_args(argv)
    suffix = "_quick" if args.quick else ""
    if args.crossover:
        rows = crossover(1 if args.quick else 3)
        print_table("forward + backward, 64 x 22 tokens", ["parameters", "1 thread s",
                    "2 threads s", "speedup", "load"],
                    [[f"{r['params'] / 1e6:.2f}M", r["one_s"], r["two_s"], r["speedup"],
                      r["load"]] for r in rows])  # fmt: skip
        (out_dir() / f"threads_crossover{suffix}.json").write_text(json.dumps(rows, indent=1))
        return rows
    labels = [*CONFIGS, *([SPIN[0]] if args.spin else [])]
    results = []
    with tempfile.TemporaryDirectory(prefix="threads-", dir=out_dir()) as root:
        for busy in (0,) if args.quick else (0, 1):
            for label in labels:
                results.append(run_quickstart(label, busy, 2 if args.quick else 12, Path(root)))
    print_table(
        "quickstart: warm-up and first updates (s)",
        ["config", "busy", "warm-up", "updates", "total", "load before/after"],
        [
            [
                r["config"],
                r["busy"],
                r["warmup_s"],
                r["updates_s"],
                r["total_s"],
                f"{r['load_before']:.1f}/{r['load_after']:.1f}",
            ]
            for r in results
        ],  # fmt: skip
        caption=results[0]["threads_line"],
    )
    names = [f"{r['config']}, busy {r['busy']}" for r in results]
    series = {"warm-up": [r["warmup_s"] for r in results],
              "updates": [r["updates_s"] for r in results]}  # fmt: skip
    bar_chart(out_dir() / f"threads{suffix}.png", "quickstart seconds", names, series, ylabel="s")
    (out_dir() / f"threads{suffix}.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
