"""DAPO vs the naive GRPO baseline on SmolLM2-135M-Instruct word problems, at equal wall clock:
``dapo-lightning fit --config configs/smollm2_135m.yaml`` (DAPO) and the same plus
``configs/smollm2_grpo_baseline.yaml`` (GRPO), each for the same training-time budget, for
several seeds, through the real command line on this machine's CPU.

Each run gets a fresh directory ``benchmarks/out/smollm2_curve/<method>/seed<S>/`` and an override
YAML that moves the run's paths there, points ``model.model_name_or_path`` at one shared model
folder (written once with ``make-model`` if missing; its ~20 s are not counted) and appends two
callbacks: :class:`~quickstart_curve.WallClock` (one ``wall_clock.jsonl`` row per validation,
seconds since the CLI was launched) and :class:`TimeBudget`, which stops training once the
budget has passed since the end of the initial validation (``ValidateAtStart``): the
"training minutes" of the table count from there (generation, updates, weight pushes, periodic
validations and checkpoint writes all included; Python start-up, engine start and the initial
validation excluded). On the stop request Lightning runs one last validation, so every run ends
with a val/acc. The config's ``EarlyStopping`` stays (a run that reaches 0.9 ends there).

It prints one row per run (initial val/acc, the first time and update at which val/acc >= 0.8,
best and final val/acc, updates done, generated samples) and writes
``benchmarks/out/smollm2_curve.png``: val/acc against training minutes (left) and against
optimizer updates (right), one line per run, DAPO solid and GRPO dashed.

Timings depend on the machine's load (these cores are shared): the load average is printed at
the start and end of every run, and the table should be read next to it.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/smollm2_curve.py            # 2 seeds x 2, 15 min each
    .venv/bin/python benchmarks/smollm2_curve.py --methods dapo --seeds 0 --budget-min 10
    .venv/bin/python benchmarks/smollm2_curve.py --quick     # smoke: DAPO, 1 seed, 2 updates
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from dapo_lightning.plot import find_metrics_csv, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, config_callbacks, out_dir, print_table  # noqa: E402
from quickstart_curve import T0_ENV  # noqa: E402

#: The recipe (relative to the repository root).
RECIPE = "configs/smollm2_135m.yaml"
#: The config files of each method, in order.
METHODS: dict[str, list[str]] = {
    "dapo": [RECIPE],
    "grpo": [RECIPE, "configs/smollm2_grpo_baseline.yaml"],
}
#: The held-out accuracy the recipe is tuned to reach.
TARGET = 0.8
#: The default training-time budget per run (minutes).
BUDGET_MIN = 15.0
#: Where the shared model folder is written when ``--model-dir`` is not given.
DEFAULT_MODEL_DIR = REPO_ROOT / "runs" / "smollm2" / "model"


class TimeBudget(pl.Callback):
    """Stops training ``budget_s`` seconds after ``on_train_start`` (list it after
    ``ValidateAtStart``, whose initial validation runs in that same hook, so the budget starts
    when it ends).

    Args:
        budget_s: Training seconds; the stop request is made at the first rollout step that
            ends past it (Lightning then validates once more and stops).
        path: Optional JSON file the start time (``time.time()``) is written to.
    """

    def __init__(self, budget_s: float, path: str | None = None) -> None:
        self.budget_s = float(budget_s)
        self.path = path
        self.t0: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self.t0 = time.time()
        if self.path and trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"train_t0": self.t0}))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        if self.t0 is not None and time.time() - self.t0 >= self.budget_s:
            trainer.should_stop = True


def write_override(
    run_dir: Path, configs: list[str], *, model_dir: Path, budget_s: float, quick: bool
) -> Path:
    """The last ``--config`` of one run: its paths under ``run_dir``, the shared model folder,
    the wall clock and the time budget (the configs' callback list repeated, as lists are
    replaced whole)."""
    callbacks = copy.deepcopy(config_callbacks(configs))
    for callback in callbacks:
        if callback["class_path"].endswith(".ModelCheckpoint"):
            callback.setdefault("init_args", {})["dirpath"] = str(run_dir / "checkpoints")
    callbacks += [
        {
            "class_path": "quickstart_curve.WallClock",
            "init_args": {"path": str(run_dir / "wall_clock.jsonl")},
        },
        {
            "class_path": "smollm2_curve.TimeBudget",
            "init_args": {"budget_s": budget_s, "path": str(run_dir / "train_t0.json")},
        },
    ]
    trainer: dict[str, Any] = {
        "default_root_dir": str(run_dir),
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "logs", "flush_logs_every_n_steps": 1},
        },
        "callbacks": callbacks,
    }
    if quick:
        trainer["max_steps"] = 2
        trainer["val_check_interval"] = 1
    path = run_dir / "override.yaml"
    path.write_text(
        yaml.safe_dump(
            {"trainer": trainer, "model": {"init_args": {"model_name_or_path": str(model_dir)}}},
            sort_keys=False,
        )
    )
    return path


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def read_run(run_dir: Path) -> dict[str, Any]:
    """The run's validation curve ``[(updates, val/acc, training seconds or None)]``, its
    initial val/acc and the samples it generated (from ``metrics.csv`` and ``wall_clock.jsonl``).

    Validation rows are logged at ``step = updates - 1`` (``ValidateAtStart``'s at -1)."""
    series = read_metrics(find_metrics_csv(run_dir / "logs"))
    t0_file = run_dir / "train_t0.json"
    launch_t0 = float((run_dir / "launch_t0").read_text())
    train_t0 = json.loads(t0_file.read_text())["train_t0"] if t0_file.exists() else None
    clock: dict[int, float] = {}
    wall = run_dir / "wall_clock.jsonl"
    for line in wall.read_text().splitlines() if wall.exists() else []:
        row = json.loads(line)
        if train_t0 is not None and not row["sanity"]:
            clock[row["step"]] = launch_t0 + row["wall_s"] - train_t0
    curve = []
    for step, acc in sorted(series.get("val/acc", [])):
        updates = int(step) + 1
        seconds = 0.0 if updates == 0 else clock.get(updates)
        curve.append((updates, acc, seconds))
    gen_groups = sum(v for _, v in series.get("data/generated_groups", []))
    return {"curve": curve, "generated_groups": gen_groups}


def run_one(
    method: str,
    seed: int,
    *,
    model_dir: Path,
    budget_s: float,
    quick: bool,
    extra: list[str],
    root: Path,
) -> dict[str, Any]:
    """One fit of ``method`` for ``seed`` in a fresh run directory; its curve and summary."""
    run_dir = root / method / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    configs = METHODS[method]
    override = write_override(run_dir, configs, model_dir=model_dir, budget_s=budget_s, quick=quick)
    cmd = [str(Path(sys.executable).with_name("dapo-lightning")), "fit"]
    for cfg in [*(str(REPO_ROOT / c) for c in configs), str(override)]:
        cmd += ["--config", cfg]
    cmd += ["--seed_everything", str(seed), *extra]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    load_start = _loadavg()
    t0 = time.time()
    env[T0_ENV] = repr(t0)
    (run_dir / "launch_t0").write_text(repr(t0))
    print(f"{method} seed {seed}: running (load {load_start}) ...", flush=True)
    with open(run_dir / "fit.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    total_s = time.time() - t0
    load_end = _loadavg()
    if proc.returncode != 0:
        tail = (run_dir / "fit.log").read_text()[-1500:]
        print(
            f"{method} seed {seed}: the fit exited with {proc.returncode}:\n{tail}", file=sys.stderr
        )
    run = read_run(run_dir)
    curve = run["curve"]
    hit = next(((u, s) for u, acc, s in curve if acc >= TARGET and u > 0), (None, None))
    trained = [p for p in curve if p[0] > 0]
    result = {
        "method": method,
        "seed": seed,
        "initial": curve[0][1] if curve and curve[0][0] == 0 else None,
        "curve": curve,
        "updates_to_target": hit[0],
        "minutes_to_target": None if hit[1] is None else hit[1] / 60,
        "best": max((acc for _, acc, _ in trained), default=None),
        "final": trained[-1][1] if trained else None,
        "updates": trained[-1][0] if trained else 0,
        "train_minutes": (trained[-1][2] or 0) / 60 if trained else 0.0,
        "samples": int(run["generated_groups"]) * _group_size(run_dir),
        "total_s": total_s,
        "load_start": load_start,
        "load_end": load_end,
        "exit_code": proc.returncode,
        "run_dir": str(run_dir),
    }
    print(
        f"{method} seed {seed}: exit {proc.returncode}, {result['updates']} updates, final "
        f"val/acc {result['final']}, {total_s:.0f} s (load {load_end})",
        flush=True,
    )
    return result


def _group_size(run_dir: Path) -> int:
    config = yaml.safe_load(next((run_dir / "logs").glob("version_*/config.yaml")).read_text())
    return int(config["data"]["init_args"]["dynamic_sampling"]["n"])


def plot(results: list[dict[str, Any]], path: Path, budget_min: float) -> None:
    """val/acc against training minutes (left) and optimizer updates (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[int, str] = {}
    for r in results:
        color = colors.setdefault(r["seed"], f"C{len(colors)}")
        style = "-" if r["method"] == "dapo" else "--"
        label = f"{r['method'].upper()} seed {r['seed']}"
        pts = r["curve"]
        tp = [p for p in pts if p[2] is not None]
        ax_t.plot([p[2] / 60 for p in tp], [p[1] for p in tp], style, color=color, marker="o",
                  ms=3, label=label)  # fmt: skip
        ax_u.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                  ms=3, label=label)  # fmt: skip
    for ax, xlabel in ((ax_t, "training minutes (after the initial validation)"),
                       (ax_u, "optimizer updates")):  # fmt: skip
        ax.axhline(TARGET, color="grey", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out val/acc (64 problems x 4 samples)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.axvline(budget_min, color="red", ls=":", lw=1)
    fig.suptitle("SmolLM2-135M-Instruct word problems: DAPO vs GRPO at equal wall clock (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ensure_model(model_dir: Path) -> Path:
    """The model folder, written with ``make-model smollm2-135m-instruct`` when missing."""
    if not (model_dir / "config.json").exists():
        from dapo_lightning.models import make_smollm2_folder

        print(f"writing SmolLM2-135M-Instruct into {model_dir} (not timed) ...", flush=True)
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        make_smollm2_folder(model_dir)
    return model_dir.resolve()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=["dapo", "grpo"])
    parser.add_argument("--budget-min", type=float, default=BUDGET_MIN, help="training minutes")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="smoke: DAPO, first seed, 2 updates")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's ckpts")
    args, extra = parser.parse_known_args(argv)
    methods = ["dapo"] if args.quick else args.methods
    seeds = args.seeds[:1] if args.quick else args.seeds
    name = "smollm2_curve_quick" if args.quick else "smollm2_curve"
    root = out_dir() / name
    model_dir = ensure_model(args.model_dir)
    results = []
    for seed in seeds:  # methods side by side per seed: neighbours' load hits both alike
        for method in methods:
            r = run_one(
                method,
                seed,
                model_dir=model_dir,
                budget_s=args.budget_min * 60,
                quick=args.quick,
                extra=extra,
                root=root,
            )
            if not args.keep_checkpoints:
                shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
            results.append(r)
    rows = [
        [
            r["method"].upper(),
            r["seed"],
            r["initial"],
            "-" if r["minutes_to_target"] is None else round(r["minutes_to_target"], 1),
            r["updates_to_target"] if r["updates_to_target"] is not None else "not reached",
            r["best"],
            r["final"],
            r["updates"],
            round(r["train_minutes"], 1),
            r["samples"],
            f"{r['load_start'].split()[0]} / {r['load_end'].split()[0]}",
            r["exit_code"],
        ]
        for r in results
    ]
    print_table(
        f"SmolLM2-135M-Instruct word problems: held-out val/acc, {args.budget_min:g}-minute budget",
        [
            "method",
            "seed",
            "initial",
            f"min to {TARGET}",
            f"updates to {TARGET}",
            "best",
            "final",
            "updates",
            "train min",
            "samples",
            "load start/end",
            "exit",
        ],
        rows,
    )
    curve_rows = []
    for r in results:
        for updates, acc, seconds in r["curve"]:
            minutes = "-" if seconds is None else f"{seconds / 60:.1f}"
            curve_rows.append([f"{r['method'].upper()} {r['seed']}", updates, minutes, acc])
    print_table("val/acc at every validation", ["run", "updates", "train min", "val/acc"],
                curve_rows)  # fmt: skip
    png = out_dir() / f"{name}.png"
    plot(results, png, args.budget_min)
    (out_dir() / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {png}")
    print(f"load average at the end (1/5/15 min): {_loadavg()}")
    return results


if __name__ == "__main__":
    main()
