"""RunGuard (callbacks/run_guard.py), RunLock (dapo_lightning/run_lock.py) and ValidateAtStart.

Through the real console script (tiny random model, 4 groups x 4 responses of <= 4 tokens,
dynamic sampling off since the random model never answers right): the final checkpoint holds
the last update when EarlyStopping ends the run between two ModelCheckpoint saves; everything
lands under ``--trainer.default_root_dir``; the untrained validation is logged; a resume falls
back from a truncated ``last.ckpt`` and applies the config's learning rate; SIGTERM saves and
exits 143; a full disk and a held run directory end with one clear line.

In process, on fixed rollout batches (tests/_module_harness.py): exceptions between updates are
saved, one inside an optimizer step is not, a stop that ``min_steps`` overrules still stops, and
checkpointing switched off saves nothing. SIGTERM / SIGINT during updates and generation, with
exact resumes: tests/test_resume_kill.py.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dapo_lightning.callbacks import DAPOCallback, RunDirLockedError, RunGuard
from dapo_lightning.callbacks.step_checkpoint import StepCheckpoint, skipped_a_save
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from dapo_lightning.checkpoint import previous_path
from dapo_lightning.interrupt import exit_on_stop, request_stop, stop_requested
from dapo_lightning.module import DAPOModule
from dapo_lightning.run_lock import LOCK_NAME, RunLock
from dapo_lightning.update import BatchingConfig

sys.path.insert(0, str(Path(__file__).parent))
from _module_harness import FixedBatches, fixed_batch, sgd  # noqa: E402

from tests._harness import ARITHMETIC_RUN, CLI, QUICKSTART, fit, run_cli, write_run_config
from tests._harness import cli_env as harness_cli_env

#: The ModelCheckpoint (every 2 updates) and initial validation of the console-script fits.
CALLBACKS = [
    {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": "checkpoints",
            "save_last": True,
            "every_n_train_steps": 2,
            "save_top_k": 0,
        },
    },
    {"class_path": "dapo_lightning.callbacks.ValidateAtStart"},
]
# val/acc stays 0 on the random model: no improvement after the first validation, so patience 3
# stops the run after update 3, between the ModelCheckpoint's saves at 2 and 4.
EARLY_STOP = {
    "class_path": "lightning.pytorch.callbacks.EarlyStopping",
    "init_args": {"monitor": "val/acc", "mode": "max", "patience": 3},
}


def tiny_config(path: Path, max_steps: int = 10, early_stop: bool = True) -> Path:
    callbacks = [*CALLBACKS, EARLY_STOP] if early_stop else CALLBACKS
    trainer = {"max_steps": max_steps, "val_check_interval": 1, "callbacks": callbacks}
    return write_run_config(path, trainer=trainer)


def cli_env() -> dict[str, str]:
    """The console script's environment: 2 threads, ``tests/`` importable (test callbacks)."""
    return harness_cli_env({"OMP_NUM_THREADS": "2"})


def cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"OMP_NUM_THREADS": "2"}, cwd=cwd, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-5000:]}"
    return proc


def metrics(run: Path, version: int = 0) -> list[dict[str, str]]:
    with open(run / "logs" / f"version_{version}" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=True, map_location="cpu")["global_step"]


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fit through the console script, run from an empty folder with a *relative*
    ``--trainer.default_root_dir``; EarlyStopping ends it after update 3."""
    cwd = tmp_path_factory.mktemp("early_stopped")
    override = tiny_config(cwd.parent / f"{cwd.name}-tiny.yaml")
    proc = ok(
        cli(
            "fit", "--config", QUICKSTART, "--config", str(override),
            "--trainer.default_root_dir", "run", "--create_model_if_missing.kind", "tiny",
            "--ckpt_path", "auto",
            cwd=cwd,
        )
    )  # fmt: skip
    return {"cwd": cwd, "run": cwd / "run", "override": override, "proc": proc}


def test_final_checkpoint_holds_the_last_update(early_stopped):
    run, proc = early_stopped["run"], early_stopped["proc"]
    updates = [v for _, v in series(metrics(run), "rollout/step")]  # one update per step
    assert updates == [1.0, 2.0, 3.0]  # EarlyStopping stopped after update 3
    last = run / "checkpoints" / "last.ckpt"
    assert step_of(last) == 3  # not 2, the ModelCheckpoint's own last save
    assert step_of(previous_path(last)) == 2  # the previous good checkpoint is kept
    assert re.search(
        r"Saved \S*/run/checkpoints/last\.ckpt \(final, update 3, val/acc=0\)", proc.stderr
    )
    assert "--ckpt_path auto" in proc.stderr.splitlines()[-1]
    assert not (run / LOCK_NAME).exists()


def test_default_root_dir_moves_everything(early_stopped):
    """Logs, checkpoints, the saved config and the model created on first use are all under the
    run directory given on the command line; nothing is written anywhere else."""
    cwd, run = early_stopped["cwd"], early_stopped["run"]
    assert sorted(p.name for p in cwd.iterdir()) == ["run"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "logs", "model"]
    assert (run / "model" / "config.json").is_file()
    assert (run / "logs" / "version_0" / "config.yaml").is_file()
    saved = (run / "logs" / "version_0" / "config.yaml").read_text()
    assert "model_name_or_path: run/model" in saved  # the resolved folder is what was recorded


def test_initial_validation_is_logged_before_update_1(early_stopped):
    """ValidateAtStart logs a real validation of the untrained model (Lightning's sanity check
    would throw it away) at step -1: validations are logged at global_step - 1."""
    val = series(metrics(early_stopped["run"]), "val/acc")
    assert [step for step, _ in val] == [-1, 0, 1, 2]
    assert all(v == 0.0 for _, v in val)


def test_resume_falls_back_past_a_truncated_checkpoint_and_applies_the_config(
    early_stopped, tmp_path
):
    """``last.ckpt`` cut in half: ``--ckpt_path auto`` names it, resumes from
    ``last-previous.ckpt`` (update 2), and the resumed fit runs with the config's learning rate
    and clip ratio, printing what differs from the checkpoint."""
    shutil.copytree(early_stopped["run"], tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    proc = ok(
        cli(
            "fit", "--config", QUICKSTART, "--config", str(early_stopped["override"]),
            "--trainer.default_root_dir", "run", "--create_model_if_missing.kind", "tiny",
            "--ckpt_path", "auto", "--trainer.max_steps", "3",
            "--model.init_args.optimizer.init_args.lr", "0.0001",
            "--model.init_args.loss.clip_ratio_high", "0.3",
            cwd=tmp_path,
        )
    )  # fmt: skip
    err = proc.stderr
    assert re.search(r"skipping \S*/run/checkpoints/last\.ckpt: it cannot be loaded", err), err
    assert re.search(r"auto: resuming from \S*/run/checkpoints/last-previous\.ckpt", err)
    assert re.search(r"Resuming from \S*/run/checkpoints/last-previous\.ckpt at update 2", err)
    assert "lr: 0.00025 (checkpoint) -> 0.0001 (config)" in err
    assert "model.loss.clip_ratio_high: 0.28 (checkpoint) -> 0.3 (config)" in err
    rows = metrics(tmp_path / "run", version=1)
    assert [v for _, v in series(rows, "rollout/step")] == [3.0]  # update 3 again, from 2
    assert [step for step, _ in series(rows, "val/acc")] == [2]  # no initial validation
    # the run folder was copied elsewhere, so Lightning's ModelCheckpoint does not recognise
    # last.ckpt as its own and writes last-v1.ckpt: the newest is what the next resume takes
    newest = max(last.parent.glob("last*.ckpt"), key=os.path.getmtime)
    final = torch.load(newest, weights_only=True)
    assert final["global_step"] == 3
    assert final["optimizer_states"][0]["param_groups"][0]["initial_lr"] == 1e-4
    assert final["hyper_parameters"]["loss"]["clip_ratio_high"] == 0.3


def test_sigterm_saves_and_exits_143(early_stopped, tmp_path):
    """A real SIGTERM to the console script while it trains (whatever it is doing then)."""
    override = tiny_config(tmp_path / "long.yaml", max_steps=200, early_stop=False)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    shutil.copytree(early_stopped["run"] / "model", tmp_path / "run" / "model")
    proc = subprocess.Popen(
        [CLI, "fit", "--config", QUICKSTART, "--config", str(override),
         "--trainer.default_root_dir", "run"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not last.exists():  # the ModelCheckpoint's save of update 2: training is under way
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no update 2 within 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-4000:]
    assert "SIGTERM received" in err
    saved = re.search(r"Saved \S+ \(.*update (\d+)|update (\d+) is already saved", err)
    assert saved, err[-3000:]
    assert step_of(last) == int(saved.group(1) or saved.group(2)) >= 2
    assert not (tmp_path / "run" / LOCK_NAME).exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_disk_ends_with_one_clear_line(early_stopped, tmp_path):
    """A real ENOSPC (the checkpoint writer's temporary file links to /dev/full) at the
    ModelCheckpoint's save of update 2: exit 1 with the directory and its free space named, no
    traceback."""
    run = tmp_path / "run"
    shutil.copytree(early_stopped["run"] / "model", run / "model")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".last.ckpt.tmp").symlink_to("/dev/full")
    proc = cli(
        "fit", "--config", QUICKSTART, "--config", str(early_stopped["override"]),
        "--trainer.default_root_dir", "run",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-4000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("dapo-lightning: error: [Errno 28] No space left on device")
    assert "run/checkpoints/last.ckpt" in last_line and "run/checkpoints has " in last_line
    assert " free" in last_line and "Traceback" not in proc.stderr
    assert not (run / "checkpoints" / "last.ckpt").exists()


def test_second_fit_in_a_held_run_directory_fails_at_once(early_stopped, tmp_path):
    """A live process holds the run directory: the fit exits 1 naming its PID, and writes no
    checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(early_stopped["run"] / "model", run / "model")
    holder = _hold_lock(run)
    try:
        proc = cli(
            "fit", "--config", QUICKSTART, "--config", str(early_stopped["override"]),
            "--trainer.default_root_dir", "run",
            cwd=tmp_path,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert f"run is in use by another fit: PID {holder.pid}" in last_line
    assert "--trainer.default_root_dir" in last_line and "Traceback" not in proc.stderr
    assert not (run / "checkpoints").exists()


def test_resume_after_cp_r_takes_the_highest_update_and_keeps_writing_last_ckpt(
    early_stopped, tmp_path
):
    """Issue 38: after ``cp -r`` of a run directory ``last-previous.ckpt`` (update 2) can be
    newer than ``last.ckpt`` (update 3); ``--ckpt_path auto`` resumed from update 2, then wrote
    ``last-v1.ckpt`` (the copy's checkpoint folder is not the one in the checkpoint's state)
    and left ``last.ckpt`` stale. Now it resumes at update 3 and update 4 is ``last.ckpt``."""
    subprocess.run(["cp", "-r", str(early_stopped["run"]), str(tmp_path / "run")], check=True)
    folder = tmp_path / "run" / "checkpoints"
    later = time.time() + 60
    os.utime(folder / "last-previous.ckpt", (later, later))  # the copy's order, made certain
    proc = ok(
        cli(
            "fit", "--config", QUICKSTART, "--config", str(early_stopped["override"]),
            "--trainer.default_root_dir", "run", "--ckpt_path", "auto",
            "--trainer.max_steps", "4",
            cwd=tmp_path,
        )
    )  # fmt: skip
    err = proc.stderr
    assert re.search(r"auto: resuming from \S*/run/checkpoints/last\.ckpt", err), err[-3000:]
    assert re.search(r"Resuming from \S*/run/checkpoints/last\.ckpt at update 3", err)
    assert [v for _, v in series(metrics(tmp_path / "run", version=1), "rollout/step")] == [4.0]
    assert sorted(p.name for p in folder.iterdir()) == ["last-previous.ckpt", "last.ckpt"]
    assert step_of(folder / "last.ckpt") == 4
    assert step_of(folder / "last-previous.ckpt") == 3


def test_resume_with_another_model_path_says_the_weights_come_from_the_checkpoint(
    early_stopped, tmp_path
):
    """Issue 38 item 5b: a resume with another ``model_name_or_path`` printed it under "the
    config applies", while the weights continued from the checkpoint (Lightning restores the
    module's state). The line now says so, and how to train from the other model's weights."""
    shutil.copytree(early_stopped["run"], tmp_path / "run")
    shutil.copytree(early_stopped["run"] / "model", tmp_path / "other-model")
    proc = ok(
        cli(
            "fit", "--config", QUICKSTART, "--config", str(early_stopped["override"]),
            "--trainer.default_root_dir", "run", "--ckpt_path", "auto",
            "--trainer.max_steps", "4", "--model.init_args.model_name_or_path", "other-model",
            cwd=tmp_path,
        )
    )  # fmt: skip
    err = proc.stderr
    assert re.search(r"Resuming from \S*/run/checkpoints/last\.ckpt at update 3\n", err), err
    assert (
        "model.model_name_or_path: 'run/model' (checkpoint) -> 'other-model' (config): the "
        "weights continue from the checkpoint, not from that model (it gave the architecture "
        "and the tokenizer only). To train from its weights, start a fresh run"
    ) in err, err[-3000:]
    assert "the config applies" not in err  # nothing else differs
    assert "data.model_name_or_path" not in err  # the linked copy is not a second note
    assert step_of(tmp_path / "run" / "checkpoints" / "last.ckpt") == 4


def _as_another_user() -> tuple[list[str], bool]:
    """The command prefix that runs a process as a user file modes apply to: ``setpriv`` to
    ``nobody`` when this is root (root ignores modes), nothing otherwise; and whether modes
    must be given to that user by ``chown`` (root) rather than ``chmod`` alone."""
    if os.geteuid() != 0:
        return [], False
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores file modes and setpriv (to run as nobody) is not installed")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"], True


@pytest.fixture
def shared_dir(early_stopped) -> Iterator[Path]:
    """A folder another user can enter, holding a readable copy of the tiny model and the
    override config (pytest's own temporary folders are private to this user)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="dapo-unwritable-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        shutil.copytree(early_stopped["run"] / "model", folder / "model")
        shutil.copy(early_stopped["override"], folder / "override.yaml")
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("unwritable", ["run root", "checkpoints"])
def test_unwritable_run_directory_fails_at_start(shared_dir, unwritable):
    """Issue 38 item 6: an unwritable ``checkpoints/`` was found at the first save, after the
    training time was spent; a read-only run root gave a traceback. Both are tried at the start
    (as a real non-root user: root ignores modes): one error line naming the setting, exit 2,
    nothing trained."""
    prefix, chown = _as_another_user()
    run = shared_dir / "run"
    (run / "checkpoints").mkdir(parents=True)
    writable = [] if unwritable == "run root" else [run]
    for folder in (run, run / "checkpoints"):
        if folder in writable and chown:
            shutil.chown(folder, "nobody", "nogroup")
        folder.chmod(0o755 if folder in writable else 0o555)
    env = {**cli_env(), "HOME": str(shared_dir), "MPLCONFIGDIR": str(shared_dir / "mpl")}
    shared_dir.chmod(0o777 if chown else 0o755)  # HOME: caches may be written there
    proc = subprocess.run(
        [*prefix, CLI, "fit", "--config", QUICKSTART, "--config", str(shared_dir / "override.yaml"),
         "--trainer.default_root_dir", str(run),
         "--model.init_args.model_name_or_path", str(shared_dir / "model")],
        cwd=shared_dir, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    err = proc.stderr
    lines = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 2, err[-4000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-4000:]
    if unwritable == "run root":
        assert lines[0].startswith(
            f"dapo-lightning: error: trainer.default_root_dir: the run directory {run} is not "
            "writable ("
        ), lines[0]
    else:
        assert lines[0].startswith(
            f"dapo-lightning: error: ModelCheckpoint.dirpath: the checkpoint folder "
            f"{run / 'checkpoints'} is not writable ("
        ), lines[0]
    assert "Fix: " in lines[0] and "rollout" not in err  # nothing was generated or trained
    assert not (run / "logs").exists() and list((run / "checkpoints").iterdir()) == []


# ----------------------------------------------------------------------------- the lock
def _hold_lock(directory: Path) -> subprocess.Popen:
    """A real process holding ``directory``'s lock until killed."""
    code = (
        "import sys, time; from dapo_lightning.run_lock import RunLock; "
        f"RunLock({str(directory)!r}).acquire(); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_held_by_a_live_process_is_refused(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirLockedError, match=f"PID {holder.pid}") as info:
            RunLock(tmp_path).acquire()
        assert str(tmp_path / LOCK_NAME) in str(info.value)  # how to clear it if stale
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed (SIGKILL: no clean-up): its lock is stale and is taken over
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_a_reused_pid_or_another_host(tmp_path):
    path = tmp_path / LOCK_NAME
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # a live PID with another start time: the process that held the lock is gone
        path.write_text(
            json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "start": "1"})
        )
        lock = RunLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        sleeper.kill()
        sleeper.wait()
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "then", "command": "x"}))
    with pytest.raises(RunDirLockedError, match="PID 1 on host elsewhere"):
        RunLock(tmp_path).acquire()


def test_lock_of_this_slurm_job_on_another_host_is_taken_over(tmp_path, monkeypatch, capsys):
    """Issue 38 item 8: a SLURM requeue keeps its job id but may land on another node, where
    the dead run's lock could not be checked and blocked it. The lock records host and job id;
    the same job (real ``SLURM_JOB_ID``) takes it over on any host, another job does not."""
    path = tmp_path / LOCK_NAME
    dead = {"pid": 4242, "host": "node-17-elsewhere", "since": "then", "command": "dapo-lightning fit",
            "slurm_job_id": "918273"}  # fmt: skip
    path.write_text(json.dumps(dead))
    monkeypatch.setenv("SLURM_JOB_ID", "918274")  # another job: the lock may be live
    with pytest.raises(RunDirLockedError, match="PID 4242 on host node-17-elsewhere"):
        RunLock(tmp_path).acquire()
    monkeypatch.delenv("SLURM_JOB_ID")  # not under SLURM: nothing to compare
    with pytest.raises(RunDirLockedError, match="PID 4242 on host node-17-elsewhere"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "918273")  # the requeued job itself
    lock = RunLock(tmp_path)
    lock.acquire()
    record = json.loads(path.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["slurm_job_id"] == "918273"
    assert "this SLURM job's (918273) from before its requeue" in capsys.readouterr().err
    lock.release()
    assert not path.exists()


# ----------------------------------------------------------------------------- in process
class _Raise(Callback):
    """Raises ``error`` from hook ``hook`` when ``trainer.global_step == at`` (a real exception
    from a real hook; only where it comes from is chosen)."""

    def __init__(self, hook: str, at: int, error: BaseException) -> None:
        self.at, self.error = at, error
        setattr(self, hook, self._maybe_raise)

    def _maybe_raise(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise self.error


class _Signal(Callback):
    """Sends this process a real ``sig`` at the start of the batch after update ``at``."""

    def __init__(self, sig: signal.Signals, at: int) -> None:
        self.sig, self.at = sig, at

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), self.sig)


def _fit(
    root: Path,
    model: Path,
    *callbacks: Callback,
    steps: int = 6,
    micro_batch_size: int = 16,
    mini_batch_size: int | None = None,
    every_n_train_steps: int = 10,
    **module_kw: Any,
):
    trainer_kw = {k: module_kw.pop(k) for k in ("min_steps",) if k in module_kw}
    module = DAPOModule(
        str(model),
        optimizer=module_kw.pop("optimizer", sgd),
        batching=BatchingConfig(mini_batch_size, micro_batch_size),
        parity_check_every=0,
        **module_kw,
    )
    callbacks = [
        ModelCheckpoint(
            dirpath=root / "ckpts", save_last=True, every_n_train_steps=every_n_train_steps
        ),
        RunGuard(),
        *callbacks,
    ]
    return fit(
        module, FixedBatches(fixed_batch(), steps=steps), callbacks, max_steps=steps,
        max_epochs=None, default_root_dir=root, enable_checkpointing=True,
        num_sanity_val_steps=0, **trainer_kw,
    )  # fmt: skip


def test_exception_between_updates_is_saved(tmp_path, tiny_checkpoint, capsys):
    boom = RuntimeError("reward server went away")
    with pytest.raises(RuntimeError, match="went away"):
        _fit(tmp_path, tiny_checkpoint, _Raise("on_train_batch_start", 3, boom))
    assert step_of(tmp_path / "ckpts" / "last.ckpt") == 3
    assert "saved on RuntimeError: reward server went away, update 3" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()


class _LastSaved(Callback):
    """Records the update held by ``last.ckpt`` at the start of every rollout step."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.seen.append(step_of(self.path) if self.path.exists() else None)


@pytest.mark.parametrize(
    ("before", "after", "every", "expected"),
    [(2, 4, 3, True), (4, 6, 3, False), (6, 8, 3, False), (19, 21, 20, True), (0, 5, 0, False)],
)
def test_skipped_a_save(before, after, every, expected):
    assert skipped_a_save(before, after, every) is expected


def test_a_periodic_save_stepped_over_by_a_rollout_step_is_made(tmp_path, tiny_checkpoint):
    """2 updates per rollout step, every_n_train_steps=3: ModelCheckpoint saves at update 6
    only (its count lands on a multiple); as the StepCheckpoint the guard makes of it, it also
    saves update 4 (3 stepped over) and 10 (9), under ModelCheckpoint's state key."""
    recorder = _LastSaved(tmp_path / "ckpts" / "last.ckpt")
    trainer = _fit(
        tmp_path, tiny_checkpoint, recorder, steps=10, mini_batch_size=2, every_n_train_steps=3
    )
    checkpoint = trainer.checkpoint_callback
    assert type(checkpoint) is StepCheckpoint
    assert checkpoint.state_key.startswith("ModelCheckpoint{")
    assert recorder.seen == [None, None, 4, 6, 6]  # at the starts of updates 1, 3, 5, 7, 9
    assert step_of(tmp_path / "ckpts" / "last.ckpt") == 10


def test_exception_inside_an_optimizer_step_is_not_saved(tmp_path, tiny_checkpoint, capsys):
    boom = RuntimeError("CUDA error: an illegal memory access")
    with pytest.raises(RuntimeError, match="illegal"):
        _fit(tmp_path, tiny_checkpoint, _Raise("on_before_optimizer_step", 3, boom))
    assert not (tmp_path / "ckpts" / "last.ckpt").exists()
    err = capsys.readouterr().err
    assert "not saved: it came in the middle of an optimizer step" in err


class _StopInBackward(Callback):
    """Records a stop request (what the SIGTERM handler does) in the first backward of the
    update after update ``at``; counts that update's backwards."""

    def __init__(self, at: int) -> None:
        self.at, self.backwards = at, 0

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: Any) -> None:
        if trainer.global_step == self.at:
            self.backwards += 1
            request_stop("SIGTERM")


def test_stop_between_micro_batches_drops_the_partial_update(tmp_path, tiny_checkpoint, capsys):
    """Issue 29: a stop during an update (2 micro-batches) whose rollout step has applied no
    update yet is honoured after the micro-batch under way: the partial update is dropped and
    update 2 is saved, equal to an uninterrupted 2-update run."""
    from dapo_lightning.interrupt import StopRequested, clear_stop_request

    stopper = _StopInBackward(at=2)
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            _fit(tmp_path / "a", tiny_checkpoint, stopper, micro_batch_size=8)
    finally:
        clear_stop_request()
    assert stopper.backwards == 1  # the second micro-batch never ran
    saved = torch.load(tmp_path / "a" / "ckpts" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2 and "saved on SIGTERM, update 2" in capsys.readouterr().err
    reference = _fit(tmp_path / "b", tiny_checkpoint, steps=2, micro_batch_size=8)
    expected = reference.lightning_module.state_dict()
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in expected.items())


def adamw_decaying(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def halving(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.5**update)


@pytest.mark.parametrize(
    ("micro_batch_size", "at"),
    [(16, 2), (4, 2), (4, 3)],
    ids=["before-the-second-update", "in-the-first-update", "inside-the-second-update"],
)
def test_stop_inside_a_multi_update_step_undoes_the_whole_step(
    tmp_path, tiny_checkpoint, capsys, micro_batch_size, at
):
    """Issue 29: rollout steps of 2 updates (mini-batches of 2 groups, AdamW, a learning rate
    halved each update); a stop in update 3 (the first of rollout step 2) or in update 4 used
    to let the step finish. Now the step is undone and update 2 is saved: its weights, Adam
    state, learning rate, scheduler and counters equal those of an uninterrupted 2-update run
    (a step's rollouts are generated again on resume)."""
    from dapo_lightning.interrupt import StopRequested, clear_stop_request

    settings = dict(mini_batch_size=2, optimizer=adamw_decaying, lr_scheduler=halving)
    try:
        with pytest.raises(StopRequested, match="SIGTERM"):
            _fit(tmp_path / "a", tiny_checkpoint, _StopInBackward(at), steps=6,
                 micro_batch_size=micro_batch_size, **settings)  # fmt: skip
    finally:
        clear_stop_request()
    assert "saved on SIGTERM, update 2" in capsys.readouterr().err
    saved = torch.load(tmp_path / "a" / "ckpts" / "last.ckpt", weights_only=False)
    _fit(tmp_path / "b", tiny_checkpoint, steps=2, micro_batch_size=micro_batch_size, **settings)
    expected = torch.load(tmp_path / "b" / "ckpts" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == expected["global_step"] == 2
    assert saved["dapo"]["policy_version"] == expected["dapo"]["policy_version"] == 2
    assert saved["dapo"]["rollout_step"] == 1
    assert saved["lr_schedulers"] == expected["lr_schedulers"]
    assert saved["lr_schedulers"][0]["_last_lr"] == [1e-2 * 0.25]  # the value: 2 halvings
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in expected["state_dict"].items())
    got, want = saved["optimizer_states"][0], expected["optimizer_states"][0]
    assert got["param_groups"] == want["param_groups"]
    assert got["param_groups"][0]["lr"] == 1e-2 * 0.25
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert int(got["state"][i]["step"]) == int(state["step"]) == 2
        assert torch.equal(got["state"][i]["exp_avg"], state["exp_avg"])
        assert torch.equal(got["state"][i]["exp_avg_sq"], state["exp_avg_sq"])
    loops = saved["loops"]["fit_loop"]["epoch_loop.manual_optimization.optim_step_progress"]
    assert loops["total"]["completed"] == 2


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """SIGINT handled as a fresh Python process does (KeyboardInterrupt) during the test, the
    worker's handler put back after. An earlier test in the same pytest worker may have left
    another one (Lightning sets SIGINT to SIG_IGN when a fit ends in KeyboardInterrupt and does
    not put it back), and the stop handlers rightly restore whatever was there before the fit:
    the full suite failed here once, by test order."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_stop_overruled_by_min_steps_still_stops(tmp_path, tiny_checkpoint, capfd, python_sigint):
    """A real SIGINT to this process: Lightning keeps going while ``min_steps`` is not reached
    (``should_stop`` is not honoured), so the guard stops at the next batch and saves."""
    with pytest.raises(SystemExit) as info, exit_on_stop():
        _fit(tmp_path, tiny_checkpoint, _Signal(signal.SIGINT, 2), min_steps=5)
    assert info.value.code == 130 and stop_requested() is None  # consumed by exit_on_stop
    assert step_of(tmp_path / "ckpts" / "last.ckpt") == 3  # the step under way finished
    assert "SIGINT received" in capfd.readouterr().err  # written to fd 2 by the handler
    with pytest.raises(KeyboardInterrupt):  # after the fit, Ctrl-C is Ctrl-C again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_checkpointing_off_saves_nothing(tmp_path, tiny_checkpoint):
    module = DAPOModule(
        str(tiny_checkpoint), optimizer=sgd, batching=BatchingConfig(micro_batch_size=16)
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RunGuard()],
    )
    trainer.fit(module, datamodule=FixedBatches(fixed_batch(), steps=2))
    assert trainer.global_step == 2 and list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_update(tmp_path, tiny_checkpoint):
    """Two real gloo ranks under torch.distributed.run; a real SIGINT reaches rank 0 only. Both
    ranks stop after the same update, take part in one save (rank 0 writes it) and exit 130."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(port), str(Path(__file__).with_name("_guard_dist_worker.py")),
         str(tmp_path), str(tiny_checkpoint)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode != 0  # the launcher reports the workers' stop
    assert "exitcode  : 130" in proc.stderr or "exit code 130" in proc.stderr, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"global_step": 3, "stop": "SIGINT"}] * 2  # rank 1 learned it collectively
    assert step_of(tmp_path / "ckpts" / "last.ckpt") == 3
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["last.ckpt"]
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow  # a console-script fit with a reward worker (~20 s idle): -m slow -k reward_hangs
def test_sigterm_while_a_reward_hangs_exits_at_once_with_the_last_update_saved(
    tiny_checkpoint, tmp_path
):
    """Issue 29: a reward that hangs in its worker held SIGTERM for minutes. Update 1 scores,
    update 2's reward hangs (timeout 300 s): SIGTERM kills the workers, the partial round is
    discarded, update 1 is saved and the command exits 143 within seconds."""

    marker = tmp_path / "calls.txt"
    run = tmp_path / "run"
    reward = {"class_path": "_hanging_reward.HangsAfterCalls", "init_args": {"marker": str(marker)}}
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": "checkpoints",
            "save_last": True,
            "save_top_k": 0,
            "every_n_train_steps": 100,
        },
    }
    config = write_run_config(
        tmp_path / "fit.yaml", run, tiny_checkpoint, base=ARITHMETIC_RUN,
        data={"init_args": {"reward": reward, "scoring": {"in_process": False, "timeout_s": 300}}},
        trainer={"max_steps": 5, "enable_checkpointing": True, "callbacks": [checkpoint]},
    )  # fmt: skip
    tests_dir = Path(__file__).parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
    }
    cli = [sys.executable, "-m", "dapo_lightning", "fit", f"--config={config}"]
    proc = subprocess.Popen(cli, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 400
    while not (marker.exists() and len(marker.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[1].decode()[-4000:]
        assert time.monotonic() < deadline, "the reward was never called twice"
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the hang
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    stopped_s = time.monotonic() - t0
    text = err.decode()
    assert proc.returncode == 143, text[-4000:]
    assert stopped_s < 20, stopped_s  # 10 s promised; the cores are shared
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 1, text[-4000:]
    assert "Saved" in text and "update 1" in text


# ----------------------------------------------------------------------------- during validation
def _validating_config(path: Path, marker: Path) -> Path:
    """Validation made long (20 held-out prompts x 4096 samples, one prompt per batch: seconds
    per batch) and marked: tests/_phase_marker.py appends "<update> <batch>" per validation
    batch."""
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": "checkpoints",
                "save_last": True,
                "every_n_train_steps": 100,
                "save_top_k": 0,
            },
        },
        {"class_path": "dapo_lightning.callbacks.ValidateAtStart"},
        {"class_path": "_phase_marker.ValidationMarker", "init_args": {"marker": str(marker)}},
    ]
    return write_run_config(
        path,
        trainer={"max_steps": 200, "val_check_interval": 1, "callbacks": callbacks},
        data={"init_args": {"validation": {"n": 4096, "batch_size": 1}}},
    )


def _sigterm_while_validating(tmp_path: Path, at: str) -> tuple[int, str, float]:
    """Start a fit of the random tiny model whose validations are long; SIGTERM it once the
    validation marker shows batch ``at`` (``"<update> <batch>"``) under way. Returns the exit
    status, stderr and the seconds from the signal to the exit."""
    marker = tmp_path / "validating.txt"
    override = _validating_config(tmp_path / "validating.yaml", marker)
    proc = subprocess.Popen(
        [CLI, "fit", "--config", QUICKSTART, "--config", str(override),
         "--trainer.default_root_dir", "run", "--create_model_if_missing.kind", "tiny"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not (marker.exists() and at in marker.read_text().splitlines()):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"validation batch {at!r} not reached in 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=240)
    stopped_s = time.monotonic() - t0
    assert marker.read_text().splitlines()[-1] == at  # stopped inside that batch
    return proc.returncode, err, stopped_s


def test_sigterm_during_the_initial_validation_exits_at_once(tmp_path):
    """Issue 29: SIGTERM while ValidateAtStart validates (update 0, second of 20 validation
    batches of seconds each): the engine stops inside the batch and the command exits 143
    within seconds, with nothing to save and no lock left."""
    code, err, stopped_s = _sigterm_while_validating(tmp_path, "0 1")
    assert code == 143, err[-4000:]
    assert stopped_s < 20, stopped_s  # 10 s promised; the cores are shared
    assert "SIGTERM: nothing to save yet (no update was made)." in err, err[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


@pytest.mark.slow  # two console-script fits (~40 s idle): pytest -m slow -k during_a_validation
def test_sigterm_during_a_validation_saves_the_update_and_resumes(tmp_path):
    """Issue 29: SIGTERM while the validation after update 1 runs (its second batch): exit 143
    within seconds with update 1 saved; ``--ckpt_path auto`` resumes at update 1 and trains
    on to update 2 (the interrupted validation is not repeated)."""
    code, err, stopped_s = _sigterm_while_validating(tmp_path, "1 1")
    assert code == 143, err[-4000:]
    assert stopped_s < 20, stopped_s  # 10 s promised; the cores are shared
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert re.search(r"Saved \S+ \(saved on SIGTERM, update 1\b", err), err[-3000:]
    assert step_of(last) == 1
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    proc = ok(
        cli(
            "fit", "--config", QUICKSTART, "--config", str(tmp_path / "validating.yaml"),
            "--trainer.default_root_dir", "run", "--create_model_if_missing.kind", "tiny",
            "--ckpt_path", "auto", "--trainer.max_steps", "2",
            "--data.init_args.validation.n", "2",
            cwd=tmp_path,
        )
    )  # fmt: skip
    assert re.search(r"Resuming from \S*/run/checkpoints/last\.ckpt at update 1", proc.stderr)
    assert [v for _, v in series(metrics(tmp_path / "run", version=1), "rollout/step")] == [2.0]
    assert step_of(last) == 2


class _StopAfterUpdate(DAPOCallback):
    """Records a stop request (what the SIGTERM handler does) right after update ``at``, the
    last of its rollout step: the guard sees it at that step's end."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_dapo_update(self, trainer: Trainer, pl_module: Any, metrics: dict) -> None:
        if trainer.global_step == self.at:
            request_stop("SIGTERM")


def test_a_stop_between_steps_is_saved_in_lightnings_end_of_batch_form(tmp_path, tiny_checkpoint):
    """Issue 53: a save between two rollout steps (a stop, the end of the fit) has every batch
    counter equal, which Lightning resumes one batch ahead (validation then came one rollout
    step early for the rest of the run); the guard writes it as a periodic save has it."""
    from dapo_lightning.interrupt import clear_stop_request

    try:
        _fit(tmp_path, tiny_checkpoint, _StopAfterUpdate(4), steps=8, mini_batch_size=2)
    finally:
        clear_stop_request()
    saved = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert saved["global_step"] == 4  # 2 rollout steps of 2 updates
    assert progress == {"ready": 2, "started": 2, "processed": 2, "completed": 1}


def test_as_batch_end_state_leaves_other_forms_alone():
    from dapo_lightning.lightning_internals import as_batch_end_state

    def state(ready, completed, last=False):
        counts = {"ready": ready, "started": ready, "processed": ready, "completed": completed}
        progress = {"total": dict(counts), "current": dict(counts), "is_last_batch": last}
        return {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}

    periodic, epoch_end, between = state(10, 9), state(10, 10, last=True), state(16, 16)
    assert not as_batch_end_state(periodic) and not as_batch_end_state(epoch_end)
    assert as_batch_end_state(between)
    assert between == state(16, 15)
    assert not as_batch_end_state({})  # no loop state (a weights-only file)
    # a stop inside step 17, undone: 17 ready and started, 16 processed and completed
    undone = state(17, 16)
    for counts in (
        undone["loops"]["fit_loop"]["epoch_loop.batch_progress"][k] for k in ("total", "current")
    ):
        counts["processed"] = 16
    assert as_batch_end_state(undone)
    assert undone == state(16, 15)
