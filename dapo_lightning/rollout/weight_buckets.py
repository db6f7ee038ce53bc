"""Weight pushes to vLLM in buckets: a stream of named tensors cut into calls of bounded size
that never split a fused layer group."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import Tensor


def _group_key(name: str) -> str:
    """Tensors that share a key must reach vLLM in the same ``reload_weights`` call.

    vLLM fuses checkpoint tensors (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and processes a
    layer when all its elements have arrived; a layer given only part of its tensors in one
    call would be processed half-loaded. Keying on the numbered block (``model.layers.3``),
    or the parent module for the rest, keeps every fused group together.
    """
    m = re.match(r"^(.*?\.\d+)\.", name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0]


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Split a stream of named tensors into lists of about ``bucket_bytes`` each.

    A bucket is closed once it holds at least ``bucket_bytes`` bytes, but only between
    groups (:func:`_group_key`), so a bucket may exceed the size by one group. Order is kept.
    """
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    key = None
    for name, tensor in named_tensors:
        k = _group_key(name)
        if bucket and k != key and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        key = k
    if bucket:
        yield bucket
