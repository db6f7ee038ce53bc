"""``dapo-lightning plot RUN_DIR``: one PNG with a panel per metric family of a run.

A run directory is what a CSVLogger writes (``save_dir/name``); every resume adds a
``version_*`` folder to it, and the plot merges them all in step order (where a resumed version
starts over at an earlier step, its points replace the older version's from that step on).

``dapo-lightning validate`` logs into a folder of its own (the logger's name plus
``-validate``, e.g. ``runs/quickstart/logs-validate/``): given a folder above both, ``plot``
draws the fit's logs and never merges a validation into them; point it at the ``-validate``
folder (or a ``metrics.csv`` in it) to draw that.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import math
import sys
from pathlib import Path
from typing import Any

#: ``{metric: [(step, value), ...]}``, as read from CSVLogger files.
Series = dict[str, list[tuple[float, float]]]

#: Panels: (title, metric names or ``fnmatch`` patterns drawn in it, in drawing order).
#: Missing metrics are skipped; empty panels say so.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("validation accuracy", ("val/acc", "val/pass@*")),
    ("rollout reward / accuracy", ("rollout/reward_mean", "rollout/score_mean", "rollout/acc")),
    ("response length", ("rollout/response_length_mean", "rollout/response_length_max")),
    ("entropy", ("update/entropy",)),
    ("clip fractions", ("update/clipfrac_high", "update/clipfrac_low", "update/dual_clipfrac")),
    ("KL old->new", ("update/approx_kl_k1", "update/approx_kl_k3")),
    ("gradient norm", ("update/grad_norm",)),
    ("learning rate", ("update/lr",)),
    ("tokens per second", ("rollout/tokens_per_second",)),
    ("dynamic sampling", ("data/zero_variance_frac", "rollout/truncation_rate")),
    ("seconds per rollout step", ("time/generation_s", "time/update_s")),
)

#: Line styles of the 1st, 2nd, ... series of a panel: each later line is thinner and dashed
#: differently, so a line that coincides with an earlier one (the shaped reward and the raw
#: score without reward shaping) still shows on top of it.
LINE_STYLES: tuple[tuple[str, float], ...] = (("-", 3.0), ("--", 1.8), (":", 1.4), ("-.", 1.2))


def _version_key(path: Path) -> tuple[int, float]:
    suffix = path.parent.name.removeprefix("version_")
    return (0, int(suffix)) if suffix.isdigit() else (1, path.stat().st_mtime)


#: The suffix ``dapo-lightning validate`` gives its logger's folder (see the module docstring).
VALIDATE_LOG_SUFFIX = "-validate"


def _is_validate_log(relative: Path) -> bool:
    return any(part.endswith(VALIDATE_LOG_SUFFIX) for part in relative.parts[:-1])


def find_metrics_csvs(run_dir: str | Path) -> list[Path]:
    """Every ``metrics.csv`` of one run, oldest ``version_*`` first.

    ``run_dir`` may be a ``metrics.csv`` itself (just that file), a CSVLogger run folder
    (``save_dir/name``, holding ``version_*/``), or a folder above one: then the run of the
    newest ``metrics.csv`` is taken, a fit's before any ``validate`` log (module docstring).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or holds no ``metrics.csv``.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(
            f"{run_dir} does not exist: give the run directory of a fit (its "
            "trainer.default_root_dir, e.g. runs/quickstart) or one of its metrics.csv files."
        )
    if run_dir.is_file():
        return [run_dir]
    found = list(run_dir.rglob("metrics.csv"))
    if not found:
        raise FileNotFoundError(
            f"No metrics.csv under {run_dir}: point `dapo-lightning plot` at the run directory "
            "of a fit that used a CSVLogger (trainer.logger)."
        )
    fits = [p for p in found if not _is_validate_log(p.relative_to(run_dir))]
    newest = max(fits or found, key=lambda p: p.stat().st_mtime)
    if not newest.parent.name.startswith("version_"):
        return [newest]
    root = newest.parent.parent
    versions = [
        p for p in found if p.parent.parent == root and p.parent.name.startswith("version_")
    ]
    return sorted(versions, key=_version_key)


def find_metrics_csv(run_dir: str | Path) -> Path:
    """The newest ``metrics.csv`` of the run at ``run_dir`` (see :func:`find_metrics_csvs`)."""
    return find_metrics_csvs(run_dir)[-1]


def read_metrics(path: str | Path) -> Series:
    """``{metric: [(step, value), ...]}`` from one CSVLogger file (empty cells skipped)."""
    series: Series = {}
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


def merge_versions(parts: list[Series]) -> Series:
    """One series from the versions of a run, oldest first.

    A version's points replace the older versions' points at and after its first step (a resume
    from an earlier checkpoint repeats those steps); the result is sorted by step.
    """
    merged: Series = {}
    for part in parts:
        steps = [step for points in part.values() for step, _ in points]
        if not steps:
            continue
        start = min(steps)
        merged = {name: [p for p in points if p[0] < start] for name, points in merged.items()}
        for name, points in part.items():
            merged.setdefault(name, []).extend(points)
    return {name: sorted(points, key=lambda p: p[0]) for name, points in merged.items() if points}


def read_run_metrics(run_dir: str | Path) -> Series:
    """The merged metrics of every ``version_*`` of the run at ``run_dir``."""
    return merge_versions([read_metrics(p) for p in find_metrics_csvs(run_dir)])


def panel_names(series: Series, names: tuple[str, ...]) -> list[str]:
    """The metrics of ``series`` a panel draws: its names in order, patterns expanded (sorted
    by the number in them, so ``val/pass@4`` comes before ``val/pass@16``)."""
    out: list[str] = []
    for name in names:
        matches = [k for k in series if fnmatch.fnmatchcase(k, name) and series[k]]
        matches.sort(key=lambda k: (len(k), k))
        out.extend(m for m in matches if m not in out)
    return out


def panel_coverage(series: Series) -> dict[str, list[str]]:
    """``{panel title: [metric names of that panel present in series]}`` for :data:`PANELS`."""
    return {title: panel_names(series, names) for title, names in PANELS}


def missing_panels(series: Series) -> dict[str, tuple[str, ...]]:
    """Panels with no series at all, each with the metric names it looked for."""
    names = dict(PANELS)
    return {title: names[title] for title, found in panel_coverage(series).items() if not found}


def draw_run(series: Series, title: str = "") -> Any:
    """A matplotlib figure of :data:`PANELS` for ``series`` (empty panels carry a note)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows))
    for ax, (panel, found) in zip(axes.flat, panel_coverage(series).items()):
        for i, name in enumerate(found):
            xs, ys = zip(*series[name])
            style, width = LINE_STYLES[i % len(LINE_STYLES)]
            marker = "." if len(xs) < 50 else None
            ax.plot(xs, ys, linestyle=style, linewidth=width, marker=marker, label=name)
        ax.set_title(panel)
        ax.set_xlabel("optimizer update (global_step)")
        if found:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw :data:`PANELS` for the run's metrics (all its versions); returns the PNG path.

    Panels whose metrics the run did not log are drawn empty with a note (and listed by
    ``dapo-lightning plot`` on stderr). ``out`` defaults to ``RUN_DIR/metrics.png`` (beside the
    CSV when given a file).
    """
    import matplotlib.pyplot as plt

    files = find_metrics_csvs(run_dir)
    if out is None:
        out = (Path(run_dir).parent if Path(run_dir).is_file() else Path(run_dir)) / "metrics.png"
    out = Path(out)
    shown = files[0] if len(files) == 1 else f"{files[0].parent.parent} ({len(files)} versions)"
    fig = draw_run(merge_versions([read_metrics(p) for p in files]), f"dapo-lightning run: {shown}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_main(argv: list[str]) -> None:
    """``dapo-lightning plot RUN_DIR [--out PNG]``: prints the PNG path; empty panels on stderr.
    A missing or empty run directory is one ``error:`` line, exit status 2."""
    parser = argparse.ArgumentParser(prog="dapo-lightning plot", description=__doc__)
    parser.add_argument("run_dir", help="run directory (or a metrics.csv) of a fit")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except FileNotFoundError as err:
        parser.exit(2, f"dapo-lightning plot: error: {err}\n")
    for title, names in missing_panels(read_run_metrics(args.run_dir)).items():
        print(f"panel {title!r}: none of {list(names)} was logged", file=sys.stderr)
    print(path)
