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
import json
import multiprocessing
import os
import re
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from dapo_lightning import slurm
from dapo_lightning.rewards import get_reward
from dapo_lightning.rewards.workers import ProcessWorker
from tests._harness import CLI, QUICKSTART, run_cli, write_run_config
from tests.slurm_cluster import ENDED, INSTALL, SlurmCluster, missing, start_cluster

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


def job_config(
    tmp_path: Path, model_dir: Path, name: str = "run", save_every: int | None = None
) -> tuple[Path, Path]:
    """The run directory and a second --config for quickstart.yaml: the tiny model and batches
    (``save_every``: only the progress lines and a checkpoint every that many updates)."""
    run_dir = tmp_path / name
    callbacks = [
        {"class_path": "dapo_lightning.callbacks.DAPOProgressBar"},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": "checkpoints", "save_last": True, "save_top_k": 0,
                          "every_n_train_steps": save_every},
        },
    ]  # fmt: skip
    trainer = {} if save_every is None else {"trainer": {"callbacks": callbacks}}
    return run_dir, write_run_config(tmp_path / f"{name}.yaml", run_dir, model_dir, **trainer)


def submit(
    cluster: SlurmCluster,
    tmp_path: Path,
    override: Path,
    *sbatch_args: str,
    steps: int,
    extra: list[str] | None = None,
    output: Path | None = None,
) -> tuple[str, Path]:
    """``sbatch [CPU node] ARGS slurm/dapo.sbatch quickstart.yaml --config override
    --trainer.max_steps STEPS EXTRA``; the job id and its output file."""
    out = output or tmp_path / f"slurm-{len(list(tmp_path.glob('slurm-*')))}.out"
    job = cluster.sbatch(
        *CPU_NODE, f"--output={out}", *sbatch_args, SBATCH, QUICKSTART,
        "--config", str(override), "--trainer.max_steps", str(steps), *(extra or []),
        env={"DAPO_CLI": CLI, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    return job, out


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(what: str, ready, timeout: float, poll: float = 0.05, explain=None):
    """Poll ``ready()`` until it returns something true (returned); fail after ``timeout``,
    with what ``explain()`` says (the job's state and log) when given."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not after {timeout} s" + (f"\n{explain()}" if explain else ""))
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


def assert_same_metrics(run_dir: Path, ref_dir: Path, stops: list[int]) -> None:
    """The run's training metrics are the reference's: the same steps, each once, the same
    values. Its validations too, except one due at an update in ``stops`` when the stop landed
    during it (a stop during a validation drops that validation; the next runs as planned)."""
    run, ref = metric_rows(run_dir), metric_rows(ref_dir)
    for key in TRAINING_METRICS:
        got, want = series(run, key), series(ref, key)
        assert got and got == want, key
    got, want = series(run, "val/acc"), series(ref, "val/acc")
    missing = [(step, v) for step, v in want if (step, v) not in got]
    assert all(v in want for v in got) and len(got) == len(set(got)), (got, want)
    assert all(step + 1 in stops for step, _ in missing), (got, want)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def saved_after(ckpt: Path, t: float) -> float | None:
    """When ``ckpt`` was last written, if after ``t`` (epoch seconds)."""
    return ckpt.stat().st_mtime if ckpt.exists() and ckpt.stat().st_mtime > t else None


# ------------------------------------------------------------------------------- 0. the node
def test_the_node_has_every_core_whatever_omp_num_threads_says(tmp_path, monkeypatch):
    """The node's CPUs are the machine's cores, also when OMP_NUM_THREADS=1 (a pytest-xdist
    worker after an in-process fit exports it; plain ``nproc`` answered 1, and every two-task
    job pended forever with Reason=PartitionConfig)."""
    if missing() is not None:
        pytest.skip(missing())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    own = start_cluster(tmp_path / "slurm")
    try:
        node = own.run("scontrol", "show", "node", "-o").stdout
        assert re.search(r"\bCPUTot=(\d+)", node).group(1) == str(len(os.sched_getaffinity(0)))
    finally:
        own.stop()


# ------------------------------------------------------------------------------- 1. time limit
#: Rewards scored in a worker process: SLURM signals every process of the step, the worker too.
WORKERS = ["--data.init_args.scoring.in_process", "false"]
RESUMED = re.compile(r"Resuming from \S+ at update (\d+)")


def requeue_once(
    cluster: SlurmCluster, job: str, out: Path, after_update: int, restart: int
) -> tuple[int, float, float]:
    """Once the job's log shows ``after_update``: ``scancel --signal=USR1``, wait for the save
    and the requeue (the log's "Requeued SLURM job" line), release the held job and wait until
    it trains again. Returns the update it resumed at, the seconds from the signal to the
    requeue and from the release to training again."""
    start = len(text(out))

    def explain() -> str:
        return (
            f"job: {cluster.job(job)}\nits log since the last resume:\n{text(out)[start:][-4000:]}"
        )

    wait_for(
        f"update {after_update}",
        lambda: update_seen(out, after_update, start),
        180,
        explain=explain,
    )
    signalled = time.monotonic()
    cluster.run("scancel", "--signal=USR1", job)
    wait_for("the requeue", lambda: "Requeued SLURM job" in text(out)[start:], 60, explain=explain)
    requeued = time.monotonic()
    cluster.wait(job, {"PENDING", "RUNNING"}, timeout=60, restarts=restart)
    released = time.monotonic()
    cluster.wait(job, {"RUNNING", "COMPLETED"}, timeout=60, restarts=restart)
    resumed = wait_for(
        "the resume", lambda: RESUMED.search(text(out)[start:]), 120, explain=explain
    )
    assert f"job {job} restart {restart}:" in text(out)  # SLURM_RESTART_COUNT, as the script saw it
    return int(resumed.group(1)), requeued - signalled, time.monotonic() - released


@pytest.mark.parametrize(
    ("requeues", "steps"), [(1, 50), pytest.param(3, 80, marks=pytest.mark.slow)]
)
def test_time_limit_signal_requeues_and_resumes_exactly(
    cluster, model_dir, tmp_path, capsys, requeues, steps
):
    """``scancel --signal=USR1`` (what ``--signal=SIGUSR1@90`` sends before the time limit):
    the run saves at the next clean point, requeues itself, comes back with
    SLURM_RESTART_COUNT=1 (2, 3), resumes from that update and ends at max_steps with the
    weights and metrics of an uninterrupted run, bit for bit; metrics.csv has every update
    exactly once. Rewards are scored in a worker process (signalled with the rest of the step)."""
    ref_dir, ref_config = job_config(tmp_path, model_dir, "reference")
    ref = run_cli(
        "fit", "--config", QUICKSTART, "--config", str(ref_config),
        "--trainer.max_steps", str(steps), *WORKERS, env={"OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    # outside srun, with SLURM installed: none of Lightning's "prepend srun" hint
    assert "srun" not in ref.stderr, ref.stderr[-3000:]

    run_dir, config = job_config(tmp_path, model_dir)
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=1", steps=steps, extra=WORKERS)
    stops, times = [], []
    for restart in range(1, requeues + 1):
        at, to_requeue, to_train = requeue_once(cluster, job, out, 20 * restart - 5, restart)
        assert stops[-1:] < [at] < [steps]  # resumed where it stopped: later each time
        stops.append(at)
        times.append(f"signal -> saved + requeued {to_requeue:.2f} s, released -> training "
                     f"again {to_train:.1f} s (update {at})")  # fmt: skip
    done = cluster.wait(job, {"COMPLETED", "FAILED"}, timeout=300, restarts=requeues)
    log = text(out)
    assert done["JobState"] == "COMPLETED", log[-4000:]
    assert log.count("SIGUSR1 received") == requeues and f"max_steps={steps} reached" in log

    assert_same_metrics(run_dir, ref_dir, stops)
    updates = [s for s, _ in series(metric_rows(run_dir), "update/loss")]
    assert updates == list(range(1, steps + 1))  # every update once: no gap, no repeat
    ref_w, got_w = weights(ref_dir / "checkpoints" / "last.ckpt"), weights(last_ckpt(run_dir))
    assert ref_w.keys() == got_w.keys()
    for name, tensor in ref_w.items():
        assert torch.equal(got_w[name], tensor), f"weights differ: {name}"
    with capsys.disabled():
        print("\n[slurm] USR1: " + "; ".join(times))


@pytest.mark.slow
def test_a_real_time_limit_requeues_until_the_run_is_done(cluster, model_dir, tmp_path, capsys):
    """No scancel: ``--time=3`` with the script's own ``--signal=SIGUSR1@90`` (SLURM sends it
    30-90 s into each run). Every run saves and requeues itself, the next one resumes, until
    max_steps; only the ~2 minute hold of each requeue is cut short."""
    run_dir, config = job_config(tmp_path, model_dir)
    steps = 2500
    job, out = submit(
        cluster, tmp_path, config, "--ntasks-per-node=1", "--time=3", steps=steps,
        extra=["--trainer.val_check_interval", "250"],
    )  # fmt: skip
    started = time.monotonic()
    while (info := cluster.job(job))["JobState"] not in ENDED:
        assert time.monotonic() - started < 900, info
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":  # requeued
            cluster.wait(job, {"RUNNING", "COMPLETED"}, 60, int(info["Restarts"]))  # released
        time.sleep(1)
    log = text(out)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, log[-3000:]
    assert log.count("SIGUSR1 received") == int(info["Restarts"]) >= 1
    assert saved_update(run_dir) == steps and f"max_steps={steps} reached" in log
    updates = [s for s, _ in series(metric_rows(run_dir), "update/loss")]
    assert updates == list(range(1, steps + 1))
    with capsys.disabled():
        print(
            f"\n[slurm] --time=3 --signal=SIGUSR1@90: {info['Restarts']} requeues, done after "
            f"{time.monotonic() - started:.0f} s"
        )


def last_ckpt(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"


def saved_update(run_dir: Path) -> int:
    return int(torch.load(last_ckpt(run_dir), map_location="cpu", weights_only=True)["global_step"])


# ------------------------------------------------------------------------------- 2. preemption
def test_preemption_saves_within_the_grace_and_a_resubmission_resumes(
    cluster, model_dir, tmp_path, capsys
):
    """``scancel --signal=TERM`` (SIGTERM to the tasks) and a plain ``scancel`` (SIGTERM to the
    job, SIGKILL after KillWait=30 s): the run saves the update it is at within the grace and
    exits; the same command submitted again resumes there and finishes."""
    run_dir, config = job_config(tmp_path, model_dir)
    times = []
    for how, state in ((["--signal=TERM"], "FAILED"), ([], "CANCELLED")):
        before = saved_update(run_dir) if last_ckpt(run_dir).exists() else 0
        job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=1", steps=200)
        wait_for("training", partial(update_seen, out, before + 5), timeout=180)
        signalled = time.monotonic()
        cluster.run("scancel", *how, job)
        info = cluster.wait(job, {state}, timeout=60)
        ended = time.monotonic() - signalled
        log = text(out)
        assert "SIGTERM received" in log, log[-3000:]
        assert ended < 30, f"not within SLURM's default grace (KillWait 30 s): {ended:.1f} s"
        assert info["ExitCode"].startswith("143:") or state == "CANCELLED", info
        saved = saved_update(run_dir)
        last_logged = max(s for s, _ in series(metric_rows(run_dir), "update/loss"))
        assert saved == last_logged > before  # the last update made is the one saved
        times.append(f"scancel {' '.join(how) or '(plain)'}: saved update {saved}, job ended "
                     f"{ended:.1f} s after the signal")  # fmt: skip
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=1", steps=saved + 3)
    info = cluster.wait(job, {"COMPLETED", "FAILED"}, timeout=240)
    log = text(out)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert f"Resuming from {last_ckpt(run_dir)} at update {saved}" in log
    updates = [s for s, _ in series(metric_rows(run_dir), "update/loss")]
    assert updates == list(range(1, saved + 4))  # each update once across the three jobs
    with capsys.disabled():
        print("\n[slurm] preemption: " + "; ".join(times))


# ------------------------------------------------------------------------------- 3. two tasks
def lock_holder(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / ".dapo-run.lock").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_two_tasks_train_requeue_and_resume(cluster, model_dir, tmp_path):
    """Two tasks on the one node (``--ntasks-per-node=2``; the script asks for 8 per node, so a
    plain ``--ntasks=2`` cannot be met): two ranks (DDP over gloo) started by srun train,
    requeue on SIGUSR1 and resume; the run-directory lock records the job id, and the
    requeued job takes it over."""
    run_dir, config = job_config(tmp_path, model_dir)
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=2", steps=24)
    wait_for("training", lambda: update_seen(out, 2), timeout=180)
    first = lock_holder(run_dir)
    assert first is not None and first["slurm_job_id"] == job, first
    at, _, _ = requeue_once(cluster, job, out, 8, restart=1)
    second = lock_holder(run_dir)
    assert second is not None and second["slurm_job_id"] == job and second["pid"] != first["pid"]
    done = cluster.wait(job, {"COMPLETED", "FAILED"}, timeout=300, restarts=1)
    log = text(out)
    assert done["JobState"] == "COMPLETED", log[-4000:]
    assert "--trainer.num_nodes 1 --trainer.devices 2" in log and "max_steps=24 reached" in log
    assert 8 <= at < 24 and saved_update(run_dir) == 24
    updates = [s for s, _ in series(metric_rows(run_dir), "update/loss")]
    assert updates == list(range(1, 25))
    assert lock_holder(run_dir) is None  # released at the end


# ------------------------------------------------------------------------------- 4. a dead task
def task_pid(job: str, rank: int) -> int | None:
    """The PID of task ``rank``'s training process of ``job`` (from /proc: this node)."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (
            f"SLURM_JOB_ID={job}".encode() in env
            and f"SLURM_PROCID={rank}".encode() in env
            and b"dapo-lightning" in cmd
            and b"srun" not in cmd
        ):
            return int(proc.name)
    return None


def test_a_dead_task_ends_the_job_and_a_resubmission_resumes(cluster, model_dir, tmp_path, capsys):
    """``kill -9`` of task 0's process mid-training: the job ends within 60 s (not at its time
    limit) with lines naming the task (srun's, and the surviving rank's); the same command
    submitted again takes over the lock the dead task left and resumes the last saved update."""
    run_dir, config = job_config(tmp_path, model_dir, save_every=4)
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=2", steps=200)
    wait_for("update 6 (saved at 4)", lambda: update_seen(out, 6), timeout=240)
    pid = task_pid(job, rank=0)
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    info = cluster.wait(job, {"FAILED", "CANCELLED", "COMPLETED"}, timeout=90)
    ended = time.monotonic() - killed
    log = text(out)
    assert info["JobState"] == "FAILED", info
    assert ended < 60, f"the job ran on {ended:.0f} s after a task died"
    assert re.search(r"srun: error: \S+: task 0: Killed", log), log[-3000:]
    assert "rank 1 lost rank 0 of 2" in log, log[-3000:]
    assert lock_holder(run_dir)["pid"] == pid  # left behind by the killed task
    saved = saved_update(run_dir)
    assert saved >= 4 and saved % 4 == 0  # a periodic save: the dead task's update is lost
    job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=2", steps=saved + 2)
    info = cluster.wait(job, {"COMPLETED", "FAILED"}, timeout=240)
    log = text(out)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert (
        f"Taking over the stale run-directory lock {run_dir / '.dapo-run.lock'} of PID {pid}" in log
    )
    assert f"Resuming from {last_ckpt(run_dir)} at update {saved}" in log
    with capsys.disabled():
        print(f"\n[slurm] kill -9 of task 0: the job ended {ended:.1f} s later")


# ------------------------------------------------------------------------------- 5. mismatch
def test_task_counts_that_disagree_with_the_trainer_are_one_error_line(
    cluster, model_dir, tmp_path
):
    """Task counts that disagree with ``trainer.devices x trainer.num_nodes`` are one
    ``error:`` line before anything trains, exit 2: ``--trainer.devices 1`` after the script's
    own counts (the script refuses it: the job exits 2), and a second ``--config`` that sets
    ``trainer.devices: 1`` for a two-task job (task 0's CLI says why, every task exits 2; srun
    ends the tasks still running when the first one exits, so the job's own exit status is
    the 2 or the 143 of a task it ended)."""
    run_dir, config = job_config(tmp_path, model_dir)
    one_device = tmp_path / "one_device.yaml"
    one_device.write_text("trainer:\n  devices: 1\n")
    cases = (
        (["--trainer.devices", "1"], "slurm/dapo.sbatch: error: --trainer.devices"),
        (["--config", str(one_device)], "dapo-lightning: error: trainer.devices 1 x "),
    )
    for extra, error in cases:
        job, out = submit(cluster, tmp_path, config, "--ntasks-per-node=2", steps=4, extra=extra)
        info = cluster.wait(job, {"FAILED", "COMPLETED"}, timeout=180)
        log = text(out)
        ours = [
            line for line in log.splitlines()
            if ": error:" in line and not line.startswith(("srun:", "slurmstepd"))
        ]  # fmt: skip
        assert len(ours) == 1 and ours[0].startswith(error), log[-3000:]
        assert "Traceback" not in log and "fit: update" not in log
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "logs").exists()
        if extra[0] == "--config":
            assert "2 tasks (SLURM_NTASKS)" in ours[0]
            assert re.search(r"srun: error: \S+: tasks? [\d-]+: Exited with exit code 2", log), log
        else:
            assert info["ExitCode"] == "2:0", info


# ------------------------------------------------------------------------------- 6. seeds as an array
def test_an_array_job_runs_one_seed_per_task_in_its_own_run_directory(cluster, model_dir, tmp_path):
    """``sbatch --array=0-1``: task i trains with seed i in <run dir>/seed_i."""
    run_dir, config = job_config(tmp_path, model_dir)
    job, _ = submit(
        cluster, tmp_path, config, "--array=0-1", "--ntasks-per-node=1", steps=6,
        output=tmp_path / "slurm-%A_%a.out",
    )  # fmt: skip
    for task in (0, 1):
        info = cluster.wait(f"{job}_{task}", {"COMPLETED", "FAILED"}, timeout=240)
        log = text(tmp_path / f"slurm-{job}_{task}.out")
        assert info["JobState"] == "COMPLETED", log[-3000:]
        assert f"Seed set to {task}" in log
        assert saved_update(run_dir / f"seed_{task}") == 6
        saved = next((run_dir / f"seed_{task}" / "logs").rglob("config.yaml")).read_text()
        assert f"seed_everything: {task}" in saved
    assert not last_ckpt(run_dir).exists()
    loss = [series(metric_rows(run_dir / f"seed_{t}"), "update/loss") for t in (0, 1)]
    assert len(loss[0]) == len(loss[1]) == 6 and loss[0] != loss[1]  # two seeds, two runs


# ------------------------------------------------------------------------------- processes
def test_a_reward_worker_outlives_the_requeue_signal():
    """SLURM signals every process of a job step: SIGUSR1 before the time limit reaches the
    reward workers too (a forked child of a step task dies of it by default, seen on this
    cluster). A worker leaves the signal to its parent, as it does SIGTERM."""
    worker = ProcessWorker(multiprocessing.get_context("spawn"), get_reward("arithmetic"))
    try:
        wait_for("the worker's start", worker.conn.poll, timeout=60)
        os.kill(worker.proc.pid, signal.SIGUSR1)
        worker.proc.join(timeout=2)
        assert worker.alive(), worker.died_how()
    finally:
        worker.kill()


def test_no_srun_hint_outside_a_slurm_job(monkeypatch, capsys):
    """With SLURM installed, a Trainer built outside a SLURM job warns about nothing (Lightning's
    "The `srun` command is available on your system but is not used" hint); inside a job
    without srun one note says it trains as one process."""
    if shutil.which("srun") is None:
        pytest.skip(f"no srun on PATH: {INSTALL}")
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(accelerator="cpu", logger=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(slurm, "_hinted", False)
    Trainer(accelerator="cpu", logger=False)
    Trainer(accelerator="cpu", logger=False)
    assert (
        capsys.readouterr().err.count("runs inside SLURM job 77 but was not started by srun") == 1
    )
