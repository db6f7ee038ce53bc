"""The quickstart's runs: the config, the target, the wall clock callback, the override of one
seed's run and its val/acc curve (``benchmarks.quickstart_curve``, ``benchmarks.pipeline_overlap``)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from benchmarks._common import config_callbacks, model_override
from dapo_lightning.plot import Series

#: The command's config file (relative to the repository root).
QUICKSTART = "configs/quickstart.yaml"


#: The learning target of issue 8: val/acc the quickstart must reach.
TARGET = 0.9


#: Environment variable carrying the launch time (``time.time()``) into the CLI process.
T0_ENV = "QUICKSTART_CURVE_T0"


class WallClock(pl.Callback):
    """Appends ``{"step", "val_acc", "wall_s", "sanity"}`` to ``path`` at every validation end.

    Args:
        path: JSON-lines file to append to.

    ``wall_s`` is seconds since the ``QUICKSTART_CURVE_T0`` environment variable's time (the
    launch of the command), or since this callback was built when it is unset.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.t0 = float(os.environ.get(T0_ENV, time.time()))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        if not trainer.is_global_zero:
            return
        acc = trainer.callback_metrics.get("val/acc")
        row = {
            "step": int(trainer.global_step),
            "val_acc": None if acc is None else float(acc),
            "wall_s": time.time() - self.t0,
            "sanity": bool(trainer.sanity_checking),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def write_override(run_dir: Path, *, quick: bool, model_dir: Path | None = None) -> Path:
    """The second ``--config`` of one seed's run: every path under ``run_dir``, the wall clock.

    Lists (``trainer.callbacks``) are replaced whole, so quickstart.yaml's own list is read and
    repeated here, its checkpoints moved into ``run_dir``, with :class:`WallClock` appended.
    """
    callbacks = copy.deepcopy(config_callbacks([QUICKSTART]))
    for callback in callbacks:
        if callback["class_path"].endswith(".ModelCheckpoint"):
            args = callback.setdefault("init_args", {})
            args["dirpath"] = str(run_dir / "checkpoints")
            if quick:
                args["every_n_train_steps"] = 1
    callbacks.append(
        {
            "class_path": "benchmarks._shared.quickstart.WallClock",
            "init_args": {"path": str(run_dir / "wall_clock.jsonl")},
        }
    )
    trainer: dict[str, Any] = {
        "default_root_dir": str(run_dir),
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "logs"},
        },
        "callbacks": callbacks,
    }
    if quick:
        trainer["val_check_interval"] = 1
    model_path = model_dir or run_dir / "model"
    path = run_dir / "override.yaml"
    path.write_text(
        yaml.safe_dump(
            {"trainer": trainer, **model_override([QUICKSTART], model_path)},
            sort_keys=False,
        )
    )
    return path


def val_curve(series: Series) -> list[tuple[int, float]]:
    """``(optimizer updates, val/acc)`` rows of a run's ``metrics.csv`` series.

    Lightning logs validation at ``step = global_step - 1`` of the update it followed (the
    row's ``step`` column); the update count is that plus one.
    """
    return [(int(step) + 1, acc) for step, acc in sorted(series.get("val/acc", []))]


def read_wall_clock(run_dir: Path) -> list[dict[str, Any]]:
    """The :class:`WallClock` rows of a run (empty if it wrote none)."""
    path = run_dir / "wall_clock.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def val_acc_axes(ax: Any, xlabel: str) -> None:
    """An axes of val/acc (0 to 1) against ``xlabel``, the target as a grey line."""
    ax.axhline(TARGET, color="grey", ls="--", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("val/acc")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
