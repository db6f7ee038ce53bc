"""Cost of SampleLog (``dapo_lightning.callbacks.SampleLog``, docs/samples.md) per rollout step of
the quickstart.

    .venv/bin/python -m benchmarks.sample_log_cost              # 12 rollout steps
    .venv/bin/python -m benchmarks.sample_log_cost --quick      # smoke: 3 steps

One fit of ``configs/quickstart.yaml`` through the CLI, its SampleLog at that config's settings
(every step, at most 24 groups, dropped ones included, validation, 4 samples to the loggers)
replaced by :class:`TimedSampleLog`: the same callback, timing its own hooks. Both sides of the
comparison come from that one run: for each rollout step, the wall seconds from the end of the
previous step to the end of this one (generation, scoring, the updates, every callback), and the
seconds spent inside SampleLog's hooks in that interval (keeping each round, taking the step's
rounds, the rows, the fingerprints, matching the advantages, writing the JSONL, its state for the
step-start copy); "off" is the step without them. The data side's part (the response and prompt
text kept in ``ScoredRollouts.extra``, the filter decision per response) runs with or without the
callback and is in both. Prints a table, writes ``benchmarks/out/sample_log_cost.png`` and
reports the file's bytes per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from dapo_lightning.callbacks import SampleLog

from benchmarks._common import (
    REPO_ROOT,
    bar_chart,
    config_callbacks,
    model_override,
    out_dir,
    print_table,
)

QUICKSTART = "configs/quickstart.yaml"
#: The hooks whose time is SampleLog's cost.
TIMED_HOOKS = (
    "on_rollouts_scored",
    "on_rollouts_discarded",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_end",
    "state_dict",
)


class TimedSampleLog(SampleLog):
    """:class:`SampleLog` that adds the seconds of each of its hooks to the current step and
    writes ``{"step_s", "sample_log_s"}`` per rollout step to ``path``."""

    def __init__(self, path: str, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        self._out = Path(path)
        self._spent = 0.0
        self._last_end: float | None = None
        for name in TIMED_HOOKS:
            setattr(self, name, self._timed(getattr(self, name)))

    def _timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self._spent += time.perf_counter() - t0

        return timed

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        now = time.perf_counter()  # the timed wrapper adds this hook's own time after it
        if self._last_end is not None:
            with open(self._out, "a") as f:
                f.write(json.dumps({"step_s": now - self._last_end, "sample_log_s": self._spent}))
                f.write("\n")
        self._last_end, self._spent = now, 0.0


def write_override(run_dir: Path, model_dir: Path, times: Path) -> Path:
    """The second ``--config``: quickstart.yaml's callbacks with SampleLog timed, run paths."""
    callbacks = copy.deepcopy(config_callbacks([QUICKSTART]))
    for cb in callbacks:
        if cb["class_path"].endswith(".SampleLog"):
            cb["class_path"] = "benchmarks.sample_log_cost.TimedSampleLog"
            cb.setdefault("init_args", {})["path"] = str(times)
        if cb["class_path"].endswith(".ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(run_dir / "checkpoints")
    override = {
        "trainer": {"default_root_dir": str(run_dir), "callbacks": callbacks},
        **model_override([QUICKSTART], model_dir),
    }
    path = run_dir / "override.yaml"
    path.write_text(yaml.safe_dump(override, sort_keys=False))
    return path


def run(steps: int, run_dir: Path) -> dict[str, Any]:
    """One fit of ``steps`` rollout steps; the per-step times and the sample file's size."""
    from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint

    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = make_quickstart_checkpoint(run_dir / "model", seed=0)
    times = run_dir / "sample_log_times.jsonl"
    times.unlink(missing_ok=True)
    cli = str(Path(sys.executable).parent / "dapo-lightning")
    cmd = [cli, "fit", "--config", QUICKSTART, "--config", str(write_override(run_dir, model_dir, times)),
           "--trainer.max_steps", str(2 * steps), "--trainer.val_check_interval", "1000"]  # fmt: skip
    paths = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in times.read_text().splitlines()]
    sample_file = run_dir / "samples" / "rollouts-rank0.jsonl"
    return {"rows": rows, "bytes_per_step": sample_file.stat().st_size / steps}


def main(argv: list[str] | None = None) -> dict[str, Any]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="rollout steps of the fit")
    parser.add_argument("--quick", action="store_true", help="smoke: 3 rollout steps")
    args = parser.parse_args(argv)
    name = "sample_log_cost_quick" if args.quick else "sample_log_cost"
    result = run(3 if args.quick else args.steps, out_dir() / name)
    steps = [r["step_s"] for r in result["rows"]]
    spent = [r["sample_log_s"] for r in result["rows"]]
    shares = [s / t for s, t in zip(spent, steps)]
    table = [
        ("rollout step, SampleLog on (s)", statistics.median(steps)),
        ("rollout step, SampleLog off (s)", statistics.median(t - s for t, s in zip(steps, spent))),
        ("SampleLog's hooks per step (ms)", 1e3 * statistics.median(spent)),
        ("cost, median share of a step (%)", 100 * statistics.median(shares)),
        ("cost, share of all steps (%)", 100 * sum(spent) / sum(steps)),
        ("rollouts file per step (KB)", result["bytes_per_step"] / 1e3),
    ]
    print_table(
        f"SampleLog on the quickstart: {len(steps)} rollout steps, one run",
        ("", "value"),
        table,
        caption="goal: <= 2% of a rollout step at the defaults",
    )
    bar_chart(
        out_dir() / f"{name}.png",
        "SampleLog per quickstart rollout step",
        [f"step {i + 2}" for i in range(len(steps))],
        {"step without SampleLog": [t - s for t, s in zip(steps, spent)], "SampleLog": spent},
        ylabel="seconds",
    )
    return {"table": dict(table), **result}


if __name__ == "__main__":
    main()
