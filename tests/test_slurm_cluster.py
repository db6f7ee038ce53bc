"""The project's ``slurm/dapo.sbatch`` under a real SLURM (issue 54): a one-node cluster on this
machine (tests/slurm_cluster.py: munged, slurmctld, slurmd; ``scripts/local_slurm.sh``), jobs
submitted with ``sbatch``, real ``srun`` tasks, signals from ``scancel`` and requeues by
``scontrol``. Nothing SLURM does is faked; only the requeued job's ~2 minute hold (BeginTime)
is cut short with ``scontrol update StartTime=now``.

Every job trains quickstart.yaml on the tiny random model with the harness's tiny batches
(tests/_harness.py; it never reaches the EarlyStopping target), one thread per task
(``--cpus-per-task=1``), on a CPU node: the script's GPU lines are overridden on the command
line. Where SLURM is not installed the tests skip with the install command; ``.ci/run``
installs it (and sets DAPO_REQUIRE_SLURM=1: then a missing SLURM fails).
"""

from __future__ import annotations

import csv
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._harness import CLI, QUICKSTART, run_cli, write_run_config
from tests.slurm_cluster import SlurmCluster, missing, start_cluster

pytestmark = pytest.mark.slurm

SBATCH = "slurm/dapo.sbatch"
#: A CPU node, one thread per task (the script's #SBATCH lines ask for 4 nodes of 8 GPUs).
CPU_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
#: Training metrics that do not depend on wall-clock time: equal in two runs with one seed.
TRAINING_METRICS = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "update/loss",
    "update/grad_norm",
    "update/entropy",
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The running cluster; its daemons are stopped by PID at the end, also after a failure."""
    why = missing()
    if why is not None:
        if os.environ.get("DAPO_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    running = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield running
    finally:
        running.stop()


def job_config(tmp_path: Path, model_dir: Path, name: str = "run") -> tuple[Path, Path]:
    """The run directory and a second --config for quickstart.yaml: the tiny model and batches."""
    run_dir = tmp_path / name
    return run_dir, write_run_config(tmp_path / f"{name}.yaml", run_dir, model_dir)


def submit(
    cluster: SlurmCluster, tmp_path: Path, override: Path, *sbatch_args: str, steps: int
) -> tuple[str, Path]:
    """``sbatch [CPU node] ARGS slurm/dapo.sbatch quickstart.yaml --config override``; the job
    id and its output file."""
    out = tmp_path / f"slurm-{len(list(tmp_path.glob('slurm-*')))}.out"
    job = cluster.sbatch(
        *CPU_NODE, f"--output={out}", *sbatch_args, SBATCH, QUICKSTART,
        "--config", str(override), "--trainer.max_steps", str(steps),
        env={"DAPO_CLI": CLI, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    return job, out


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(what: str, ready, timeout: float, poll: float = 0.05):
    """Poll ``ready()`` until it returns something true (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(poll)
    return value


def update_seen(out: Path, update: int, after: int = 0) -> bool:
    """The job's log (from character ``after``) shows a rollout step at or past ``update``."""
    return any(int(n) >= update for n in re.findall(r"^update (\d+)/", text(out)[after:], re.M))


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    """Every metrics.csv row of the run, the logger's versions in order (a resume adds one)."""
    files = sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    rows: list[dict[str, str]] = []
    for path in files:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]


def assert_same_metrics(run_dir: Path, ref_dir: Path, stopped_at: int) -> None:
    """The run's training metrics are the reference's: the same steps, each once, the same
    values. Its validations too, except the one due at ``stopped_at`` when the stop landed
    during it (a stop during a validation drops that validation; the next runs as planned)."""
    run, ref = metric_rows(run_dir), metric_rows(ref_dir)
    for key in TRAINING_METRICS:
        got, want = series(run, key), series(ref, key)
        assert got and got == want, key
    got, want = series(run, "val/acc"), series(ref, "val/acc")
    missing = [(step, v) for step, v in want if (step, v) not in got]
    assert all(v in want for v in got) and len(got) == len(set(got)), (got, want)
    assert [step for step, _ in missing] in ([], [stopped_at - 1]), (got, want)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def saved_after(ckpt: Path, t: float) -> float | None:
    """When ``ckpt`` was last written, if after ``t`` (epoch seconds)."""
    return ckpt.stat().st_mtime if ckpt.exists() and ckpt.stat().st_mtime > t else None


# ------------------------------------------------------------------------------- 1. time limit
STEPS = 60  # updates of the time-limit case (one per rollout step)
RESUMED = re.compile(r"Resuming from \S+ at update (\d+)")


def test_time_limit_signal_requeues_and_resumes_exactly(cluster, model_dir, tmp_path, capsys):
    """``scancel --signal=USR1`` (what ``--signal=SIGUSR1@90`` sends before the time limit):
    the run saves at the next clean point, requeues itself, comes back with
    SLURM_RESTART_COUNT=1, resumes from that update and ends at max_steps with the weights and
    metrics of an uninterrupted run, bit for bit; metrics.csv has every update exactly once."""
    ref_dir, ref_config = job_config(tmp_path, model_dir, "reference")
    ref = run_cli(
        "fit", "--config", QUICKSTART, "--config", str(ref_config),
        "--trainer.max_steps", str(STEPS), env={"OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    # outside srun, with SLURM installed: none of Lightning's "prepend srun" hint
    assert "srun" not in ref.stderr, ref.stderr[-3000:]

    run_dir, config = job_config(tmp_path, model_dir)
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=1", steps=STEPS)
    wait_for("update 20 of the first run", lambda: update_seen(out, 20), timeout=180)
    last = run_dir / "checkpoints" / "last.ckpt"
    signalled = time.time()
    cluster.run("scancel", "--signal=USR1", job)
    saved = wait_for("the save on SIGUSR1", lambda: saved_after(last, signalled), timeout=60)
    cluster.wait(job, {"PENDING", "RUNNING"}, timeout=60, restarts=1)  # requeued
    released = time.time()
    cluster.wait(job, {"RUNNING", "COMPLETED"}, timeout=60, restarts=1)
    first = text(out)
    resumed = wait_for("the resume", lambda: RESUMED.search(text(out)), timeout=120)
    training_again = time.time()
    done = cluster.wait(job, {"COMPLETED", "FAILED"}, timeout=300, restarts=1)
    log = text(out)
    assert done["JobState"] == "COMPLETED", log[-4000:]

    assert "SIGUSR1 received" in first and "Requeued SLURM job" in log
    assert f"job {job} restart 1:" in log  # SLURM_RESTART_COUNT=1, printed by the script
    at = int(resumed.group(1))
    assert 20 <= at < STEPS
    assert f"max_steps={STEPS} reached" in log
    assert_same_metrics(run_dir, ref_dir, stopped_at=at)
    updates = [s for s, _ in series(metric_rows(run_dir), "update/loss")]
    assert updates == sorted(set(updates)) and len(updates) == STEPS  # no gap, no repeat
    ref_w, got_w = weights(ref_dir / "checkpoints" / "last.ckpt"), weights(last)
    assert ref_w.keys() == got_w.keys()
    for name, tensor in ref_w.items():
        assert torch.equal(got_w[name], tensor), f"weights differ: {name}"
    with capsys.disabled():
        print(
            f"\n[slurm] USR1: saved after {saved - signalled:.2f} s; the requeued job released "
            f"-> training again (update {at}) after {training_again - released:.1f} s "
            f"({training_again - signalled:.1f} s after the signal)"
        )
