"""DAPO checkpoints: crash-safe files, a checksum manifest, resume discovery and the checks made
before a checkpoint is taken (docs/design.md, "Stopping and resuming"). One concept per module:

* :mod:`.files`: atomic writes (temporary file, fsync, rename), ``last-previous.ckpt``, the
  write errors (a full disk, a folder that refuses the write);
* :mod:`.manifest`: the CRC-32 of every tensor, written with each save and checked before a
  resume; non-finite weights or optimizer state;
* :mod:`.io`: :class:`AtomicCheckpointIO`, the Lightning plugin that writes through them;
* :mod:`.checks`: does a file load and verify, does ``--ckpt_path`` name one, does it fit the
  model and the rank count;
* :mod:`.resume`: ``--ckpt_path auto``'s candidates and choice;
* :mod:`.optimizer`: the config's optimizer settings on resume, a changed optimizer class.

Every name is importable from here (a config's ``trainer.plugins`` names
``dapo_lightning.checkpoint.AtomicCheckpointIO``); the library imports each from its module.
"""

from dapo_lightning.checkpoint.checks import (
    check_checkpoint_fits,
    check_ckpt_path,
    check_rank_count,
    checkpoint_error,
    inspect_checkpoint,
    is_sharded_checkpoint,
    read_update,
    verify_checkpoint,
)
from dapo_lightning.checkpoint.files import (
    CheckpointDiskFullError,
    CheckpointNotWritableError,
    CheckpointWriteError,
    atomic_torch_save,
    newest_checkpoint,
    previous_path,
)
from dapo_lightning.checkpoint.io import AtomicCheckpointIO, NonFiniteCheckpointError
from dapo_lightning.checkpoint.manifest import (
    MANIFEST_KEY,
    first_nonfinite,
    manifest_error,
    with_manifest,
)
from dapo_lightning.checkpoint.optimizer import (
    apply_optimizer_settings,
    check_same_optimizer,
    optimizer_settings,
)
from dapo_lightning.checkpoint.resume import (
    find_resume_checkpoint,
    resume_candidates,
    resume_choice,
)

__all__ = [
    "MANIFEST_KEY",
    "AtomicCheckpointIO",
    "CheckpointDiskFullError",
    "CheckpointNotWritableError",
    "CheckpointWriteError",
    "NonFiniteCheckpointError",
    "apply_optimizer_settings",
    "atomic_torch_save",
    "check_checkpoint_fits",
    "check_ckpt_path",
    "check_rank_count",
    "check_same_optimizer",
    "checkpoint_error",
    "find_resume_checkpoint",
    "first_nonfinite",
    "inspect_checkpoint",
    "is_sharded_checkpoint",
    "manifest_error",
    "newest_checkpoint",
    "optimizer_settings",
    "previous_path",
    "read_update",
    "resume_candidates",
    "resume_choice",
    "verify_checkpoint",
    "with_manifest",
]
