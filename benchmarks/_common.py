"""Shared helpers for the benchmark scripts: timing, memory, fresh-process workers, tables, PNGs.

Conventions every benchmark follows:

* Machines here are noisy (2 shared cores), so a number is the **median of repeats** and
  comparisons are made **side by side in one run**, reported as ratios.
* Peak memory is the **peak resident set size (RSS) of a fresh subprocess** per configuration
  (``getrusage(RUSAGE_SELF).ru_maxrss``): everything the process ever held at once, imports,
  weights, optimizer state and activations included. It is what the OS must provide; it is not
  just torch's allocator view. :func:`run_worker` starts such a process.
* Tables are printed with ``rich``; figures are written as PNG under ``benchmarks/out/``
  (gitignored).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: Where benchmark figures, logs and cached checkpoints go (gitignored).
OUT_DIR = Path(__file__).resolve().parent / "out"
#: The repository root (workers run with it as the working directory).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Marker prefixing the one JSON line a worker prints as its result.
RESULT_MARKER = "@@BENCH_RESULT@@"


def out_dir() -> Path:
    """``benchmarks/out/``, created if missing."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR


def config_callbacks(configs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """``trainer.callbacks`` of CLI config files given in order (the last one that sets the list
    wins, as in LightningCLI: lists are replaced whole, never merged). Relative paths are read
    from :data:`REPO_ROOT`."""
    import yaml

    callbacks: list[dict[str, Any]] = []
    for cfg in configs:
        trainer = yaml.safe_load((REPO_ROOT / cfg).read_text()).get("trainer") or {}
        if trainer.get("callbacks") is not None:
            callbacks = trainer["callbacks"]
    return callbacks


def model_override(configs: Sequence[str | Path], model_dir: str | Path) -> dict[str, Any]:
    """Override-YAML keys that point a run of ``configs`` at the model folder ``model_dir``:
    ``model.init_args.model_name_or_path``, and, when the configs write a tiny model on first
    use (``create_model_if_missing``), that option aimed at the same folder (with its own path
    left in place the CLI would write nothing: the model path would name another folder)."""
    import yaml

    create = None
    for cfg in configs:
        create = yaml.safe_load((REPO_ROOT / cfg).read_text()).get(
            "create_model_if_missing", create
        )
    keys: dict[str, Any] = {"model": {"init_args": {"model_name_or_path": str(model_dir)}}}
    if create is not None:
        kind = create if isinstance(create, str) else create["kind"]
        keys["create_model_if_missing"] = {"kind": kind, "path": str(model_dir)}
    return keys


# ----------------------------------------------------------------------------- timing
def median_time(
    fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1
) -> tuple[float, list[float]]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed (``perf_counter``).

    Returns ``(median seconds, all timed seconds)``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


# ----------------------------------------------------------------------------- memory
def bf16_autocast(enabled: bool = True) -> Any:
    """CPU bf16 autocast as Lightning's ``bf16-mixed`` runs a training step: without the cast
    cache (``cache_enabled=False``; a cached cast would outlive the optimizer steps taken inside
    one context and feed the later updates stale weights). ``enabled=False``: float32."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled, cache_enabled=False)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process, in bytes (from ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


GIB = 1024**3


def generated_steps(series: dict[str, list[tuple[float, float]]], key: str) -> dict[float, float]:
    """``key`` by logged step, for the rollout steps that generated (a step trained only on
    carried-over groups logs its episode metrics as 0 over no episodes)."""
    generated = dict(series.get("data/generated_groups", []))
    return {s: v for s, v in series.get(key, []) if generated.get(s, 1) > 0}


# ----------------------------------------------------------------------------- workers
def emit_result(result: dict[str, Any]) -> None:
    """Print ``result`` as the worker's single JSON result line (read by :func:`run_worker`)."""
    print(RESULT_MARKER + json.dumps(result), flush=True)


def run_worker(
    module: str, payload: dict[str, Any], *, timeout: float = 600.0, log_name: str | None = None
) -> dict[str, Any]:
    """Run ``python -m <module> --worker '<json payload>'`` in a fresh process; return its result.

    The worker must call :func:`emit_result` once. Its output is streamed to
    ``benchmarks/out/<log_name>.log`` (``worker.log`` when no name is given). A failing worker raises
    ``RuntimeError`` with the tail of its output.
    """
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(payload)]
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log = out_dir() / f"{log_name or 'worker'}.log"
    # Streamed to a file (not a pipe) so a long worker's progress lines can be followed live.
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    output = log.read_text()
    lines = [ln for ln in output.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark worker {module} failed (exit {proc.returncode}) for {payload}:\n"
            + output[-4000:]
        )
    return json.loads(lines[-1][len(RESULT_MARKER) :])


# ----------------------------------------------------------------------------- output
def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str = ""
) -> None:
    """Print a ``rich`` table (floats formatted with 3 significant digits)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption or None, show_lines=False)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=max(120, 14 * len(columns))).print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def bar_chart(
    path: Path,
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str,
    log_y: bool = False,
) -> Path:
    """Grouped bar chart: one group per label, one bar per series; written as PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) * max(1, len(series))), 4.5))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [v if v == v else 0.0 for v in values], width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
