"""DAPO (configs/quickstart.yaml) vs the naive-GRPO baseline (configs/grpo_baseline.yaml) on
the quickstart task: ``val/acc`` against optimizer updates and against generated samples,
several seeds each, side by side in one run.

    .venv/bin/python -m benchmarks.learning_efficiency                 # 3 seeds each
    .venv/bin/python -m benchmarks.learning_efficiency --quick         # CI smoke: 1 seed, 4 updates

Each run is the real CLI (``dapo-lightning fit``) in a run directory of its own under
``benchmarks/out/learning/``; the table gives, per method, the median over seeds of the
updates, generated samples and seconds needed to first reach ``--target`` val/acc, and the
final val/acc. The PNG shows every seed's curve against both x-axes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks._common import REPO_ROOT, config_callbacks, model_override, out_dir, print_table
from dapo_lightning.plot import find_metrics_csv, read_metrics

#: Method name -> config files given to the CLI in order (later ones override).
METHODS: dict[str, tuple[str, ...]] = {
    "DAPO": ("configs/quickstart.yaml",),
    "GRPO baseline": ("configs/quickstart.yaml", "configs/grpo_baseline.yaml"),
}


@dataclass
class Curve:
    """One run's validation curve and its sampling cost."""

    method: str
    seed: int
    seconds: float
    #: (optimizer updates, generated samples so far, val/acc) per validation.
    points: list[tuple[int, int, float]] = field(default_factory=list)

    def first_reaching(self, target: float) -> tuple[int, int] | None:
        for updates, samples, acc in self.points:
            if acc >= target:
                return updates, samples
        return None


def run_fit(
    configs: tuple[str, ...],
    run_dir: Path,
    seed: int,
    max_steps: int,
    model_dir: Path,
    val_every: int | None = None,
) -> float:
    """Run ``dapo-lightning fit`` with ``configs`` plus an override that puts every output in
    ``run_dir``; returns the wall-clock seconds. ``model_dir`` holds the starting checkpoint,
    written by the first run of a seed and shared by both methods (same start, one warm-up)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # The method's own callbacks, minus checkpointing.
    callbacks = [c for c in config_callbacks(configs) if "ModelCheckpoint" not in c["class_path"]]
    override = run_dir / "override.yaml"
    override.write_text(
        yaml.safe_dump(
            {
                "seed_everything": seed,
                "trainer": {
                    "max_steps": max_steps,
                    "default_root_dir": str(run_dir),
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(run_dir), "name": "logs"},
                    },
                    "callbacks": callbacks,
                    **({"val_check_interval": val_every} if val_every else {}),
                },
                **model_override(configs, model_dir),
            }
        )
    )
    cmd = [str(Path(sys.executable).with_name("dapo-lightning")), "fit"]
    for cfg in (*configs, str(override)):
        cmd += ["--config", cfg]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (run_dir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return seconds


def group_size(configs: tuple[str, ...]) -> int:
    """``data.init_args.dynamic_sampling.n`` of the configs (the last one that sets it wins)."""
    n = None
    for cfg in configs:
        data = (yaml.safe_load((REPO_ROOT / cfg).read_text()).get("data") or {}).get("init_args")
        n = ((data or {}).get("dynamic_sampling") or {}).get("n", n)
    if n is None:
        raise ValueError(f"none of {configs} sets data.init_args.dynamic_sampling.n")
    return int(n)


def read_curve(method: str, seed: int, seconds: float, run_dir: Path, group_size: int) -> Curve:
    """val/acc per validation with the updates and generated samples before it.

    Lightning logs a validation at ``step = global_step - 1`` of the update it followed, so
    the update count is the row's step plus one (as in ``quickstart_curve``).
    """
    series = read_metrics(find_metrics_csv(run_dir / "logs"))
    generated = sorted(series.get("data/generated_groups", []))
    curve = Curve(method, seed, seconds)
    for step, acc in sorted(series.get("val/acc", [])):
        samples = sum(int(groups) * group_size for s, groups in generated if s <= step)
        curve.points.append((int(step) + 1, samples, acc))
    return curve


def plot(curves: list[Curve], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {m: c for m, c in zip(METHODS, ("tab:blue", "tab:orange"))}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for curve in curves:
        if not curve.points:
            continue
        updates, samples, acc = zip(*curve.points)
        label = f"{curve.method} (seed {curve.seed})"
        axes[0].plot(updates, acc, color=colors[curve.method], marker=".", label=label, alpha=0.8)
        axes[1].plot(samples, acc, color=colors[curve.method], marker=".", label=label, alpha=0.8)
    for ax, xlabel in zip(axes, ("optimizer updates", "generated samples")):
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val/acc")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    fig.suptitle("DAPO vs naive GRPO on the quickstart task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Curve]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="updates per run")
    parser.add_argument("--target", type=float, default=0.9, help="val/acc to reach")
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 updates (smoke test)")
    args = parser.parse_args(argv)
    seeds = [0] if args.quick else args.seeds
    max_steps = 4 if args.quick else (args.max_steps or 200)
    root = out_dir() / ("learning_quick" if args.quick else "learning")
    shutil.rmtree(root, ignore_errors=True)
    curves = []
    for seed in seeds:
        for method, configs in METHODS.items():
            run_dir = root / f"{method.split()[0].lower()}_seed{seed}"
            model_dir = root / f"model_seed{seed}"
            seconds = run_fit(
                configs, run_dir, seed, max_steps, model_dir, 2 if args.quick else None
            )
            curves.append(read_curve(method, seed, seconds, run_dir, group_size(configs)))
            print(f"{method} seed {seed}: {seconds:.0f} s, val/acc {curves[-1].points}", flush=True)
    rows = []
    for method in METHODS:
        mine = [c for c in curves if c.method == method]
        reached = [c.first_reaching(args.target) for c in mine]
        hit = [r for r in reached if r is not None]
        rows.append(
            [
                method,
                f"{len(hit)}/{len(mine)}",
                statistics.median(r[0] for r in hit) if hit else "-",
                statistics.median(r[1] for r in hit) if hit else "-",
                statistics.median(c.points[-1][2] for c in mine if c.points),
                statistics.median(c.seconds for c in mine),
            ]
        )
    print_table(
        f"learning efficiency (target val/acc {args.target}, medians over seeds {seeds})",
        ["method", "reached", "updates", "samples", "final val/acc", "run seconds"],
        rows,
    )
    png = root.parent / (
        "learning_efficiency_quick.png" if args.quick else "learning_efficiency.png"
    )
    plot(curves, png, args.target)
    print(png)
    return curves


if __name__ == "__main__":
    main()
