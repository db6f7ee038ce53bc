"""The Lightning ``CheckpointIO`` of DAPO runs: atomic writes (:mod:`.files`), a checksum
manifest in every checkpoint (:mod:`.manifest`), no checkpoint of non-finite weights or
optimizer state, and a rotation that never keeps a damaged ``last.ckpt`` in place of the good
``last-previous.ckpt``.

Use it as a Trainer plugin: ``Trainer(plugins=[AtomicCheckpointIO()])``, or in a LightningCLI
config::

    trainer:
      plugins:
        - class_path: dapo_lightning.checkpoint.AtomicCheckpointIO

(:class:`~dapo_lightning.callbacks.RunGuard` installs it when the trainer has Lightning's plain
``TorchCheckpointIO``.) Remote (fsspec) paths fall back to Lightning's own transactional save.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from dapo_lightning.checkpoint.checks import checkpoint_error
from dapo_lightning.checkpoint.files import (
    atomic_torch_save,
    is_local,
    newest_checkpoint,
    previous_path,
)
from dapo_lightning.checkpoint.manifest import first_nonfinite, with_manifest


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint was not written because its weights or optimizer state hold NaN / inf.

    Args:
        path: The file that was not written.
        tensor: The first non-finite tensor's name (``state_dict.<weight>`` or
            ``optimizer_states.<...>``).
    """

    def __init__(self, path: Any, tensor: str) -> None:
        self.path = Path(str(path).removeprefix("file://"))
        last = newest_checkpoint(self.path.parent)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        weight = tensor.removeprefix("state_dict.")
        what = "weights" if weight != tensor else "optimizer state"
        super().__init__(
            f"not saved: {self.path.name} would hold non-finite {what} ({weight} has NaN / inf "
            f"values); {kept}."
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local saves are atomic (temporary file + fsync + rename)
    and carry a checksum manifest (see the module docstring).

    Loading is Lightning's (``weights_only`` is passed through: DAPO checkpoints hold only
    tensors and plain Python containers, so ``weights_only=True`` loads them).

    Args:
        keep_previous: When a save replaces a file, keep the old one as
            :func:`~dapo_lightning.checkpoint.files.previous_path` (``last.ckpt`` ->
            ``last-previous.ckpt``), the fallback of ``--ckpt_path auto``; a replaced file that
            fails verification (and that this object did not write) is not kept: the previous
            one stays. Costs the disk space of one more checkpoint.

    Raises:
        CheckpointDiskFullError: From :meth:`save_checkpoint`, when the disk is full.
        CheckpointNotWritableError: From :meth:`save_checkpoint`, when the folder refuses it.
        NonFiniteCheckpointError: From :meth:`save_checkpoint`, when a weight or an optimizer
            moment holds NaN / inf (the file is not written: the previous checkpoints stay).
    """

    def __init__(self, keep_previous: bool = True) -> None:
        super().__init__()
        self.keep_previous = keep_previous
        self._written: dict[str, tuple[int, int, int]] = {}  # path -> (inode, size, mtime)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint does not take storage_options: remove them "
                "or use another CheckpointIO plugin."
            )
        bad = first_nonfinite(checkpoint)
        if bad is not None:
            raise NonFiniteCheckpointError(path, bad)
        checkpoint = with_manifest(checkpoint)
        if not is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        local = Path(str(path).removeprefix("file://"))
        keep = self.keep_previous and self._worth_keeping(local)
        atomic_torch_save(checkpoint, local, keep_previous=keep)
        self._written[str(local)] = _signature(local)

    def _worth_keeping(self, path: Path) -> bool:
        """Whether the file ``path`` about to be replaced may become the previous checkpoint:
        one this object wrote (unchanged since), or one that verifies; a damaged one is said
        in one line and replaced without rotating the good previous one out."""
        if not path.is_file() or self._written.get(str(path)) == _signature(path):
            return True
        problem = checkpoint_error(path)
        if problem is None:
            return True
        print(
            f"not keeping {path} as {previous_path(path).name}: it fails verification "
            f"({problem}); {previous_path(path).name} stays as it was",
            file=sys.stderr,
            flush=True,
        )
        return False

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` and the previous checkpoint kept beside it."""
        super().remove_checkpoint(path)
        if is_local(path):
            previous_path(str(path).removeprefix("file://")).unlink(missing_ok=True)


def _signature(path: Path) -> tuple[int, int, int]:
    """``path``'s inode, size and modification time: changed by any write or replacement."""
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
