"""The quickstart's learning curve: ``dapo-lightning fit --config configs/quickstart.yaml`` for
several seeds through the real command line, on this machine's CPU.

For each seed the script writes an override YAML moving every path of the run into
``benchmarks/out/quickstart_curve/seed<S>/`` (a fresh run directory, so the tiny checkpoint's
warm-up is part of the measured time), runs the CLI, then reads the run's CSVLogger
``metrics.csv``. Wall-clock times come from :class:`WallClock`, a callback the override adds:
at every validation it appends ``{"step", "val_acc", "wall_s"}`` to ``wall_clock.jsonl``, where
``wall_s`` counts from the moment the script launched the CLI (so it includes Python start-up,
the checkpoint warm-up and every validation). The validation before the first update
gives the initial ``val/acc`` (ValidateAtStart logs it at step -1, i.e. update 0).
The override keeps quickstart.yaml's ``EarlyStopping`` (the run ends at the first validation with
``val/acc`` >= :data:`TARGET`), so the measured run is the one a user gets.
A run that exits with an error is still reported (its exit code is a column).

It prints one row per seed (initial val/acc, optimizer updates and seconds to reach the
target, best and final val/acc, the share of updates where clip-higher clipped
(``update/clipfrac_high`` > 0) and its largest value, total seconds) and writes
``benchmarks/out/quickstart_curve.png``: val/acc against optimizer updates and against
wall-clock seconds.

Usage::

    .venv/bin/python -m benchmarks.quickstart_curve                # seeds 0 1 2, the full config
    .venv/bin/python -m benchmarks.quickstart_curve --quick        # smoke: 1 seed, 2 updates
    .venv/bin/python -m benchmarks.quickstart_curve --seeds 3 4 --max-steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT, out_dir, print_table
from benchmarks._shared.quickstart import (
    QUICKSTART,
    T0_ENV,
    TARGET,
    read_wall_clock,
    val_acc_axes,
    val_curve,
    write_override,
)
from dapo_lightning.plot import Series, find_metrics_csv, read_metrics

#: The wall-clock budget of issue 8 for the whole command (seconds, 2 cores).
BUDGET_S = 300.0


def clipfrac_high(series: Series) -> tuple[float, float]:
    """``(share of the updates with update/clipfrac_high > 0, its largest value)`` of a run's
    metrics: the evidence that clip-higher acts (0, 0 when nothing was logged)."""
    values = [v for _, v in series.get("update/clipfrac_high", [])]
    if not values:
        return 0.0, 0.0
    return sum(v > 0 for v in values) / len(values), max(values)


def run_seed(
    seed: int,
    *,
    quick: bool,
    max_steps: int | None,
    extra: list[str],
    model_dir: Path | None = None,
    name: str = "quickstart_curve",
) -> dict[str, Any]:
    """Run the quickstart for one seed in a fresh directory; return its curve and summary.

    ``model_dir`` reuses an existing checkpoint instead of warming one up in the run directory
    (its time is then not counted)."""
    run_dir = out_dir() / (f"{name}_quick" if quick else name) / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    override = write_override(run_dir, quick=quick, model_dir=model_dir)
    cmd = [
        str(Path(sys.executable).with_name("dapo-lightning")),
        "fit",
        "--config",
        str(REPO_ROOT / QUICKSTART),
        "--config",
        str(override),
        "--seed_everything",
        str(seed),
    ]
    if max_steps is not None:
        cmd += ["--trainer.max_steps", str(max_steps)]
    cmd += extra
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    t0 = time.time()
    env[T0_ENV] = repr(t0)
    with open(run_dir / "fit.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    total_s = time.time() - t0
    if proc.returncode != 0:  # report what it logged, and the error
        tail = (run_dir / "fit.log").read_text()[-1500:]
        print(f"seed {seed}: the fit exited with {proc.returncode}:\n{tail}", file=sys.stderr)
    series = read_metrics(find_metrics_csv(run_dir / "logs"))  # {name: [(step, value)]}
    curve = val_curve(series)
    clock = read_wall_clock(run_dir)
    sanity = [r for r in clock if r["sanity"]]
    wall_by_update = {r["step"]: r["wall_s"] for r in clock if not r["sanity"]}
    timed = [(u, acc, wall_by_update.get(u)) for u, acc in curve]
    # the untrained model's validation: ValidateAtStart's row (update 0), else a sanity check
    start = [(acc, w) for u, acc, w in timed if u == 0] or [
        (r["val_acc"], r["wall_s"]) for r in sanity
    ]
    timed = [t for t in timed if t[0] > 0]
    hit = next(((u, w) for u, acc, w in timed if acc >= TARGET), (None, None))
    clip_share, clip_max = clipfrac_high(series)
    return {
        "seed": seed,
        "initial": start[0][0] if start else None,
        "initial_wall_s": start[0][1] if start else None,
        "curve": timed,
        "updates_to_target": hit[0],
        "seconds_to_target": hit[1],
        "final": curve[-1][1] if curve else None,
        "best": max((acc for _, acc, _ in timed), default=None),
        "clipfrac_high_share": clip_share,
        "clipfrac_high_max": clip_max,
        "total_s": total_s,
        "exit_code": proc.returncode,
        "run_dir": str(run_dir),
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """val/acc against optimizer updates (left) and wall-clock seconds (right), one line a seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_u, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        pts = [(0, r["initial"], r["initial_wall_s"])] if r["initial"] is not None else []
        pts += r["curve"]
        ax_u.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"seed {r['seed']}"
        )
        tp = [p for p in pts if p[2] is not None]
        ax_t.plot(
            [p[2] for p in tp], [p[1] for p in tp], marker="o", ms=3, label=f"seed {r['seed']}"
        )
    for ax, xlabel in ((ax_u, "optimizer updates"), (ax_t, "wall-clock seconds (whole command)")):
        val_acc_axes(ax, xlabel)
        ax.legend()
    ax_t.axvline(BUDGET_S, color="red", ls=":", lw=1)
    fig.suptitle("DAPO quickstart (configs/quickstart.yaml) on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: the first seed, 2 updates, validate each"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="use this existing checkpoint (no warm-up in the run; its time is not counted)",
    )
    parser.add_argument(
        "--name", default="quickstart_curve", help="output name under benchmarks/out/ (variants)"
    )
    args, extra = parser.parse_known_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    max_steps = 2 if args.quick else args.max_steps
    results = []
    for seed in seeds:
        print(f"seed {seed}: running the quickstart ...", flush=True)
        results.append(
            run_seed(
                seed,
                quick=args.quick,
                max_steps=max_steps,
                extra=extra,
                model_dir=args.model_dir,
                name=args.name,
            )
        )
    rows = [
        [
            r["seed"],
            r["initial"],
            r["updates_to_target"] if r["updates_to_target"] is not None else "not reached",
            r["seconds_to_target"] if r["seconds_to_target"] is not None else "-",
            r["best"],
            r["final"],
            f"{r['clipfrac_high_share']:.0%} ({r['clipfrac_high_max']:.2f})",
            r["total_s"],
            r["exit_code"],
        ]
        for r in results
    ]
    print_table(
        f"quickstart: val/acc (target {TARGET}, budget {BUDGET_S:.0f} s)",
        [
            "seed",
            "initial val/acc",
            f"updates to {TARGET}",
            f"seconds to {TARGET}",
            "best val/acc",
            "final val/acc",
            "updates with clipfrac_high > 0 (max)",
            "total s",
            "exit",
        ],
        rows,
    )
    name = f"{args.name}_quick" if args.quick else args.name
    png = out_dir() / f"{name}.png"
    plot(results, png)
    (out_dir() / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {png}")
    try:
        load = os.getloadavg()
        print(f"load average at the end (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    except OSError:
        pass
    return results


if __name__ == "__main__":
    main()
