"""The long multi-rank runs' harness (tests/test_long_runs.py, tests/test_rank_loss.py): the
README's 2-rank command lines on the quickstart, started as users start them (the console script
under Lightning's launcher, its own session), and what the tests read of them."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests._harness import CLI, QUICKSTART, REPO, cli_env

SEED = 2
EVERY = 20  # configs/quickstart.yaml: ModelCheckpoint every_n_train_steps
#: The README's 2-rank lines (after `fit --config configs/quickstart.yaml`), and their
#: one-step-off variant (FSDP2 with one-step-off is refused by design: docs/sampling.md).
COMMANDS = {
    "ddp": ["--trainer.devices", "2", "--trainer.strategy", "ddp"],
    "fsdp2": ["--config", "configs/fsdp2_cpu_2ranks.yaml"],
    "ddp_one_step_off": [
        "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--config", "configs/one_step_off.yaml",
    ],
}  # fmt: skip
#: The update after which each command line gets its SIGTERM: at a validation and a periodic
#: save (100), inside a rollout step's updates (107), between two steps (112).
STOP_AT = {"ddp": 100, "fsdp2": 107, "ddp_one_step_off": 112}
#: metrics.csv columns that measure time, not behaviour.
TIMING = re.compile(r"seconds|per_second|^time/")


def start(run: Path, model: Path, mode: str, *extra: str) -> subprocess.Popen:
    """The README's command line of ``mode`` in ``run`` on ``model``, a callback recording each
    save appended; output to ``run/out-<n>.log``; its own session (the test signals it whole)."""
    run.mkdir(parents=True, exist_ok=True)
    log = run / f"out-{len(list(run.glob('out-*.log')))}.log"
    args = [
        CLI, "fit", "--config", QUICKSTART, *COMMANDS[mode], "--seed_everything", str(SEED),
        "--trainer.default_root_dir", str(run), "--model.init_args.model_name_or_path", str(model),
        "--trainer.callbacks+=_save_recorder.SaveRecorder", *extra,
    ]  # fmt: skip
    env = cli_env({"DAPO_TEST_SAVES": str(run / "saves.txt")})
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> str:
    return Path(proc.log).read_text()  # type: ignore[attr-defined]


#: Seconds a run may print nothing before it counts as hung (a validation of the quickstart's
#: held-out prompts prints within it on a busy 2-core AVX2 box).
STALL_S = 180.0


def finish(
    proc: subprocess.Popen, timeout: float = 2400, stall: float = STALL_S
) -> tuple[int, str]:
    """Wait for ``proc`` (and kill its session when it printed nothing for ``stall`` seconds,
    or ran ``timeout`` in all); its exit code and output.

    The bound follows the machine's speed: a run that keeps printing update lines is never cut
    (the quickstart's 2-rank line at seed 2 takes 360 updates on an AVX2 EPYC, about 3 minutes
    alone and 15 under CI's other tests: a fixed 400 s failed it there); a hung one is caught
    ``stall`` seconds after its last line.
    """
    start_t = last_t = time.monotonic()
    seen = -1
    while proc.poll() is None:
        now = time.monotonic()
        size = Path(proc.log).stat().st_size  # type: ignore[attr-defined]
        if size != seen:
            seen, last_t = size, now
        if now - last_t > stall or now - start_t > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"nothing printed for {stall:.0f} s" if now - last_t > stall else "no exit"
            pytest.fail(f"{why} (after {now - start_t:.0f} s):\n{output(proc)[-3000:]}")
        time.sleep(0.5)
    return proc.returncode, output(proc)


def wait_for_update(
    proc: subprocess.Popen, update: int, timeout: float = 1800, stall: float = STALL_S
) -> int:
    """Block until the progress lines report ``update`` or later; returns the update seen.
    Fails when the run exits first, prints nothing for ``stall`` seconds, or runs ``timeout``."""
    start_t = last_t = time.monotonic()
    last_text = ""
    while True:
        text, now = output(proc), time.monotonic()
        seen = [int(u) for u in re.findall(r"update (\d+)/", text)]
        if seen and max(seen) >= update:
            return max(seen)
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before update {update}:\n{text[-3000:]}")
        if text != last_text:
            last_text, last_t = text, now
        if now - last_t > stall or now - start_t > timeout:
            pytest.fail(f"update {update} not reached ({now - start_t:.0f} s):\n{text[-3000:]}")
        time.sleep(0.2)


def final_update(text: str) -> int:
    return int(re.search(r"updates:\s+(\d+)/", text).group(1))


def metrics_by_step(run: Path) -> dict[tuple[int, str], str]:
    """Every non-timing value of every ``metrics.csv`` under ``run/logs`` keyed by (step, name),
    the later file (a resumed run's) winning where both logged a step."""
    out: dict[tuple[int, str], str] = {}
    files = sorted(
        (run / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])
    )
    for path in files:
        for row in csv.DictReader(open(path)):
            for name, value in row.items():
                if value != "" and name != "step" and not TIMING.search(name):
                    out[int(row["step"]), name] = value
    return out
