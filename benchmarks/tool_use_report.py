"""Curves of agent-RL runs (``benchmarks/smollm2_curve.py --recipe tool_use``): held-out accuracy
and tool use against CPU minutes (the cold start included), and the training episodes' tool use
and turns against updates.

Each run is a run folder of ``smollm2_curve.py`` (``clock.jsonl``: val/acc and CPU seconds per
validation; ``logs/version_*/metrics.csv``: ``val/tool_use_frac``, ``env/tool_use_frac``,
``env/turns_mean``) with a label and the cold start it started from (the folder ``dapo-lightning
sft`` wrote: its ``<folder>-logs/sft_summary.json`` gives the CPU seconds, added in front of the
run's minutes; ``-``: no cold start). Prints a table and writes a PNG.

Usage::

    .venv/bin/python -m benchmarks.tool_use_report \\
        "cold start + DAPO, seed 0=benchmarks/out/tool_use_s0/dapo/seed0@runs/smollm2_tool_use/sft_seed0" \\
        "cold start + DAPO, seed 1=benchmarks/out/tool_use_s1/dapo/seed1@runs/smollm2_tool_use/sft_seed1" \\
        --cold-start-only runs/smollm2_tool_use/sft_56_seed0@VALIDATE_RUN_DIR ... \\
        --out docs/img/smollm2_tool_use.png

A cold start alone is scored by ``dapo-lightning validate --config configs/smollm2_tool_use.yaml
--model.init_args.model_name_or_path SFT_DIR --trainer.default_root_dir VALIDATE_RUN_DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks._common import generated_steps, print_table
from dapo_lightning.plot import find_metrics_csv, read_metrics


def cold_start_cpu_s(model_dir: str) -> float:
    """The CPU seconds ``dapo-lightning sft`` spent writing ``model_dir`` (0 for ``-``)."""
    if model_dir in ("", "-"):
        return 0.0
    path = Path(model_dir)
    summary = path.parent / f"{path.name}-logs" / "sft_summary.json"
    return float(json.loads(summary.read_text())["cpu_s"])


def read_tool_run(run_dir: Path, offset_s: float) -> dict[str, Any]:
    """One run's validations ``(cpu min incl. cold start, updates, val/acc, val tool use)`` and
    training steps ``(updates, env/tool_use_frac, env/turns_mean)``."""
    clock = [json.loads(x) for x in (run_dir / "clock.jsonl").read_text().splitlines()]
    series = read_metrics(find_metrics_csv(run_dir / "logs"))
    # a validation after update s is logged at step s - 1 (the one at the start at -1)
    val_tool = {int(s) + 1: v for s, v in series.get("val/tool_use_frac", [])}
    val = [
        ((offset_s + r["train_cpu_s"]) / 60, r["step"], r["val_acc"], val_tool.get(r["step"]))
        for r in clock
        if r["val_acc"] is not None
    ]
    use = generated_steps(series, "env/tool_use_frac")
    turns = generated_steps(series, "env/turns_mean")
    steps = [(int(s) + 1, use[s], turns.get(s)) for s in sorted(use)]
    return {"val": val, "steps": steps, "cold_start_min": offset_s / 60}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR@COLD_START_MODEL_DIR (or @-)")
    parser.add_argument(
        "--cold-start-only",
        nargs="*",
        default=[],
        metavar="[LABEL=]MODEL_DIR@VALIDATE_DIR",
        help="cold starts without RL: the sft folder and the run folder of `dapo-lightning "
        "validate` on it (its val/acc and val/tool_use_frac), drawn against their CPU minutes, "
        "one line per LABEL (default: more cold start, no RL)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/tool_use.png"))
    parser.add_argument(
        "--title", default="SmolLM2-135M-Instruct learns to use a calculator for 2-digit products"
    )
    args = parser.parse_args(argv)
    alone = []
    for spec in args.cold_start_only:
        label, _, spec = spec.rpartition("=")
        model, _, validate_dir = spec.partition("@")
        metrics = read_metrics(find_metrics_csv(Path(validate_dir) / "logs-validate"))
        alone.append(
            (
                cold_start_cpu_s(model) / 60,
                metrics["val/acc"][-1][1],
                metrics["val/tool_use_frac"][-1][1],
                Path(model).name,
                label or "more cold start, no RL",
            )
        )
    if alone:
        print_table(
            "cold start only (no RL): held-out val/acc and tool use",
            ["model", "CPU min", "val/acc", "val tool use"],
            [[name, round(m, 1), a, t] for m, a, t, name, _ in alone],
        )
    runs = {}
    for spec in args.runs:
        label, rest = spec.split("=", 1)
        run_dir, _, model = rest.partition("@")
        runs[label] = read_tool_run(Path(run_dir), cold_start_cpu_s(model or "-"))
    rows = []
    for label, run in runs.items():
        first, last = run["val"][0], run["val"][-1]
        rows.append(
            {
                "run": label,
                "cold start CPU min": round(run["cold_start_min"], 1),
                "val/acc at start": first[2],
                "val/acc at end": last[2],
                "best": max(v[2] for v in run["val"]),
                "updates": last[1],
                "CPU min in all": round(last[0], 1),
                "val tool use at end": last[3],
                "train tool use, last step": run["steps"][-1][1] if run["steps"] else None,
            }
        )
    columns = list(rows[0])
    print_table(
        "agent RL: held-out accuracy and tool use", columns, [[r[c] for c in columns] for r in rows]
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"
        minutes = [v[0] for v in run["val"]]
        axes[0].plot(minutes, [v[2] for v in run["val"]], "o-", color=color, label=label)
        tool = [(v[0], v[3]) for v in run["val"] if v[3] is not None]
        if tool:
            axes[1].plot(*zip(*tool), "o-", color=color, label=label)
        if run["cold_start_min"]:
            axes[0].axvspan(0, run["cold_start_min"], color=color, alpha=0.08)
        if run["steps"]:
            ups, use, turns = zip(*run["steps"])
            axes[2].plot(ups, use, "o-", color=color, label=f"{label}: calling")
            axes[2].plot(
                ups, [(t or 0) / 3 for t in turns], "x--", color=color, label=f"{label}: turns / 3"
            )
    for j, label in enumerate(dict.fromkeys(a[4] for a in sorted(alone))):
        points = sorted(a for a in alone if a[4] == label)
        style = ("k^:", "s:", "D:")[min(j, 2)]
        color = "k" if j == 0 else f"C{len(runs) + j}"
        for ax, k in ((axes[0], 1), (axes[1], 2)):
            ax.plot([a[0] for a in points], [a[k] for a in points], style, color=color, label=label)
    axes[0].set(
        xlabel="CPU minutes, cold start included (shaded)",
        ylabel="held-out val/acc",
        ylim=(0, 1.02),
    )
    axes[1].set(xlabel="CPU minutes", ylabel="held-out episodes calling the tool", ylim=(0, 1.02))
    axes[2].set(
        xlabel="optimizer updates",
        ylabel="training episodes: share calling, turns/3",
        ylim=(0, 1.02),
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.title} (CPU)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
