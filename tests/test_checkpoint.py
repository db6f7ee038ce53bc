"""Checkpoint files (dapo_lightning/checkpoint.py): the previous checkpoint kept beside the newest,
loadability checks and the ``--ckpt_path auto`` fallback, a full disk, and the config's optimizer
settings put back after a resume. (Killed writers: tests/test_resume_kill.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.types import LRSchedulerConfig

from dapo_lightning.checkpoint import (
    MANIFEST_KEY,
    AtomicCheckpointIO,
    CheckpointDiskFullError,
    CheckpointNotWritableError,
    NonFiniteCheckpointError,
    apply_optimizer_settings,
    atomic_torch_save,
    checkpoint_error,
    find_resume_checkpoint,
    inspect_checkpoint,
    manifest_error,
    optimizer_settings,
    previous_path,
    read_update,
    resume_candidates,
)
from tests._harness import make_trainer


def _save(path: Path, step: int, mtime: float | None = None) -> Path:
    AtomicCheckpointIO(keep_previous=False).save_checkpoint({"global_step": step}, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_overwrite_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    assert not previous_path(path).exists()  # nothing replaced yet
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert previous_path(path) == tmp_path / "last-previous.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert torch.load(previous_path(path), weights_only=True)["global_step"] == 1
    io.save_checkpoint({"global_step": 3}, path)
    assert torch.load(previous_path(path), weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-previous.ckpt", "last.ckpt"]
    io.remove_checkpoint(path)  # removing a checkpoint removes the one kept beside it
    assert list(tmp_path.iterdir()) == []


class _Custom:
    """Not allowed by ``weights_only=True``: the file is complete all the same."""


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: _save(p, 1), None),
        (lambda p: (_save(p, 1), _truncate(p)), "cannot"),
        (lambda p: p.write_bytes(b""), "cannot"),
        (lambda p: torch.save({"obj": _Custom()}, p), None),
        (lambda p: p.mkdir(), "empty checkpoint folder"),
        (lambda p: (p.mkdir(), (p / "shard_0.pt").write_bytes(b"x")), None),
    ],
    ids=["complete", "truncated", "empty", "custom-object", "empty-folder", "sharded-folder"],
)
def test_checkpoint_error(tmp_path, make, problem):
    path = tmp_path / "last.ckpt"
    make(path)
    error = checkpoint_error(path)
    if problem is None:
        assert error is None
    else:
        assert error is not None and (problem == "cannot" or problem in error)


def _trainer(root: Path) -> Trainer:
    return make_trainer(
        [ModelCheckpoint(dirpath=root / "ckpts", save_last=True)],
        default_root_dir=root, max_epochs=None, enable_checkpointing=True,
    )  # fmt: skip


def test_resume_picks_the_newest_loadable_checkpoint(tmp_path):
    trainer = _trainer(tmp_path)
    assert find_resume_checkpoint(trainer) is None
    now = time.time()
    older = _save(tmp_path / "ckpts" / "last-previous.ckpt", 1, now - 200)
    last = _save(tmp_path / "ckpts" / "last.ckpt", 2, now - 100)
    _save(tmp_path / "ckpts" / "epoch=0-step=5.ckpt", 5, now)  # not a last checkpoint
    assert resume_candidates(trainer) == [str(last), str(older)]
    assert find_resume_checkpoint(trainer) == str(last)
    hpc = _save(tmp_path / "hpc_ckpt_1.ckpt", 3, now - 50)  # SLURM requeue, a later update
    assert find_resume_checkpoint(trainer) == str(hpc)
    _save(last, 4, now)  # a later last.ckpt beats an older requeue checkpoint
    assert find_resume_checkpoint(trainer) == str(last)


def test_resume_picks_the_highest_update_not_the_newest_file(tmp_path):
    """Issue 38: after ``cp -r`` of a run the files' times follow the copy's order; the update
    is read from each checkpoint. A tie goes to the file modified last; an unloadable file with
    the highest update is skipped."""
    trainer = _trainer(tmp_path)
    now = time.time()
    last = _save(tmp_path / "ckpts" / "last.ckpt", 18, now - 100)
    previous = _save(tmp_path / "ckpts" / "last-previous.ckpt", 14, now)  # copied last
    hpc = _save(tmp_path / "hpc_ckpt_2.ckpt", 16, now + 10)
    assert find_resume_checkpoint(trainer) == str(last)
    tie = _save(tmp_path / "ckpts" / "last-v1.ckpt", 18, now - 50)
    assert find_resume_checkpoint(trainer) == str(tie)
    _truncate(tie)
    _truncate(last)
    skipped: list[str] = []
    assert find_resume_checkpoint(trainer, skipped.append) == str(hpc)
    *skipped, chose = skipped  # the last line: which file was taken, and why
    assert len(skipped) == 2 and all("cannot be loaded" in line for line in skipped)
    assert chose.startswith(f"resuming from {hpc} (update "), chose
    hpc.unlink()
    assert find_resume_checkpoint(trainer) == str(previous)


def test_truncated_newest_falls_back_to_the_previous_one(tmp_path):
    trainer = _trainer(tmp_path)
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"global_step": 40}, path)
    io.save_checkpoint({"global_step": 50}, path)
    _truncate(path)  # e.g. copied back from a full disk, or written by a non-atomic tool
    skipped: list[str] = []
    chosen = find_resume_checkpoint(trainer, skipped.append)
    assert chosen == str(previous_path(path))
    assert torch.load(chosen, weights_only=True)["global_step"] == 40
    assert len(skipped) == 2 and str(path) in skipped[0] and "cannot be loaded" in skipped[0]
    assert skipped[1] == f"resuming from {chosen} (update 40)"
    _truncate(previous_path(path))
    assert find_resume_checkpoint(trainer) is None  # nothing loadable: start fresh


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_disk_names_the_directory_and_keeps_the_old_checkpoint(tmp_path):
    """A real ENOSPC from the kernel: the writer's temporary file is made a link to /dev/full
    (every write to it fails with ENOSPC), so only where the full disk is met is arranged."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)
    tmp = tmp_path / ".last.ckpt.tmp"
    tmp.symlink_to("/dev/full")
    with pytest.raises(CheckpointDiskFullError) as info:
        atomic_torch_save({"global_step": 2, "w": torch.zeros(1000)}, path, keep_previous=True)
    message = str(info.value)
    assert "No space left on device" in message and str(path) in message
    assert f"{tmp_path} has " in message and " free" in message  # the directory's free space
    assert "--ckpt_path auto" in message
    assert info.value.free_bytes > 0 and isinstance(info.value, OSError)
    assert torch.load(path, weights_only=True) == {"global_step": 1}  # untouched
    assert not tmp.exists() and not previous_path(path).exists()


def _optimizer_and_scheduler(lr: float, weight_decay: float):
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return optimizer, scheduler


def test_config_optimizer_settings_replace_the_checkpoints(tmp_path):
    """What a resume does: the optimizer is built from the config (lr 1e-4), then the
    checkpoint's state (lr 1e-3, two scheduler steps in) is loaded over it; the config's
    hyper-parameters are put back, the schedule continues at the new peak, moments are kept."""
    old_opt, old_sched = _optimizer_and_scheduler(1e-3, 0.0)
    old_opt.param_groups[0]["params"][0].grad = torch.ones(2)
    for _ in range(2):
        old_opt.step()
        old_sched.step()
    saved_opt, saved_sched = old_opt.state_dict(), old_sched.state_dict()

    new_opt, new_sched = _optimizer_and_scheduler(1e-4, 0.01)
    # the container of the trainer's optimizers and schedulers; both are real torch objects
    trainer = SimpleNamespace(
        optimizers=[new_opt], lr_scheduler_configs=[LRSchedulerConfig(new_sched)]
    )
    configured = optimizer_settings(trainer)
    new_opt.load_state_dict(saved_opt)
    new_sched.load_state_dict(saved_sched)
    assert new_opt.param_groups[0]["initial_lr"] == 1e-3  # the checkpoint's, silently

    changes = apply_optimizer_settings(trainer, configured)
    assert changes == [
        "weight_decay: 0.0 (checkpoint) -> 0.01 (config)",
        "lr: 0.001 (checkpoint) -> 0.0001 (config)",
    ]
    group = new_opt.param_groups[0]
    assert group["initial_lr"] == 1e-4 and group["weight_decay"] == 0.01
    assert group["lr"] == pytest.approx(1e-4 * 3 / 4)  # step 2 of the 4-step warm-up
    assert new_sched.base_lrs == [1e-4]
    new_sched.step()
    assert group["lr"] == pytest.approx(1e-4)  # the schedule goes on, at the new peak
    assert torch.equal(new_opt.state[group["params"][0]]["step"], torch.tensor(2.0))
    assert apply_optimizer_settings(trainer, optimizer_settings(trainer)) == []


# ----------------------------------------------------------------------------- the manifest
def _adamw_checkpoint(step: int, scale: float = 1.0) -> dict:
    """A checkpoint holding real AdamW state (two steps on a 64-element parameter)."""
    weight = torch.nn.Parameter(torch.linspace(-1, 1, 64) * scale)
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    for _ in range(2):
        weight.grad = torch.ones(64) * scale
        optimizer.step()
    return {
        "global_step": step,
        "state_dict": {"w": weight.detach().clone()},
        "optimizer_states": [optimizer.state_dict()],
    }


def _overwrite_in_tensor(path: Path, tensor: torch.Tensor, data: bytes) -> None:
    """``data`` written over the middle of ``tensor``'s bytes in the file ``path``."""
    raw = path.read_bytes()
    at = raw.find(tensor.contiguous().numpy().tobytes())
    assert at > 0
    middle = at + tensor.numel() * tensor.element_size() // 2
    path.write_bytes(raw[:middle] + data + raw[middle + len(data) :])


def test_every_save_carries_a_manifest_that_finds_damaged_tensors(tmp_path):
    """The manifest names each tensor by its place with the CRC-32 of its bytes; bytes changed
    inside the file (``torch.load`` takes them) are found and named, with a finite value too."""
    path = tmp_path / "last.ckpt"
    saved = _adamw_checkpoint(7)
    AtomicCheckpointIO().save_checkpoint(saved, path)
    loaded = torch.load(path, weights_only=True)
    tensors = loaded[MANIFEST_KEY]["tensors"]
    assert {"state_dict.w", "optimizer_states.0.state.0.exp_avg_sq"} <= set(tensors)
    assert MANIFEST_KEY not in saved  # the caller's dict is left as it was
    assert manifest_error(loaded) is None and checkpoint_error(path) is None
    assert inspect_checkpoint(path) == (7, None)
    moment = saved["optimizer_states"][0]["state"][0]["exp_avg_sq"]
    _overwrite_in_tensor(path, moment, torch.tensor([0.5, 0.25]).numpy().tobytes())  # finite
    assert torch.load(path, weights_only=True)["global_step"] == 7  # torch.load takes it
    assert checkpoint_error(path) == (
        "optimizer_states.0.state.0.exp_avg_sq does not match its checksum: the file is damaged"
    )
    assert read_update(path) == (7, None)  # the header alone cannot tell


def test_checkpoint_without_a_manifest_is_checked_for_non_finite_values(tmp_path):
    """A checkpoint of an older version (no manifest) loads; one whose optimizer state holds
    NaN is refused on load, naming the tensor."""
    path = tmp_path / "old.ckpt"
    old = _adamw_checkpoint(3)
    torch.save(old, path)
    assert checkpoint_error(path) is None
    old["optimizer_states"][0]["state"][0]["exp_avg_sq"][5] = float("nan")
    torch.save(old, path)
    assert checkpoint_error(path) == "optimizer_states.0.state.0.exp_avg_sq holds NaN / inf values"


def test_non_finite_optimizer_state_is_never_written(tmp_path):
    """Finite weights over a NaN moment (what a skipped update leaves after a bad resume): the
    save is refused, naming the moment; the good checkpoint and its previous stay."""
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_adamw_checkpoint(1), path)
    io.save_checkpoint(_adamw_checkpoint(2), path)
    bad = _adamw_checkpoint(3)
    bad["optimizer_states"][0]["state"][0]["exp_avg_sq"][0] = float("inf")
    moment = r"\(optimizer_states\.0\.state\.0\.exp_avg_sq has NaN / inf values\)"
    with pytest.raises(NonFiniteCheckpointError, match=r"non-finite optimizer state " + moment):
        io.save_checkpoint(bad, path)
    assert inspect_checkpoint(path) == (2, None)
    assert inspect_checkpoint(previous_path(path)) == (1, None)


def test_rotation_never_keeps_a_damaged_file_over_the_good_previous_one(tmp_path, capsys):
    """A ``last.ckpt`` damaged on disk (not as this writer left it) is replaced by the next save
    without becoming ``last-previous.ckpt``: the good previous one stays, and one line says so.
    A file this writer wrote itself is rotated without being read again."""
    path = tmp_path / "last.ckpt"
    first = AtomicCheckpointIO()
    first.save_checkpoint(_adamw_checkpoint(2), path)
    damaged = _adamw_checkpoint(4)
    first.save_checkpoint(damaged, path)
    good = previous_path(path).read_bytes()
    _overwrite_in_tensor(path, damaged["state_dict"]["w"], b"\xff" * 16)
    resumed = AtomicCheckpointIO()  # a new process: it did not write last.ckpt
    resumed.save_checkpoint(_adamw_checkpoint(3), path)
    assert previous_path(path).read_bytes() == good
    assert inspect_checkpoint(path) == (3, None)
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"not keeping {path} as last-previous.ckpt: it fails verification (")
    assert line.endswith("last-previous.ckpt stays as it was")
    resumed.save_checkpoint(_adamw_checkpoint(5), path)  # its own file: rotated
    assert inspect_checkpoint(previous_path(path)) == (3, None)


def test_auto_skips_a_damaged_newest_and_takes_the_next_good_one(tmp_path):
    """``--ckpt_path auto`` reads every candidate's update, then verifies from the highest
    down: a damaged update-4 file is skipped with one line naming why, the update-2 one taken."""
    trainer = _trainer(tmp_path)
    io, path = AtomicCheckpointIO(), tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint(_adamw_checkpoint(2), path)
    damaged = _adamw_checkpoint(4)
    io.save_checkpoint(damaged, path)
    _overwrite_in_tensor(path, damaged["optimizer_states"][0]["state"][0]["exp_avg"], b"\0" * 16)
    lines: list[str] = []
    assert find_resume_checkpoint(trainer, lines.append) == str(previous_path(path))
    assert lines == [
        f"skipping {path}: it fails verification (optimizer_states.0.state.0.exp_avg does not "
        "match its checksum: the file is damaged)",
        f"resuming from {previous_path(path)} (update 2)",
    ]


def test_read_only_folder_is_one_clear_error(tmp_path):
    """A folder that refuses the write (``chattr +i`` as root, whom modes do not stop; a real
    EPERM from the kernel) raises CheckpointNotWritableError naming it; nothing changes."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr")
    path = tmp_path / "ckpts" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_adamw_checkpoint(1), path)
    before = path.read_bytes()
    subprocess.run(["chattr", "+i", str(path.parent)], check=True)
    try:
        with pytest.raises(CheckpointNotWritableError) as info:
            AtomicCheckpointIO().save_checkpoint(_adamw_checkpoint(2), path)
    finally:
        subprocess.run(["chattr", "-i", str(path.parent)], check=True)
    message = str(info.value)
    assert f"the checkpoint folder {path.parent} is not writable (" in message
    assert "--ckpt_path auto" in message and isinstance(info.value, OSError)
    assert path.read_bytes() == before and not list(path.parent.glob(".*.tmp"))
