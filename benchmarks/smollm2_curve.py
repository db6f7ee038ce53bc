"""DAPO vs the naive GRPO baseline on SmolLM2-135M-Instruct, at an equal training-time budget:
``dapo-lightning fit --config configs/smollm2_135m.yaml`` (DAPO, word problems; ``--recipe
reasoning_gym``: ``configs/smollm2_reasoning_gym.yaml``) and the same plus
``configs/smollm2_grpo_baseline.yaml`` (GRPO), for several seeds, through the real command line
on this machine's CPU.

Each run gets a fresh directory ``benchmarks/out/smollm2_curve/<method>/seed<S>/`` and an override
YAML that moves the run's paths there, points ``model.model_name_or_path`` at one shared model
folder (written once with ``make-model`` if missing; not timed) and appends :class:`TimeBudget`.
That callback starts its clocks when the initial validation (``ValidateAtStart``) ends, writes
one ``clock.jsonl`` row per validation (val/acc, training wall seconds, training CPU seconds of
the process, load average) and stops training once the budget is spent. "Training minutes"
count from there: generation, updates, weight pushes, periodic validations and checkpoint writes
are included; Python start-up, engine start and the initial validation are not. On the stop
request Lightning validates once more, so every run ends with a val/acc. The config's
``EarlyStopping`` stays (a run that reaches 0.9 ends there).

Two clocks, because these cores are shared: ``--clock wall`` (default) gives every run the same
wall-clock minutes; ``--clock cpu`` the same CPU-minutes / cores (``CPU seconds / 2`` is what
the run would take on 2 idle cores if both stayed busy, which makes runs taken at different loads
comparable; "idle-equivalent minutes" in the table). Both are recorded either way.

It prints one row per run (initial val/acc, when val/acc first reached 0.8 in updates, wall
minutes and idle-equivalent minutes, best and final val/acc, updates and samples, the load
average at the start and end) and the curve of every run, and writes
``benchmarks/out/smollm2_curve.png``: val/acc against training wall minutes, idle-equivalent
minutes and optimizer updates, DAPO solid, GRPO dashed, LoRA dotted, one colour per seed.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.smollm2_curve   # 2 seeds x 2 methods, 15 min
    .venv/bin/python -m benchmarks.smollm2_curve --methods dapo --seeds 0 --budget-min 10
    .venv/bin/python -m benchmarks.smollm2_curve --clock cpu           # equal compute under load
    .venv/bin/python -m benchmarks.smollm2_curve --quick     # smoke: DAPO, 1 seed, 2 updates
    .venv/bin/python -m benchmarks.smollm2_curve --methods lora --seeds 0   # LoRA adapters
    .venv/bin/python -m benchmarks.smollm2_curve --methods dapo calculator --name smollm2_calculator
    .venv/bin/python -m benchmarks.smollm2_curve --quick --methods dapo calculator --model-dir M
    .venv/bin/python -m benchmarks.smollm2_curve --report    # tables + PNG of the runs on disk
    .venv/bin/python -m benchmarks.smollm2_curve --name smollm2_curve_lr1e-4 --model.optimizer.init_args.lr 1e-4
    .venv/bin/python -m benchmarks.smollm2_curve --recipe reasoning_gym --budget-min 20   # the
        # reasoning-gym recipe (configs/smollm2_reasoning_gym.yaml), target +0.35 over the start
    .venv/bin/python -m benchmarks.smollm2_curve --recipe tool_use --model-dir SFT_DIR --budget-min 27
        # agent RL (configs/smollm2_tool_use.yaml) from a cold start (dapo-lightning sft), target 0.6
    .venv/bin/python -m benchmarks.smollm2_curve --recipe arithmetic --model-dir SFT_DIR --budget-min 27
        # chained calls (configs/smollm2_arithmetic.yaml) from its cold start, target 0.6
    .venv/bin/python -m benchmarks.smollm2_curve --recipe python_tool --model-dir SFT_DIR --budget-min 24
        # a sandboxed Python tool (configs/smollm2_python_tool.yaml) from its cold start, target 0.8

Extra arguments go to every ``dapo-lightning fit`` (e.g. ``--trainer.val_check_interval 10``).
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

from benchmarks._common import (
    REPO_ROOT,
    config_callbacks,
    generated_steps,
    out_dir,
    print_table,
)
from benchmarks._shared.smollm2 import (
    DEFAULT_MODEL_DIR,
    RECIPES,
    TARGETS,
    ensure_model,
    mean_over_budget,
    process_cpu_s,
)
from dapo_lightning.plot import find_metrics_csv, read_metrics

#: The word-problem recipe (the default ``--recipe``).
RECIPE = RECIPES["word_problems"]
#: The override files of each method, after the recipe.
METHOD_OVERRIDES: dict[str, list[str]] = {
    "dapo": [],
    "grpo": ["configs/smollm2_grpo_baseline.yaml"],
    "lora": ["configs/smollm2_lora.yaml"],  # DAPO with LoRA adapters (r 16)
    "calculator": [],  # DAPO on multi-turn episodes with the calculator tool (METHOD_RECIPES)
    "dapo_paper": ["configs/paper_dynamic_sampling.yaml"],  # DAPO, the paper's dynamic sampling
    "dapo_one_step_off": ["configs/one_step_off.yaml"],  # DAPO, next batch generated meanwhile
    # the same with a fixed split of the cores (no sharing of the idle rollout thread's cores)
    "dapo_one_step_off_fixed": [
        "configs/one_step_off.yaml",
        "benchmarks/one_step_off_fixed_split.yaml",
    ],
    # the same with the trainer's log-probs as the ratio's old policy and token TIS (cap 2)
    "dapo_one_step_off_trainer_old": [
        "configs/one_step_off.yaml",
        "benchmarks/one_step_off_trainer_old.yaml",
    ],
    # that, with each batch started after 2 of the step's updates (fresher samples)
    "dapo_one_step_off_late_start": [
        "configs/one_step_off.yaml",
        "benchmarks/one_step_off_trainer_old.yaml",
        "benchmarks/one_step_off_late_start.yaml",
    ],
}
#: Methods that replace the word-problem recipe by a recipe of their own (the same settings
#: plus what the method needs; tests/test_envs_fit.py pins the difference).
METHOD_RECIPES: dict[str, str] = {"calculator": "configs/smollm2_calculator.yaml"}
#: The config files of each method for the word-problem recipe, in order.
METHODS: dict[str, list[str]] = {
    m: [METHOD_RECIPES.get(m, RECIPE), *o] for m, o in METHOD_OVERRIDES.items()
}
#: Line style of each method in the PNG.
STYLES = {
    "dapo": "-",
    "grpo": "--",
    "lora": ":",
    "calculator": "-.",
    "dapo_paper": (0, (1, 1)),
    "dapo_one_step_off": (0, (5, 1, 1, 1)),
    "dapo_one_step_off_fixed": (0, (3, 2)),
    "dapo_one_step_off_trainer_old": (0, (1, 2)),
    "dapo_one_step_off_late_start": (0, (4, 1, 1, 1, 1, 1)),
}
#: The held-out accuracy the word-problem recipe is tuned to reach.
TARGET = TARGETS["word_problems"][1]
#: The default training-time budget per run (minutes).
BUDGET_MIN = 15.0


class TimeBudget(pl.Callback):
    """Stops training once ``budget_s`` seconds have passed since ``on_train_start`` (list it
    after ``ValidateAtStart``, whose initial validation runs in that same hook, so the budget
    starts when that validation ends), and appends one JSON line per validation to ``path``:
    ``{"step", "val_acc", "train_s", "train_cpu_s", "load1"}`` (``train_*`` since that start;
    the initial validation has ``train_s`` 0).

    Args:
        budget_s: The budget; the stop request is made at the first rollout step that ends past
            it (Lightning then validates once more and stops).
        path: JSON-lines file for the validation rows.
        clock: ``"wall"`` (seconds of wall clock) or ``"cpu"`` (CPU seconds of this process
            divided by ``cores``: on shared cores the same work costs about the same CPU time
            whatever the neighbours do, so runs taken at different loads get equal compute).
        cores: The divisor of ``clock="cpu"`` (the cores the run may use).
    """

    def __init__(self, budget_s: float, path: str, clock: str = "wall", cores: int = 2) -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}.")
        self.budget_s = float(budget_s)
        self.path = path
        self.clock = clock
        self.cores = max(1, int(cores))
        self.t0: float | None = None
        self.cpu0 = 0.0

    def _elapsed(self) -> tuple[float, float]:
        if self.t0 is None:
            return 0.0, 0.0
        return time.time() - self.t0, process_cpu_s() - self.cpu0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self.t0, self.cpu0 = time.time(), process_cpu_s()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        wall, cpu = self._elapsed()
        spent = wall if self.clock == "wall" else cpu / self.cores
        if spent >= self.budget_s:
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        acc = trainer.callback_metrics.get("val/acc")
        wall, cpu = self._elapsed()
        row = {
            "step": int(trainer.global_step),
            "val_acc": None if acc is None else float(acc),
            "train_s": wall,
            "train_cpu_s": cpu,
            "load1": os.getloadavg()[0],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def write_override(
    run_dir: Path,
    configs: list[str],
    *,
    model_dir: Path,
    budget_s: float,
    clock: str,
    cores: int,
    quick: bool,
) -> Path:
    """The last ``--config`` of one run: its paths under ``run_dir``, the shared model folder and
    :class:`TimeBudget` (the configs' callback list is repeated: lists are replaced whole)."""
    callbacks = copy.deepcopy(config_callbacks(configs))
    for callback in callbacks:
        if callback["class_path"].endswith(".ModelCheckpoint"):
            callback.setdefault("init_args", {})["dirpath"] = str(run_dir / "checkpoints")
    callbacks.append(
        {
            "class_path": "benchmarks.smollm2_curve.TimeBudget",
            "init_args": {
                "budget_s": budget_s,
                "path": str(run_dir / "clock.jsonl"),
                "clock": clock,
                "cores": cores,
            },
        }
    )
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


def read_run(run_dir: Path, cores: int) -> dict[str, Any]:
    """The run's validations ``[(updates, val/acc, train wall s, idle-equivalent s, load1)]``
    (from ``clock.jsonl``) and the samples it generated (``metrics.csv``)."""
    path = run_dir / "clock.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    curve = [
        (r["step"], r["val_acc"], r["train_s"], r["train_cpu_s"] / cores, r["load1"])
        for r in rows
        if r["val_acc"] is not None
    ]
    samples, tool_use, gen_s, batch_samples = 0, [], 0.0, 0
    try:
        series = read_metrics(find_metrics_csv(run_dir / "logs"))
        n = _group_size(run_dir)
        groups = sum(v for _, v in series.get("data/generated_groups", []))
        samples = int(groups) * n
        tool_use = list(generated_steps(series, "env/tool_use_frac").values())
        gen_s = sum(v for _, v in series.get("time/generation_s", []))
        batch_samples = int(sum(v for _, v in series.get("data/batch_groups", []))) * n
    except (FileNotFoundError, StopIteration, KeyError):
        pass
    return {
        "curve": curve,
        "samples": samples,
        "tool_use": tool_use,
        "gen_s": gen_s,
        "batch_samples": batch_samples,
    }


def _group_size(run_dir: Path) -> int:
    config = yaml.safe_load(next((run_dir / "logs").glob("version_*/config.yaml")).read_text())
    return int(config["data"]["init_args"]["dynamic_sampling"]["n"])


def summarize(
    method: str,
    seed: int,
    recipe: str,
    run_dir: Path,
    cores: int,
    exit_code: int,
    total_s: float,
    load_start: str,
    load_end: str,
) -> dict[str, Any]:
    """One run's summary row and curve, from its folder (``clock.jsonl``, ``metrics.csv``)."""
    run = read_run(run_dir, cores)
    curve = run["curve"]
    trained = [p for p in curve if p[0] > 0]
    initial = curve[0][1] if curve and curve[0][0] == 0 else None
    kind, value = TARGETS[recipe]
    level = value if kind == "acc" else (initial or 0.0) + value
    hit = next((p for p in trained if p[1] >= level), None)
    result = {
        "method": method,
        "seed": seed,
        "recipe": recipe,
        "initial": initial,
        "curve": curve,
        "updates_to_target": hit[0] if hit else None,
        "minutes_to_target": hit[2] / 60 if hit else None,
        "idle_minutes_to_target": hit[3] / 60 if hit else None,
        "best": max((p[1] for p in trained), default=None),
        "final": trained[-1][1] if trained else None,
        "updates": trained[-1][0] if trained else 0,
        "train_minutes": trained[-1][2] / 60 if trained else 0.0,
        "idle_minutes": trained[-1][3] / 60 if trained else 0.0,
        "samples": run["samples"],
        # generation wall seconds per optimizer update, and samples generated per sample trained
        # on (= samples per kept group in units of n)
        "gen_s_per_update": run["gen_s"] / trained[-1][0] if trained else None,
        "samples_per_kept": run["samples"] / run["batch_samples"] if run["batch_samples"] else None,
        # multi-turn runs: share of training episodes with a tool call, first step and mean of
        # the last 5
        "tool_use_first": run["tool_use"][0] if run["tool_use"] else None,
        "tool_use_last": sum(run["tool_use"][-5:]) / len(run["tool_use"][-5:])
        if run["tool_use"]
        else None,
        "total_s": total_s,
        "load_start": load_start,
        "load_end": load_end,
        "exit_code": exit_code,
        "run_dir": str(run_dir),
        "cores": cores,
    }
    return result


def run_one(
    method: str,
    seed: int,
    *,
    recipe: str = "word_problems",
    model_dir: Path,
    budget_s: float,
    clock: str,
    cores: int,
    quick: bool,
    extra: list[str],
    root: Path,
) -> dict[str, Any]:
    """One fit of ``method`` for ``seed`` in a fresh run directory; its curve and summary."""
    run_dir = root / method / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if method in METHOD_RECIPES and recipe != "word_problems":
        raise SystemExit(
            f"--methods {method} runs the word-problem recipe only (--recipe {recipe})."
        )
    configs = [METHOD_RECIPES.get(method, RECIPES[recipe]), *METHOD_OVERRIDES[method]]
    override = write_override(
        run_dir,
        configs,
        model_dir=model_dir,
        budget_s=budget_s,
        clock=clock,
        cores=cores,
        quick=quick,
    )
    cmd = [str(Path(sys.executable).with_name("dapo-lightning")), "fit"]
    for cfg in [*(str(REPO_ROOT / c) for c in configs), str(override)]:
        cmd += ["--config", cfg]
    cmd += ["--seed_everything", str(seed), *extra]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cores))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    load_start = _loadavg()
    print(f"{method} seed {seed}: running (load {load_start}) ...", flush=True)
    t0 = time.time()
    with open(run_dir / "fit.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    total_s = time.time() - t0
    load_end = _loadavg()
    if proc.returncode != 0:
        tail = (run_dir / "fit.log").read_text()[-1500:]
        print(f"{method} seed {seed}: exit {proc.returncode}:\n{tail}", file=sys.stderr)
    result = summarize(
        method, seed, recipe, run_dir, cores, proc.returncode, total_s, load_start, load_end
    )
    (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    print(
        f"{method} seed {seed}: exit {proc.returncode}, {result['updates']} updates, final "
        f"val/acc {result['final']}, {total_s:.0f} s (load {load_end})",
        flush=True,
    )
    return result


def target_label(recipe: str) -> str:
    """The recipe's target as a column heading: ``0.8`` or ``+0.35``."""
    kind, value = TARGETS[recipe]
    return f"{value:g}" if kind == "acc" else f"+{value:g}"


def plot(results: list[dict[str, Any]], path: Path, budget_min: float, clock: str) -> None:
    """val/acc against training wall minutes, idle-equivalent minutes and optimizer updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cores = results[0].get("cores", 2)
    xs = (
        (lambda p: p[2] / 60, "training wall minutes (under the load of the run)"),
        (lambda p: p[3] / 60, f"idle-equivalent minutes (process CPU-min / {cores})"),
        (lambda p: p[0], "optimizer updates"),
    )
    colors: dict[int, str] = {}
    other_styles = dict.fromkeys(r["method"] for r in results if r["method"] not in STYLES)
    other_styles = {m: list(STYLES.values())[i % len(STYLES)] for i, m in enumerate(other_styles)}
    for r in results:
        color = colors.setdefault(r["seed"], f"C{len(colors)}")
        style = STYLES.get(r["method"]) or other_styles[r["method"]]
        label = f"{r['method'].upper()} seed {r['seed']}"
        for ax, (x, _) in zip(axes, xs):
            ax.plot([x(p) for p in r["curve"]], [p[1] for p in r["curve"]], linestyle=style,
                    color=color, marker="o", ms=3, label=label)  # fmt: skip
    recipe = results[0].get("recipe", "word_problems")
    kind, value = TARGETS[recipe]
    initials = [r["initial"] for r in results if r["initial"] is not None]
    level = value if kind == "acc" else (sum(initials) / max(len(initials), 1)) + value
    for ax, (_, xlabel) in zip(axes, xs):
        ax.axhline(level, color="grey", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out val/acc (64 problems x 4 samples)")
    axes[0 if clock == "wall" else 1].axvline(budget_min, color="red", ls=":", lw=1)
    axes[2].legend(fontsize=8)
    task = {
        "word_problems": "word problems",
        "tool_use": "products with a calculator",
        "arithmetic": "3-factor products with binary tools",
        "python_tool": "3-factor products with a Python tool",
        "code_functions": "write f(x), scored by unit tests",
    }.get(recipe, "reasoning-gym arithmetic")
    names = " vs ".join(dict.fromkeys(r["method"].upper() for r in results))
    fig.suptitle(f"SmolLM2-135M-Instruct {task} on CPU: {names}, equal training budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _num(value: float | None, digits: int = 1) -> Any:
    return "-" if value is None else round(value, digits)


def _tool_use(result: dict[str, Any]) -> str:
    """Share of training episodes calling a tool, first step -> mean of the last 5 ("-":
    single-turn, or a run recorded before env/tool_use_frac)."""
    first, last = result.get("tool_use_first"), result.get("tool_use_last")
    return "-" if first is None else f"{first:.2f} -> {last:.2f}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--recipe", choices=sorted(RECIPES), default="word_problems", help="which recipe"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=sorted(METHODS), default=None
    )  # default dapo grpo (--quick: dapo); lora, calculator on request
    parser.add_argument("--budget-min", type=float, default=BUDGET_MIN, help="training minutes")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="budget clock")
    parser.add_argument("--cores", type=int, default=2, help="cores (OMP_NUM_THREADS, cpu clock)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--quick", action="store_true", help="smoke: first seed, 2 updates (DAPO unless --methods)"
    )
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's ckpts")
    parser.add_argument(
        "--name", default=None, help="output folder and PNG name (default smollm2_curve)"
    )  # a variant (extra arguments) in its own folder: --name smollm2_curve_additive
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: the tables and PNG from the runs already in the output folder "
        "(each run writes result.json; runs taken by separate invocations are reported together)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="FOLDERS=LABEL",
        default=None,
        help="run nothing: report the runs under several output folders together, each group "
        "of folders (a glob: rg_default_s*, rg_runs/dapo) under its label (one line style per label; --name "
        "names the tables' PNG and JSON)",
    )
    args, extra = parser.parse_known_args(argv)
    if args.compare:
        return report(compare_runs(args.compare), args.name or "smollm2_compare",
                      args.budget_min, args.clock)  # fmt: skip
    methods = args.methods or (["dapo"] if args.quick else ["dapo", "grpo"])
    seeds = args.seeds[:1] if args.quick else args.seeds
    base = "smollm2_curve" if args.recipe == "word_problems" else "smollm2_rg_curve"
    name = args.name or (f"{base}_quick" if args.quick else base)
    root = out_dir() / name
    if args.report:
        found = [root / m / f"seed{s}" / "result.json" for s in seeds for m in methods]
        results = [json.loads(p.read_text()) for p in found if p.exists()]
        if not results:
            raise SystemExit(f"--report: no result.json under {root} for {methods} x {seeds}.")
        return report(results, name, args.budget_min, args.clock)
    model_dir = ensure_model(args.model_dir)
    results = []
    for seed in seeds:  # the methods back to back per seed: a change of load hits both alike
        for method in methods:
            r = run_one(
                method,
                seed,
                recipe=args.recipe,
                model_dir=model_dir,
                budget_s=args.budget_min * 60,
                clock=args.clock,
                cores=args.cores,
                quick=args.quick,
                extra=extra,
                root=root,
            )
            if not args.keep_checkpoints:
                shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
            results.append(r)
    return report(results, name, args.budget_min, args.clock)


def compare_runs(groups: list[str]) -> list[dict[str, Any]]:
    """The ``result.json`` of every run under the output folders of each ``FOLDERS=LABEL``
    (``FOLDERS`` a glob under benchmarks/out), their method replaced by ``LABEL``."""
    results = []
    for group in groups:
        folders, _, label = group.partition("=")
        found = sorted(out_dir().glob(f"{folders}/**/result.json"))
        if not found:
            raise SystemExit(f"--compare: no result.json under {out_dir() / folders}")
        results += [dict(json.loads(p.read_text()), method=label or folders) for p in found]
    return results


def report(
    results: list[dict[str, Any]], name: str, budget_min: float, clock: str
) -> list[dict[str, Any]]:
    """Print the summary and curve tables of ``results``; write ``<name>.png`` and ``.json``."""
    rows = [
        [
            r["method"].upper(),
            r["seed"],
            r["initial"],
            r["updates_to_target"] if r["updates_to_target"] is not None else "not reached",
            _num(r["minutes_to_target"]),
            _num(r["idle_minutes_to_target"]),
            r["best"],
            r["final"],
            _num(mean_over_budget(r["curve"], budget_min, clock), 3),
            r["updates"],
            _num(r["train_minutes"]),
            _num(r["idle_minutes"]),
            r["samples"],
            _num(r.get("gen_s_per_update"), 2),
            "-" if r.get("samples_per_kept") is None else f"{r['samples_per_kept']:.2f} n",
            _tool_use(r),
            f"{r['load_start'].split()[0]} / {r['load_end'].split()[0]}",
            r["exit_code"],
        ]
        for r in results
    ]
    recipe = results[0].get("recipe", "word_problems")
    target = target_label(recipe)
    print_table(
        f"SmolLM2-135M-Instruct {recipe}: held-out val/acc, {budget_min:g}-minute {clock} budget",
        [
            "method",
            "seed",
            "initial",
            f"updates to {target}",
            f"min to {target}",
            f"idle-eq min to {target}",
            "best",
            "final",
            "mean in budget",
            "updates",
            "train min",
            "idle-eq min",
            "samples",
            "gen s / update",
            "samples / kept group",
            "episodes calling a tool",
            "load start / end",
            "exit",
        ],
        rows,
    )
    curve_rows = [
        [f"{r['method'].upper()} {r['seed']}", u, acc, _num(s / 60), _num(c / 60), load]
        for r in results
        for u, acc, s, c, load in r["curve"]
    ]
    print_table(
        "val/acc at every validation",
        ["run", "updates", "val/acc", "train min", "idle-eq min", "load"],
        curve_rows,
    )
    png = out_dir() / f"{name}.png"
    plot(results, png, budget_min, clock)
    (out_dir() / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {png}")
    print(f"load average at the end (1/5/15 min): {_loadavg()}")
    return results


if __name__ == "__main__":
    main()
