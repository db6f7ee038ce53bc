"""Damaged checkpoints and resumes that cannot work (issue 63, items 5, 6, 8, 9, 10), through the
real console script on checkpoints written by a real tiny fit:

* bytes overwritten in an AdamW ``exp_avg_sq`` of ``last.ckpt`` (``torch.load`` accepts the
  file) and 64 KiB of random bytes in its middle: ``--ckpt_path auto`` skips it with one line
  (the checksum manifest), resumes from ``last-previous.ckpt``, and the save that follows never
  rotates the good checkpoint out for the damaged one;
* a checkpoint folder made read-only mid-run (``chattr +i``: the test runs as root, whom file
  modes do not stop): one error line, exit 1, the checkpoints already there intact;
* a resume with another optimizer class, or another number of ranks: one error line, exit 2;
* a run stopped by a CollapseDetector ``stop`` action: one error line, exit 1.

Unit checks of the manifest itself: tests/test_checkpoint.py.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._harness import CLI, QUICKSTART, cli_env, run_cli, write_run_config

#: Saves every 2 updates (the fixture's fit ends at update 4: last.ckpt 4, last-previous 2).
CHECKPOINTS = {
    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
    "init_args": {
        "dirpath": "checkpoints",
        "save_last": True,
        "every_n_train_steps": 2,
        "save_top_k": 0,
    },
}


def _config(path: Path, max_steps: int = 4, callbacks: list[dict[str, Any]] | None = None) -> Path:
    trainer = {"max_steps": max_steps, "callbacks": [CHECKPOINTS, *(callbacks or [])]}
    return write_run_config(path, trainer=trainer)


def _fit(cwd: Path, config: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(
        "fit", "--config", QUICKSTART, "--config", str(config),
        "--trainer.default_root_dir", "run", "--create_model_if_missing.kind", "tiny",
        *args, env={"OMP_NUM_THREADS": "1"}, cwd=cwd, timeout=timeout,
    )  # fmt: skip


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _floats(checkpoint: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if torch.is_tensor(value) and value.is_floating_point():
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk({k: checkpoint[k] for k in ("state_dict", "optimizer_states")})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real fit to update 4 (saves at 2 and 4): ``run/checkpoints/last.ckpt`` (update 4)
    beside ``last-previous.ckpt`` (update 2)."""
    cwd = tmp_path_factory.mktemp("trained")
    config = _config(cwd.parent / f"{cwd.name}.yaml")
    proc = _fit(cwd, config)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = cwd / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4
    return {"cwd": cwd, "config": config}


def _copy(trained: dict[str, Path], to: Path) -> Path:
    """A copy of the trained run under ``to`` (run it with cwd ``to``); its checkpoint folder."""
    shutil.copytree(trained["cwd"] / "run", to / "run")
    return to / "run" / "checkpoints"


def _overwrite_optimizer_bytes(path: Path) -> str:
    """16 bytes of 0xFF (a NaN pattern) written over the middle of the largest ``exp_avg_sq``
    of ``path``, found by its bytes in the file; returns the tensor's name."""
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    key, tensor = max(
        ((k, s["exp_avg_sq"]) for k, s in state.items()), key=lambda kv: kv[1].numel()
    )
    raw = path.read_bytes()
    at = raw.find(tensor.contiguous().numpy().tobytes())
    assert at > 0 and tensor.numel() * 4 > 64
    middle = at + (tensor.numel() * 4 // 2) // 16 * 16
    path.write_bytes(raw[:middle] + b"\xff" * 16 + raw[middle + 16 :])
    assert torch.load(path, weights_only=True)["global_step"] == 4  # torch.load takes it
    return f"exp_avg_sq of parameter {key}"


def _random_bytes_in_the_middle(path: Path) -> None:
    """64 KiB of random bytes over the middle of ``path`` (same size)."""
    raw = path.read_bytes()
    middle = len(raw) // 2
    noise = random.Random(0).randbytes(64 * 1024)
    path.write_bytes(raw[:middle] + noise + raw[middle + len(noise) :])
    assert len(path.read_bytes()) == len(raw)


@pytest.mark.parametrize("damage", ["optimizer-bytes", "random-middle"])
def test_auto_skips_a_damaged_last_ckpt_and_keeps_the_good_one(trained, tmp_path, damage):
    """Items 5 and 6: ``auto`` names the damaged ``last.ckpt``, resumes from the good
    ``last-previous.ckpt`` (update 2), and the resumed run's save at update 4 replaces the
    damaged file without rotating the good one out; every checkpoint left verifies, finite."""
    folder = _copy(trained, tmp_path)
    last, previous = folder / "last.ckpt", folder / "last-previous.ckpt"
    good = _sha(previous)
    if damage == "optimizer-bytes":
        _overwrite_optimizer_bytes(last)
    else:
        _random_bytes_in_the_middle(last)
    proc = _fit(tmp_path, trained["config"], "--ckpt_path", "auto")
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err
    assert re.search(r"auto: skipping \S*run/checkpoints/last\.ckpt: ", err), err[-3000:]
    assert re.search(r"Resuming from \S*run/checkpoints/last-previous\.ckpt at update 2", err)
    assert _sha(previous) == good  # the good checkpoint was not rotated out for the bad one
    newest = max(folder.glob("last*.ckpt"), key=os.path.getmtime)
    final = torch.load(newest, weights_only=True)
    assert final["global_step"] == 4
    assert all(bool(torch.isfinite(t).all()) for t in _floats(final))


def test_explicit_ckpt_path_to_a_damaged_file_is_one_error_line(trained, tmp_path):
    """``--ckpt_path .../last.ckpt`` naming the file with bytes overwritten in its optimizer
    state: one error line naming the file and the fix, exit 2, nothing trained."""
    folder = _copy(trained, tmp_path)
    _overwrite_optimizer_bytes(folder / "last.ckpt")
    proc = _fit(tmp_path, trained["config"], "--ckpt_path", "run/checkpoints/last.ckpt")
    lines = _errors(proc)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "ckpt_path: run/checkpoints/last.ckpt" in lines[0] and "checksum" in lines[0]
    assert "last-previous.ckpt" in lines[0] and "--ckpt_path auto" in lines[0]


def test_another_optimizer_on_resume_is_one_error_line(trained, tmp_path):
    """Item 9: an AdamW checkpoint resumed with SGD in the config: one line naming both
    optimizers and the fixes (a fresh run, or the weights only through export), exit 2."""
    _copy(trained, tmp_path)
    sgd = write_run_config(
        tmp_path / "sgd.yaml",
        model={"init_args": {"optimizer": {"class_path": "torch.optim.SGD",
                                           "init_args": {"lr": 0.01, "momentum": 0.9}}}},
    )  # fmt: skip
    proc = _fit(
        tmp_path, trained["config"], "--config", str(sgd), "--ckpt_path", "auto",
        "--trainer.max_steps", "6",
    )  # fmt: skip
    lines = _errors(proc)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "model.optimizer" in lines[0] and "SGD" in lines[0] and "AdamW" in lines[0], lines[0]
    assert "fresh run" in lines[0] and "dapo-lightning export" in lines[0], lines[0]


def test_another_rank_count_on_resume_is_one_error_line_before_ranks_start(trained, tmp_path):
    """Item 10 (1 -> 2): one line naming both rank counts and the fix, exit 2, before a second
    rank is started (no process group is set up)."""
    _copy(trained, tmp_path)
    proc = _fit(
        tmp_path, trained["config"], "--ckpt_path", "auto",
        "--trainer.devices", "2", "--trainer.strategy", "ddp",
    )  # fmt: skip
    lines = _errors(proc)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "1 rank" in lines[0] and "2" in lines[0] and "trainer.devices" in lines[0], lines[0]
    assert "distributed" not in proc.stderr.lower(), proc.stderr[-3000:]


def _immutable(folder: Path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True)


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs)")
def test_checkpoint_folder_made_read_only_mid_run_is_one_line(trained, tmp_path):
    """Item 8: the checkpoint folder made immutable (``chattr +i``: root ignores file modes)
    after the save of update 2: the save of update 4 fails with one error line naming the
    folder, exit 1 (as a full disk), and the checkpoint of update 2 is intact."""
    folder = _copy(trained, tmp_path)
    for path in folder.iterdir():
        path.unlink()
    config = _config(tmp_path / "long.yaml", max_steps=40)
    proc = subprocess.Popen(
        [CLI, "fit", "--config", QUICKSTART, "--config", str(config),
         "--trainer.default_root_dir", "run"],
        cwd=tmp_path, env=cli_env({"OMP_NUM_THREADS": "1"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    last = folder / "last.ckpt"
    try:
        deadline = time.monotonic() + 240
        while not last.exists():
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no save of update 2 within 240 s"
            time.sleep(0.02)
        time.sleep(0.5)  # the rename is done: the folder is complete
        saved = _sha(last)
        _immutable(folder, True)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _immutable(folder, False)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 1, err[-4000:]
    assert "Traceback" not in err and len(lines) == 1, err[-4000:]
    assert "run/checkpoints" in lines[0] and "not writable" in lines[0], lines[0]
    assert "--ckpt_path auto" in lines[0]
    assert _sha(last) == saved and not list(folder.glob(".*.tmp"))


def test_a_collapse_stop_exits_non_zero_with_one_line(tmp_path, trained):
    """Item 5's end: a CollapseDetector ``stop`` action ends the run with its reason on one
    error line and exit 1 (it used to exit 0); the state at the stop is saved first."""
    detector = {
        "class_path": "dapo_lightning.callbacks.CollapseDetector",
        "init_args": {
            "detectors": [
                {"signal": "length_low", "threshold": 1000.0, "patience": 1, "action": "stop"}
            ]
        },
    }
    shutil.copytree(trained["cwd"] / "run" / "model", tmp_path / "run" / "model")
    proc = _fit(tmp_path, _config(tmp_path / "collapse.yaml", 4, [detector]))
    lines = _errors(proc)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "CollapseDetector" in lines[0] and "length_low" in lines[0], lines[0]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 1


@pytest.mark.distributed
def test_two_rank_checkpoint_resumed_on_one_rank_is_one_error_line(tmp_path, trained):
    """Item 10 (2 -> 1): a checkpoint of a real 2-rank DDP fit resumed on one rank: one line
    naming both rank counts and the fix, exit 2, where each rank printed a ValueError
    traceback."""
    shutil.copytree(trained["cwd"] / "run" / "model", tmp_path / "run" / "model")
    config = _config(tmp_path / "two.yaml", max_steps=2)
    two = _fit(tmp_path, config, "--trainer.devices", "2", "--trainer.strategy", "ddp")
    assert two.returncode == 0, two.stderr[-4000:]
    proc = _fit(tmp_path, config, "--ckpt_path", "auto", "--trainer.max_steps", "4")
    lines = _errors(proc)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "saved by 2 ranks and this run has 1" in lines[0], lines[0]
    assert "trainer.devices x trainer.num_nodes = 2" in lines[0], lines[0]
