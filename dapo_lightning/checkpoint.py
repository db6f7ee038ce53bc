"""Crash-safe checkpoint files: write to a temporary file, fsync, then atomically rename.

A run killed while writing ``last.ckpt`` (SIGKILL, OOM killer, a pre-empted node) must never
leave a truncated file where the previous good checkpoint was, or the resume that follows fails
or, worse, loads garbage. :class:`AtomicCheckpointIO` writes every checkpoint as::

    tmp = <dir>/.<name>.tmp             (same directory, hence the same file system)
    torch.save(checkpoint, tmp); flush; fsync(tmp)
    os.replace(tmp, path)                (atomic on POSIX: readers see the old or the new file)
    fsync(<dir>)                         (the rename itself survives a power loss)

so at every instant ``path`` holds either the complete previous checkpoint or the complete new
one. A leftover ``.<name>.tmp`` from a killed writer is never read; the next save of the same
file truncates and reuses it. (Only one process may write a given path at a time, as with
Lightning, where global rank 0 writes.) Remote (fsspec) paths fall back to Lightning's own transactional save.

Use it as a Trainer plugin: ``Trainer(plugins=[AtomicCheckpointIO()])``, or in a LightningCLI
config::

    trainer:
      plugins:
        - class_path: dapo_lightning.checkpoint.AtomicCheckpointIO
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO


def _is_local(path: _PATH) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` half-written (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory file descriptors
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local saves are atomic (temporary file + fsync + rename).

    Loading is Lightning's (``weights_only`` is passed through: DAPO checkpoints hold only
    tensors and plain Python containers, so ``weights_only=True`` loads them).
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint does not take storage_options: remove them "
                "or use another CheckpointIO plugin."
            )
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        local = str(path)[len("file://") :] if str(path).startswith("file://") else path
        atomic_torch_save(checkpoint, local)


def collect_rng_states() -> dict[str, Any]:
    """The global RNG states (Python ``random``, NumPy, torch CPU and CUDA) as plain objects
    (tensors, lists, tuples, numbers, strings), so a checkpoint holding them still loads with
    ``torch.load(..., weights_only=True)``."""
    import random

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    with contextlib.suppress(ImportError):  # numpy is optional
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_states(state: dict[str, Any]) -> None:
    """Restore what :func:`collect_rng_states` returned (missing entries are left alone)."""
    import random

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
