"""``dapo-lightning plot RUN_DIR``: one PNG with a panel per metric family of a finished run."""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

#: Panels: (title, metric names drawn in it). Missing metrics are skipped; empty panels say so.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("validation accuracy", ("val/acc", "val/pass@4", "val/pass@8")),
    ("rollout reward / accuracy", ("rollout/acc", "rollout/reward_mean", "rollout/score_mean")),
    ("response length", ("rollout/response_length_mean", "rollout/response_length_max")),
    ("entropy", ("update/entropy",)),
    ("clip fractions", ("update/clipfrac_high", "update/clipfrac_low", "update/dual_clipfrac")),
    ("KL old->new", ("update/approx_kl_k1", "update/approx_kl_k3")),
    ("gradient norm", ("update/grad_norm",)),
    ("dynamic sampling", ("data/zero_variance_frac", "rollout/truncation_rate")),
    ("seconds per rollout step", ("time/generation_s", "time/update_s")),
)


def find_metrics_csv(run_dir: str | Path) -> Path:
    """The newest ``metrics.csv`` under ``run_dir`` (CSVLogger writes ``version_*/metrics.csv``)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"No metrics.csv under {run_dir}: point `dapo-lightning plot` at the run directory "
            "of a fit that used a CSVLogger (trainer.logger)."
        )
    return found[-1]


def read_metrics(path: str | Path) -> dict[str, list[tuple[float, float]]]:
    """``{metric: [(step, value), ...]}`` from a CSVLogger file (empty cells skipped)."""
    series: dict[str, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = float(row.get("step") or 0)
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                try:
                    series.setdefault(key, []).append((step, float(value)))
                except ValueError:
                    continue
    return series


def panel_coverage(
    series: dict[str, list[tuple[float, float]]],
) -> dict[str, list[str]]:
    """``{panel title: [metric names of that panel present in series]}`` for :data:`PANELS`."""
    return {title: [n for n in names if series.get(n)] for title, names in PANELS}


def missing_panels(series: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[str, ...]]:
    """Panels with no series at all, each with the metric names it looked for."""
    names = dict(PANELS)
    return {title: names[title] for title, found in panel_coverage(series).items() if not found}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw :data:`PANELS` for the run's metrics; returns the PNG path.

    Panels whose metrics the run did not log are drawn empty with a note (and listed by
    ``dapo-lightning plot`` on stderr).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path = find_metrics_csv(run_dir)
    series = read_metrics(csv_path)
    if out is None:  # beside the run (or beside the CSV when given a file)
        out = (Path(run_dir).parent if Path(run_dir).is_file() else Path(run_dir)) / "metrics.png"
    out = Path(out)
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows))
    for ax, (title, names) in zip(axes.flat, PANELS):
        drawn = False
        for name in names:
            points = series.get(name)
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("optimizer update (global_step)")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(
                0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes
            )
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    fig.suptitle(f"dapo-lightning run: {csv_path}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_main(argv: list[str]) -> None:
    """``dapo-lightning plot RUN_DIR [--out PNG]``: prints the PNG path; empty panels on stderr."""
    parser = argparse.ArgumentParser(prog="dapo-lightning plot", description=__doc__)
    parser.add_argument("run_dir", help="run directory (or a metrics.csv) of a finished fit")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    path = plot_run(args.run_dir, args.out)
    for title, names in missing_panels(read_metrics(find_metrics_csv(args.run_dir))).items():
        print(f"panel {title!r}: none of {list(names)} was logged", file=sys.stderr)
    print(path)
