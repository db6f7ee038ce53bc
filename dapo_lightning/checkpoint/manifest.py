"""The checkpoint's checksum manifest: a CRC-32 of every tensor, written into the checkpoint by
each save (:func:`with_manifest`, under :data:`MANIFEST_KEY`) and checked before a checkpoint is
resumed from (:func:`manifest_error`).

``torch.load`` does not check the CRCs of its zip records: bytes overwritten inside a tensor
(a bad disk block, a faulty copy) load as other numbers, a NaN in an optimizer moment included,
and the resume trains on them. The manifest names each tensor by its place in the checkpoint
(``optimizer_states.0.state.3.exp_avg_sq``) with the CRC-32 of its bytes; a checkpoint whose
tensors differ from it, or whose weights or optimizer state hold NaN / inf
(:func:`first_nonfinite`), is not taken. A checkpoint without a manifest (written before it
existed) is checked for non-finite values only. The pickled structure around the tensors is
not in the manifest: damage there fails to unpickle, or changes a value the resume reports.

Cost: one pass over the tensors' bytes at ``zlib.crc32`` speed (about 3 GB/s on one core) when
saving, and one read of the file when checking (docs/design.md, "Stopping and resuming").
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch

from dapo_lightning.step_guard import all_finite

#: The checkpoint key of the manifest: ``{"algorithm": "crc32", "tensors": {name: crc}}``.
MANIFEST_KEY = "dapo_manifest"
#: The parts of a checkpoint whose floating-point tensors must be finite.
FINITE_PARTS = ("state_dict", "optimizer_states")


def named_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in the nested dicts, lists and tuples of ``value``, named by its path of
    keys joined with ``.`` (dicts in their order, sequences by index); the manifest is skipped."""
    if torch.is_tensor(value):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != MANIFEST_KEY:
                yield from named_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from named_tensors(item, f"{prefix}.{i}" if prefix else str(i))


def tensor_crc(tensor: torch.Tensor) -> int:
    """The CRC-32 of ``tensor``'s bytes (its elements in row-major order, any dtype)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    if data.numel() == 0:
        return 0
    return zlib.crc32(memoryview(data.view(torch.uint8).numpy()))


def with_manifest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (a shallow copy) with its manifest: the CRC-32 of every tensor."""
    tensors = {name: tensor_crc(t) for name, t in named_tensors(checkpoint)}
    return {**checkpoint, MANIFEST_KEY: {"algorithm": "crc32", "tensors": tensors}}


def manifest_error(checkpoint: dict[str, Any]) -> str | None:
    """Why the tensors of a loaded ``checkpoint`` differ from its manifest (the first tensor
    whose checksum differs, or one missing or added), or None: they match, or it has none."""
    manifest = checkpoint.get(MANIFEST_KEY)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), dict):
        return None
    expected: dict[str, int] = manifest["tensors"]
    found = dict(named_tensors(checkpoint))
    for name, crc in expected.items():
        if name not in found:
            return f"{name} is missing (it is in the checksum manifest)"
        if tensor_crc(found[name]) != crc:
            return f"{name} does not match its checksum: the file is damaged"
    extra = next((name for name in found if name not in expected), None)
    return None if extra is None else f"{extra} is not in the checksum manifest"


def first_nonfinite(checkpoint: dict[str, Any]) -> str | None:
    """The name of the first floating-point tensor of the weights or the optimizer state
    (:data:`FINITE_PARTS`) with a NaN / inf element, or None (one fused check per part:
    :func:`~dapo_lightning.step_guard.all_finite`)."""
    for part in FINITE_PARTS:
        floats = [
            (name, t)
            for name, t in named_tensors(checkpoint.get(part, {}), part)
            if t.is_floating_point()
        ]
        if not all_finite([t for _, t in floats]):
            return next(name for name, t in floats if not all_finite([t]))
    return None
