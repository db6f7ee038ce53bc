"""Resume discovery (``--ckpt_path auto``): the candidates of a run directory
(:func:`resume_candidates`) and the one to take (:func:`find_resume_checkpoint`): the highest
update among those that load and verify, each damaged one skipped with one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from dapo_lightning.checkpoint.checks import read_update, verify_checkpoint
from dapo_lightning.lightning_internals import last_checkpoint_paths

#: ``hpc_ckpt_<n>.ckpt``: what Lightning's SLURM auto-requeue writes into default_root_dir.
_HPC_CKPT = re.compile(r"hpc_ckpt_\d+\.ckpt")


def resume_candidates(trainer: Any) -> list[str]:
    """The checkpoints ``trainer`` could resume from, modified last first (the order only
    breaks ties: :func:`find_resume_checkpoint` ranks them by their update).

    Candidates: every ``last*.ckpt`` (``last-previous.ckpt`` included) in the ``dirpath`` of the
    trainer's ``ModelCheckpoint`` callbacks, and every ``hpc_ckpt_<n>.ckpt`` in
    ``trainer.default_root_dir``. Folders named ``*.ckpt`` (sharded checkpoints) count too.
    """
    found: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found |= last_checkpoint_paths(callback, trainer)
    root = Path(trainer.default_root_dir)
    if root.is_dir():
        found |= {str(p) for p in root.iterdir() if _HPC_CKPT.fullmatch(p.name)}
    existing = [p for p in found if os.path.exists(p)]
    return sorted(existing, key=lambda p: (os.path.getmtime(p), p), reverse=True)


def find_resume_checkpoint(trainer: Any, report: Callable[[str], None] | None = None) -> str | None:
    """The checkpoint of :func:`resume_candidates` with the highest update that loads and
    verifies, or None to start fresh.

    The update is read from each checkpoint (its ``global_step``), never taken from the file's
    modification time: a ``cp -r`` or ``rsync`` of a run directory gives its files new times in
    any order. Among equal updates (or updates that cannot be read) the file modified last wins.
    Each unloadable one (:func:`~dapo_lightning.checkpoint.checks.read_update`) is skipped and
    reported; then the loadable ones are verified (checksum manifest, finite values:
    :func:`~dapo_lightning.checkpoint.checks.verify_checkpoint`) from the highest update down,
    until one passes: a run whose newest checkpoint was cut short or damaged resumes from the
    one before it, and each file is read in full at most once.

    Args:
        trainer: The trainer about to fit.
        report: Called with one line per skipped checkpoint (e.g. ``print``) and one saying
            which file was taken and why (:func:`resume_choice`).
    """
    say = report or (lambda line: None)
    loadable: list[tuple[str, int]] = []  # modified last first
    for path in resume_candidates(trainer):
        step, error = read_update(path)
        if error is not None:
            say(f"skipping {path}: it cannot be loaded ({error})")
            continue
        loadable.append((path, -1 if step is None else step))
    for best in sorted(loadable, key=lambda found: -found[1]):  # stable: modified last first
        damaged = verify_checkpoint(best[0])
        if damaged is None:
            say(resume_choice(best, loadable))
            return best[0]
        say(f"skipping {best[0]}: it fails verification ({damaged})")
        loadable.remove(best)
    return None


def resume_choice(best: tuple[str, int], loadable: list[tuple[str, int]]) -> str:
    """Which checkpoint ``--ckpt_path auto`` took and why: ``best`` (path, update) among
    ``loadable`` (modified last first); a file written after it at a lower update (a fresh run's
    beside a stale run's) is named, with how to resume that one instead."""
    path, step = best
    of = f", the highest of {len(loadable)} loadable checkpoints; read from each file"
    line = f"resuming from {path} (update {step}{of if len(loadable) > 1 else ''})"
    later = [found for found in loadable[: loadable.index(best)] if found[1] < step]
    if later:
        other, other_step = later[0]
        line += (
            f"; {other} was written after it, at update {other_step} (a fresh run started in "
            f"this folder?): to resume that run instead, give --ckpt_path {other}"
        )
    return line
