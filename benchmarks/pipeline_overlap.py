"""Sync against one-step-off rollouts on the quickstart: seconds per rollout step and what the
run learns, side by side in one run, through the real command line on this machine's CPU.

For each seed the script runs ``dapo-lightning fit --config configs/quickstart.yaml`` twice,
back to back (a change of load hits both alike): with ``data.dynamic_sampling.pipeline: sync``
(the default) and ``one_step_off``, on one shared tiny checkpoint (written by the first run,
then reused). The override is quickstart_curve.py's (every path under
``benchmarks/out/pipeline_overlap/<mode>/seed<S>/``, its ``WallClock`` for val/acc against
wall seconds) plus :class:`StepClock`, which writes the wall time of every rollout step's end.
The quickstart's ``EarlyStopping`` stays: a run ends when val/acc reaches 0.9, as a user's does.

It prints one row per run: the median seconds per rollout step (the differences of consecutive
step ends; a step followed by a validation is left out), the median of the trainer's wait for
its batch (``time/trainer_wait_s``) and of the generation and update seconds, the updates and
training seconds to val/acc >= 0.9 (from the end of the initial validation), the best and final
val/acc, the mean staleness, the run's peak resident memory (its largest process); then per seed
the ratios sync / one_step_off of the median seconds per step and of the seconds to 0.9. It writes
``benchmarks/out/pipeline_overlap.png``: val/acc against training seconds and against updates,
sync solid, one_step_off dashed; and ``benchmarks/out/pipeline_overlap_trace.png``: 3 rollout
steps from the middle of the first seed's runs, one row per thread (the trainer's main thread,
the rollout thread), from each run's :class:`~dapo_lightning.callbacks.PhaseTrace` (the Chrome
traces stay beside the runs, ``<mode>/seed<S>/logs/version_0/phase_trace.json``).

Usage::

    .venv/bin/python -m benchmarks.pipeline_overlap                      # seeds 0 1 2
    .venv/bin/python -m benchmarks.pipeline_overlap --seeds 0 --max-steps 100
    .venv/bin/python -m benchmarks.pipeline_overlap --quick              # smoke: 1 seed, 4 updates
    .venv/bin/python -m benchmarks.pipeline_overlap --modes sync one_step_off one_step_off_icepop
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

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
from dapo_lightning.plot import find_metrics_csv, read_metrics

#: The runs compared (``--modes``), the baseline first: the pipeline and extra CLI arguments.
MODES: dict[str, tuple[str, list[str]]] = {
    "sync": ("sync", []),
    "one_step_off": ("one_step_off", []),
    # the stale correction's alternatives (model.loss.rollout_correction)
    "one_step_off_tis1": (
        "one_step_off",
        ["--model.init_args.loss.rollout_correction.stale_tis_cap", "1.0"],
    ),
    # carried-over groups (2 steps old when trained on) dropped: only one-step-old groups
    "one_step_off_fresh": (
        "one_step_off",
        ["--data.init_args.dynamic_sampling.max_staleness", "1"],
    ),
    "one_step_off_icepop": (
        "one_step_off",
        ["--model.init_args.loss.rollout_correction.mode", "icepop"],
    ),
    # configs/one_step_off.yaml as shipped (plain PPO on the stale samples, TIS cap 1.0)
    "one_step_off_config": (
        "one_step_off",
        ["--config", str(REPO_ROOT / "configs" / "one_step_off.yaml")],
    ),
}


class StepClock(pl.Callback):
    """Appends ``{"t": time.time(), "kind": "step" | "validation"}`` to ``path`` at the end of
    every rollout step and of every validation, one JSON line each."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: pl.Trainer, kind: str) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "kind": kind}) + "\n")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        self._write(trainer, "step")

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        self._write(trainer, "validation")


def step_seconds(run_dir: Path) -> list[float]:
    """Seconds between consecutive rollout-step ends with no validation between them."""
    path = run_dir / "step_clock.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [
        b["t"] - a["t"]
        for a, b in zip(rows, rows[1:])
        if a["kind"] == "step" and b["kind"] == "step"
    ]


def median_of(series: dict[str, list[tuple[float, float]]], name: str) -> float | None:
    values = [v for _, v in series.get(name, [])]
    return statistics.median(values) if values else None


def run_mode(
    mode: str, seed: int, *, model_dir: Path, max_steps: int | None, quick: bool, root: Path
) -> dict[str, Any]:
    """One quickstart run with ``pipeline: mode``; its step times, curve and summary."""
    run_dir = root / mode / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    override = write_override(run_dir, quick=quick, model_dir=model_dir)
    config = yaml.safe_load(override.read_text())
    config["trainer"]["callbacks"] += [
        {
            "class_path": "benchmarks.pipeline_overlap.StepClock",
            "init_args": {"path": str(run_dir / "step_clock.jsonl")},
        },
        {"class_path": "dapo_lightning.callbacks.PhaseTrace"},  # logs/version_0/phase_trace.json
    ]
    pipeline, extra = MODES[mode]
    config.setdefault("data", {}).setdefault("init_args", {})["dynamic_sampling"] = {
        "pipeline": pipeline
    }
    override.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [
        str(Path(sys.executable).with_name("dapo-lightning")), "fit",
        "--config", str(REPO_ROOT / QUICKSTART), "--config", str(override),
        "--seed_everything", str(seed),
    ]  # fmt: skip
    if max_steps is not None:
        cmd += ["--trainer.max_steps", str(max_steps)]
    cmd += extra
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    t0 = time.time()
    env[T0_ENV] = repr(t0)
    with open(run_dir / "fit.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # the run's resources (its largest process)
    returncode = os.waitstatus_to_exitcode(status)
    if returncode != 0:
        print(f"{mode} seed {seed}: exit {returncode}\n{(run_dir / 'fit.log').read_text()[-1500:]}")
    series = read_metrics(find_metrics_csv(run_dir / "logs"))
    clock = {r["step"]: r["wall_s"] for r in read_wall_clock(run_dir) if not r["sanity"]}
    start_s = clock.get(0, 0.0)  # the end of the initial validation: training starts
    curve = [(u, acc, clock.get(u, float("nan")) - start_s) for u, acc in val_curve(series)]
    trained = [c for c in curve if c[0] > 0]
    hit = next(((u, s) for u, acc, s in trained if acc >= TARGET), (None, None))
    steps = step_seconds(run_dir)
    traces = sorted(run_dir.glob("logs/*/phase_trace.json"))
    return {
        "mode": mode, "seed": seed, "exit_code": returncode, "curve": curve,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "trace": str(traces[-1]) if traces else None,
        "step_s": statistics.median(steps) if steps else None,
        "steps": len(series.get("rollout/step", [])),
        "wait_s": median_of(series, "time/trainer_wait_s"),
        "gen_s": median_of(series, "time/generation_s"),
        "update_s": median_of(series, "time/update_s"),
        "staleness": median_of(series, "data/staleness_mean"),
        "updates_to_target": hit[0], "seconds_to_target": hit[1],
        "best": max((acc for _, acc, _ in trained), default=None),
        "final": trained[-1][1] if trained else None,
    }  # fmt: skip


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """val/acc against training seconds (left) and optimizer updates (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(11, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r in results:
        style = {"sync": "-", "one_step_off": "--"}.get(r["mode"], ":")
        colour = colours[r["seed"] % len(colours)]
        label = f"{r['mode']} seed {r['seed']}"
        ax_t.plot(
            [c[2] for c in r["curve"]], [c[1] for c in r["curve"]], style, c=colour, label=label
        )
        ax_u.plot(
            [c[0] for c in r["curve"]], [c[1] for c in r["curve"]], style, c=colour, label=label
        )
    for ax, xlabel in ((ax_t, "training seconds"), (ax_u, "optimizer updates")):
        val_acc_axes(ax, xlabel)
    ax_u.legend(fontsize=7)
    fig.suptitle("quickstart: sync (solid) vs one_step_off (dashed) rollouts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: Colour of each phase in the trace plot.
PHASE_COLOURS = {
    "rollout": "tab:blue",
    "update": "tab:orange",
    "weight push": "tab:green",
    "wait for batch": "tab:gray",
    "validation": "tab:purple",
}


def trace_window(spans: list[dict[str, Any]], steps: int = 3) -> tuple[float, float]:
    """(start, end) in microseconds of ``steps`` consecutive rollout steps in the middle of
    the run: from the start of one update span to the end of the update ``steps`` later, the
    first such window with no validation in it."""
    updates = sorted((s for s in spans if s["name"] == "update"), key=lambda s: s["ts"])
    validations = [s for s in spans if s["name"] == "validation"]
    for i in range(len(updates) // 2, len(updates) - steps):
        start, end = updates[i]["ts"], updates[i + steps]["ts"]
        if not any(start < v["ts"] < end for v in validations):
            return start, end
    raise ValueError(f"no {steps} rollout steps without a validation in the trace")


def plot_trace(results: list[dict[str, Any]], path: Path) -> None:
    """One row per thread (the trainer's main thread, the rollout thread) for each mode of the
    first seed: a few rollout steps in the middle of the run, phases coloured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from dapo_lightning.trace import read_spans

    seed = results[0]["seed"]
    runs = [r for r in results if r["seed"] == seed and r.get("trace")]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.3 + 1.1 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        spans = read_spans(r["trace"])
        start, end = trace_window(spans)
        threads = sorted({s["thread"] for s in spans}, key=lambda t: t != "MainThread")
        for row, thread in enumerate(threads):
            for s in spans:
                if s["thread"] == thread and s["ts"] < end and s["ts"] + s["dur"] > start:
                    ax.broken_barh(
                        [((s["ts"] - start) / 1e3, s["dur"] / 1e3)], (row - 0.4, 0.8),
                        color=PHASE_COLOURS.get(s["name"], "black"),
                    )  # fmt: skip
        ax.set_yticks(range(len(threads)))
        ax.set_yticklabels(["trainer" if t == "MainThread" else "rollout thread" for t in threads])
        ax.set_xlim(0, (end - start) / 1e3)
        ax.set_title(f"{r['mode']} (seed {seed}): 3 rollout steps", fontsize=9)
    axes[-1, 0].set_xlabel("milliseconds")
    fig.legend(
        handles=[Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()],
        loc="upper right", fontsize=7, ncol=len(PHASE_COLOURS),
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer updates per run")
    parser.add_argument("--quick", action="store_true", help="smoke: first seed, 4 updates")
    parser.add_argument(
        "--modes", nargs="+", choices=sorted(MODES), default=["sync", "one_step_off"]
    )
    args = parser.parse_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    max_steps = 4 if args.quick else args.max_steps
    name = "pipeline_overlap_quick" if args.quick else "pipeline_overlap"
    root = out_dir() / name
    model_dir = root / "model"
    results = [
        run_mode(mode, seed, model_dir=model_dir, max_steps=max_steps, quick=args.quick, root=root)
        for seed in seeds
        for mode in args.modes
    ]
    rows = [
        [r["mode"], r["seed"], r["exit_code"], r["steps"], r["step_s"], r["wait_s"], r["gen_s"],
         r["update_s"], r["staleness"], r["updates_to_target"], r["seconds_to_target"], r["best"],
         r["final"], r["peak_rss_mib"]]
        for r in results
    ]  # fmt: skip
    print_table(
        "quickstart: sync vs one_step_off (medians over rollout steps)",
        ["mode", "seed", "exit", "steps", "s/step", "wait s", "gen s", "update s", "staleness",
         f"updates to {TARGET}", f"s to {TARGET}", "best", "final", "peak RSS MiB"],
        rows,
    )  # fmt: skip
    others = [m for m in args.modes if m != "sync"]
    for key, title in (
        ("step_s", "seconds per rollout step, sync / mode"),
        ("seconds_to_target", f"training seconds to {TARGET}, sync / mode"),
    ):
        ratios = []
        for seed in seeds:
            by = {r["mode"]: r for r in results if r["seed"] == seed}
            base = by.get("sync", {}).get(key)
            if base:
                ratios.append([seed, *[base / by[m][key] if by[m][key] else None for m in others]])
        print_table(title, ["seed", *others], ratios)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    png = out_dir() / f"{name}.png"
    plot(results, png)
    print(f"wrote {png}")
    if any(r.get("trace") for r in results) and not args.quick:
        trace_png = out_dir() / f"{name}_trace.png"
        plot_trace(results, trace_png)
        print(f"wrote {trace_png} (Chrome traces: {root}/<mode>/seed<S>/logs/*/phase_trace.json)")
    return results


if __name__ == "__main__":
    main()
