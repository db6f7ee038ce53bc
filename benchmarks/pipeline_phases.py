"""Sync against one-step-off on a SmolLM2 recipe, from the runs of ``smollm2_curve.py``: updates
per minute, each phase's median seconds per rollout step, staleness, held-out accuracy over the
budget, and the speed ratio the phase times predict.

Usage (after ``python -m benchmarks.smollm2_curve --methods dapo dapo_one_step_off ... --name NAME``;
several names are read together, e.g. a separate run of ``dapo_one_step_off_fixed``)::

    .venv/bin/python -m benchmarks.pipeline_phases --names rg_share rg_fixed --budget-min 20

The predicted ratios, with G and U a phase's seconds per step on all the cores (the sync run)
and G1, U1 on the one-step-off split (``dapo_one_step_off_fixed``: the update on one of two
cores, generation on the other):

* fixed split: sync's ``G + U + o`` over ``max(G1, U1) + o``;
* shared cores (``share_cores: true``): both phases run on their share until the shorter one
  ends, then the longer one on all the cores: ``G1 + (1 - G1 / U1) * U + o`` when G1 <= U1,
  ``U1 + (1 - U1 / G1) * G + o`` otherwise;
* separate hardware: ``G + U + o`` over ``max(G, U) + o``;

where ``o`` is the rest of sync's step (validation, the weight push, logging): its seconds per
rollout step (training seconds over steps) less ``G + U``.

Held-out accuracy per minute is ``smollm2_curve.mean_over_budget``: the area under ``val/acc``
against wall minutes over the budget, divided by it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._shared.smollm2 import mean_over_budget
from dapo_lightning.plot import find_metrics_csv, read_metrics

OUT = Path(__file__).resolve().parent / "out"
#: The metrics read per rollout step, and how a run's values are summarised.
PHASES = {
    "gen_s": ("time/generation_s", statistics.median),
    "update_s": ("time/update_s", statistics.median),
    "engine_idle_s": ("time/engine_idle_s", statistics.median),
    "staleness": ("data/staleness_mean", statistics.fmean),
}


def run_row(name: str, result: dict[str, Any], budget_min: float) -> dict[str, Any]:
    """One run's table row (``name``: its ``smollm2_curve.py --name``)."""
    series = read_metrics(find_metrics_csv(Path(result["run_dir"]) / "logs"))
    row: dict[str, Any] = {"run": name, "method": result["method"], "seed": result["seed"]}
    for key, (metric, summary) in PHASES.items():
        values = [v for _, v in series.get(metric, [])]
        row[key] = summary(values) if values else float("nan")
    row["updates"] = result["updates"]
    row["step_s"] = result["train_minutes"] * 60 / max(1, len(series.get("time/update_s", [])))
    row["updates_per_min"] = result["updates"] / result["train_minutes"]
    row["mean_acc"] = mean_over_budget(result["curve"], budget_min, "wall")
    row["final"], row["best"] = result["final"], result["best"]
    return row


def bounds(sync: dict[str, Any], fixed: dict[str, Any] | None) -> dict[str, float]:
    """The ratios the phase times predict (module docstring)."""
    g, u, step = sync["gen_s"], sync["update_s"], sync["step_s"]
    rest = max(0.0, step - g - u)
    out = {"separate hardware": step / (max(g, u) + rest)}
    if fixed is not None:
        g1, u1 = fixed["gen_s"], fixed["update_s"]
        out["fixed split"] = step / (max(g1, u1) + rest)
        shared = g1 + (1 - g1 / u1) * u if g1 <= u1 else u1 + (1 - u1 / g1) * g
        out["shared cores"] = step / (shared + rest)
    return out


def main(argv: list[str] | None = None) -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", nargs="+", required=True, help="smollm2_curve.py --name(s)")
    parser.add_argument("--budget-min", type=float, required=True, help="the runs' budget")
    args = parser.parse_args(argv)
    rows = [
        run_row(name, result, args.budget_min)
        for name in args.names
        for result in json.loads((OUT / f"{name}.json").read_text())
    ]
    columns = [
        "run", "method", "seed", "updates", "updates_per_min", "step_s", "gen_s", "update_s", "engine_idle_s",
        "staleness", "mean_acc", "final", "best",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |")
    for sync in (r for r in rows if r["method"] == "dapo"):
        fixed = next(
            (
                r
                for r in rows
                if r["method"] == "dapo_one_step_off_fixed" and r["seed"] == sync["seed"]
            ),
            None,
        )
        for row in rows:
            if row["method"] != "dapo" and row["seed"] == sync["seed"]:
                ratio = row["updates_per_min"] / sync["updates_per_min"]
                name = f"{row['run']}/{row['method']}"
                print(f"seed {sync['seed']}: {name} {ratio:.2f}x sync's updates/min")
        predicted = ", ".join(f"{k} {v:.2f}x" for k, v in bounds(sync, fixed).items())
        print(f"seed {sync['seed']}: predicted from the phase times: {predicted}")


if __name__ == "__main__":
    main()
