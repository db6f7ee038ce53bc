"""Checks of a checkpoint before it is resumed from: does the file load and verify
(:func:`inspect_checkpoint`: its update, its checksum manifest, finite weights and optimizer
state), does ``--ckpt_path`` name one (:func:`check_ckpt_path`), does it fit the model
(:func:`check_checkpoint_fits`) and the run's rank count (:func:`check_rank_count`). Each
refusal is one :class:`~dapo_lightning.checks.ConfigError` line naming the file and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dapo_lightning.checkpoint.manifest import first_nonfinite, manifest_error
from dapo_lightning.checks import ConfigError
from dapo_lightning.lightning_internals import attached_trainer
from dapo_lightning.weights import shape_mismatches


def load_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's top-level dict, tensors memory-mapped (reads little more than the
    file's index); a sharded folder's ``meta.pt`` (FSDP), else ``{}`` for a folder."""
    path = Path(path)
    if path.is_dir():
        meta = path / "meta.pt"
        return torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _load_failure(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def read_update(path: str | os.PathLike[str]) -> tuple[int | None, str | None]:
    """``(update, None)`` for a checkpoint whose structure loads, ``(None, why)`` for one that
    does not; no tensor is read (see :func:`inspect_checkpoint` for what is checked).

    The update is the checkpoint's own ``global_step`` (None where it cannot be read: a sharded
    folder without ``meta.pt``, a file holding objects ``weights_only`` refuses)."""
    path = Path(path)
    if path.is_dir() and not any(path.iterdir()):
        return None, "empty checkpoint folder"
    try:
        header = load_header(path)
    except Exception as error:  # noqa: BLE001 - every failure to load is a reason to skip it
        if "Weights only load failed" in str(error) or path.is_dir():
            return None, None  # complete, or a sharded folder whose metadata is not ours to judge
        return None, _load_failure(error)
    step = header.get("global_step") if isinstance(header, dict) else None
    return (int(step) if isinstance(step, int) else None), None


def verify_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """Why the tensors of the checkpoint file ``path`` cannot be trusted (they differ from its
    checksum manifest, or a weight or optimizer moment holds NaN / inf), or None. Reads the
    whole file (memory-mapped); folders and files ``weights_only`` refuses are not checked."""
    path = Path(path)
    if path.is_dir():
        return None
    try:
        checkpoint = load_header(path)
        if not isinstance(checkpoint, dict):
            return None
        damaged = manifest_error(checkpoint)
        if damaged is not None:
            return damaged
        nonfinite = first_nonfinite(checkpoint)
    except Exception as error:  # noqa: BLE001 - a tensor that cannot be read: damaged
        if "Weights only load failed" in str(error):
            return None
        return _load_failure(error)
    return None if nonfinite is None else f"{nonfinite} holds NaN / inf values"


def inspect_checkpoint(path: str | os.PathLike[str]) -> tuple[int | None, str | None]:
    """``(update, None)`` for a checkpoint that loads and verifies, ``(None, why)`` for one
    that does not: :func:`read_update`, then :func:`verify_checkpoint`.

    A file is opened the way a resume opens it (``torch.load`` of the whole structure, tensors
    memory-mapped): a truncated or empty file fails here, and so does one whose tensors differ
    from its checksum manifest or hold NaN / inf. A checkpoint holding objects that
    ``weights_only`` refuses counts as loadable (its structure is complete). A folder (sharded
    FSDP / DeepSpeed checkpoint) must not be empty.
    """
    step, error = read_update(path)
    if error is None:
        error = verify_checkpoint(path)
    return (None, error) if error is not None else (step, None)


def checkpoint_error(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it loads and
    verifies (see :func:`inspect_checkpoint`)."""
    return inspect_checkpoint(path)[1]


#: Files that mark a folder as a sharded checkpoint: Lightning's FSDP (``meta.pt``), torch
#: distributed checkpoint (``.metadata``), DeepSpeed (``latest``, ``checkpoint/``).
_SHARDED_MARKERS = ("meta.pt", ".metadata", "latest", "checkpoint")


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a folder holding a sharded checkpoint (one of :data:`_SHARDED_MARKERS`)."""
    folder = Path(path)
    return folder.is_dir() and any((folder / name).exists() for name in _SHARDED_MARKERS)


def check_checkpoint_fits(module: Any, checkpoint: dict[str, Any]) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` when ``checkpoint`` (before it loads
    into ``module``, a DAPOModule) has a parameter of another shape: one line naming the file,
    the parameter, both shapes and the fix (not ~30 lines of ``size mismatch``)."""
    path, model = (
        getattr(attached_trainer(module), "ckpt_path", None),
        module.hparams.model_name_or_path,
    )
    found = shape_mismatches(checkpoint.get("state_dict", {}), module.state_dict())
    if not found:
        return
    name, old, new = found[0]
    more = f" (and {len(found) - 1} more parameters)" if len(found) > 1 else ""
    raise ConfigError(
        f"ckpt_path: {path} does not fit the model: {name} has shape {list(old)} in the "
        f"checkpoint but {list(new)} in model.model_name_or_path={model}{more}. Fix: resume "
        "with the model the checkpoint was trained from, or start a fresh run (another "
        "trainer.default_root_dir, without --ckpt_path)."
    )


def check_rank_count(path: str | os.PathLike[str], world_size: int, data_key: str) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` when the checkpoint at ``path``
    holds the data state (its ``data_key`` entry: ``{"ranks": [one per rank]}``) of another
    number of ranks than ``world_size``; checkpoints without one pass. Made before any rank
    starts, so the run ends with one line instead of a traceback on every rank. A sharded
    folder is read through its ``meta.pt`` (where Lightning keeps the non-tensor state)."""
    try:
        state = load_header(path).get(data_key)
    except Exception:  # noqa: BLE001 - unreadable here: Lightning's load reports it
        return
    ranks = state.get("ranks") if isinstance(state, dict) else None
    if not isinstance(ranks, list) or not ranks or len(ranks) == world_size:
        return
    saved = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    raise ConfigError(
        f"ckpt_path: {path} was saved by {saved} and this run has {world_size} (trainer.devices "
        f"x trainer.num_nodes): each rank resumes its own prompt shard and data state. Fix: "
        f"resume with trainer.devices x trainer.num_nodes = {len(ranks)}, or start a fresh run "
        "(another trainer.default_root_dir, without --ckpt_path)."
    )


#: ``ckpt_path`` values Lightning resolves itself (and ``auto``, resolved by the CLI).
_NAMED_CKPT_PATHS = ("auto", "last", "best", "hpc")


def check_ckpt_path(path: str | os.PathLike[str] | None) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` unless ``--ckpt_path`` names a
    checkpoint that loads and verifies (a file, or a sharded checkpoint folder); None,
    Lightning's named values (``last``, ``best``, ``hpc``, ``registry...``), ``auto`` and URLs
    pass."""
    text = None if path is None else os.fspath(path)
    if text is None or text in _NAMED_CKPT_PATHS or "://" in text or text.startswith("registry"):
        return
    fix = (
        "Fix: give a checkpoint file (e.g. RUN/checkpoints/last.ckpt), or --ckpt_path auto to "
        "resume from the run's loadable checkpoint with the highest update."
    )
    given = Path(text)
    if not given.exists():
        raise ConfigError(f"ckpt_path: {text} does not exist. {fix}")
    if given.is_dir() and not is_sharded_checkpoint(given):
        inside = sorted(p.name for p in given.glob("*.ckpt"))
        holds = f" (it holds {', '.join(inside[:4])})" if inside else ""
        raise ConfigError(f"ckpt_path: {text} is a folder, not a checkpoint{holds}. {fix}")
    error = checkpoint_error(given)
    if error is not None:
        raise ConfigError(
            f"ckpt_path: {text} cannot be loaded ({error}). Fix: give a complete checkpoint "
            "(last-previous.ckpt beside last.ckpt is the one before it), or --ckpt_path auto, "
            "which skips checkpoints that do not load or verify."
        )
