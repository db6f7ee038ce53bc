"""Weights of a policy, whatever wraps it: the bottom floor the update, LoRA and the engine
session stand on (it imports nothing from the library).

* Full tensors: :func:`full_named_tensors` yields checkpoint-named, gathered tensors from a
  plain, DDP, FSDP1, FSDP2 (DTensor) or DeepSpeed ZeRO-3 module (:func:`full_tensor` gathers
  one, :func:`strip_wrapper_prefixes` names it; :func:`is_sharded` tells whether gathering is
  a collective); :func:`full_plain_tensor` also dequantizes a bitsandbytes 4-bit weight.
* The policy: :func:`load_policy` (``from_pretrained`` with an error naming the field),
  :func:`enable_gradient_checkpointing`, :func:`frozen_copy` (the KL reference),
  :func:`eval_mode` and :func:`has_dropout` (when train-mode log-probs differ).
* Shapes: :func:`shape_mismatches` (a checkpoint's tensors against a module's).

``deepspeed``, ``bitsandbytes`` and ``transformers`` are imported where they are used (optional
or slow to import; see tests/test_structure.py).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "TORCH_DTYPES",
    "WRAPPER_PREFIXES",
    "enable_gradient_checkpointing",
    "eval_mode",
    "frozen_copy",
    "full_named_tensors",
    "full_plain_tensor",
    "full_tensor",
    "has_dropout",
    "is_4bit",
    "is_sharded",
    "load_policy",
    "shape_mismatches",
    "strip_wrapper_prefixes",
]

#: Name fragments that wrappers (FSDP1, activation checkpointing, torch.compile) insert.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

#: The dtypes a policy is loaded in, by the name the configs use (``model.torch_dtype``).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------ full tensors
def strip_wrapper_prefixes(name: str) -> str:
    """Checkpoint name of a parameter of a wrapped module.

    Removes :data:`WRAPPER_PREFIXES` anywhere in ``name`` and a leading ``module.``
    (DistributedDataParallel / DeepSpeed engine).
    """
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def is_sharded(module: nn.Module) -> bool:
    """True when any parameter of ``module`` is a DTensor shard (FSDP2) or ZeRO-3 partition."""
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in module.parameters())


def full_tensor(value: Tensor) -> Tensor:
    """``value`` whole and detached: a ZeRO-3 partition gathered (``GatheredParameters``, a
    copy), a DTensor shard gathered (``full_tensor()``); both are collectives. A plain tensor
    is returned detached, without a copy."""
    if hasattr(value, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
            return value.data.detach().clone()
    if isinstance(value, DTensor):
        return value.full_tensor().detach()
    return value.detach()


def is_4bit(value: Tensor) -> bool:
    """A bitsandbytes 4-bit packed weight (``Params4bit``: carries a ``quant_state``)."""
    return getattr(value, "quant_state", None) is not None


def full_plain_tensor(value: Tensor) -> Tensor:
    """:func:`full_tensor`, or for a bitsandbytes 4-bit weight its dequantized values."""
    if not is_4bit(value):
        return full_tensor(value)
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(value.data, value.quant_state)


def full_named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every entry of ``module.state_dict()``.

    One tensor at a time, so at most one gathered parameter is alive beyond the shards:

    * plain tensors (single process, DDP) are yielded detached (no copy);
    * FSDP2 / DTensor shards are gathered with ``DTensor.full_tensor()`` (a collective:
      every rank must iterate);
    * DeepSpeed ZeRO-3 partitioned parameters (those with ``ds_id``) are gathered with
      ``deepspeed.zero.GatheredParameters`` and copied out (a collective too);
    * FSDP1 (``FullyShardedDataParallel``) gathers in its own ``state_dict()`` (the default
      full state-dict type), which holds the whole unsharded state at once.

    Names are stripped of wrapper prefixes; tied weights appear under every name
    ``state_dict()`` gives them (``lm_head.weight`` included): the format vLLM loads.

    Example::

        engine.load_weights(full_named_tensors(module.policy))
    """
    for name, value in module.state_dict(keep_vars=True).items():
        yield strip_wrapper_prefixes(name), full_tensor(value)


# ------------------------------------------------------------------ the policy
def load_policy(model_name_or_path: str, torch_dtype: str) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with an error that names the field and the fix.

    Raises:
        FileNotFoundError: nothing loadable at ``model_name_or_path``.
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_name_or_path, dtype=TORCH_DTYPES[torch_dtype], trust_remote_code=False
        )
    except OSError as err:
        raise FileNotFoundError(
            f"model.model_name_or_path={model_name_or_path!r} could not be loaded ({err}). Give "
            "an existing folder written by save_pretrained or a hub id (with network access)."
        ) from err


def enable_gradient_checkpointing(policy: nn.Module) -> None:
    """Recompute activations in backward (non-reentrant), with the KV cache off."""
    if hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(policy, "config"):
            policy.config.use_cache = False


def frozen_copy(policy: nn.Module) -> nn.Module:
    """A frozen eval-mode copy of ``policy`` (the reference of the KL penalty)."""
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    return ref


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off inside (as the engine samples), the previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def has_dropout(model: nn.Module) -> bool:
    """True when a dropout layer with ``p > 0`` would make train-mode log-probs differ."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(getattr(model, "config", None), key, 0.0) or 0.0) > 0
        for key in ("attention_dropout", "hidden_dropout", "dropout")
    )


def shape_mismatches(
    saved: dict[str, Any], current: dict[str, Any]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, saved shape, current shape)`` of every tensor both state dicts hold with
    different shapes, in ``saved``'s order (names only one of them holds are not compared: a
    LoRA checkpoint holds the adapters only). A DeepSpeed ZeRO-3 parameter's full shape is its
    ``ds_shape``."""

    def shape(value: Any) -> tuple[int, ...] | None:
        full = getattr(value, "ds_shape", None) or getattr(value, "shape", None)
        return None if full is None else tuple(full)

    out = []
    for name, value in saved.items():
        if name in current:
            old, new = shape(value), shape(current[name])
            if old is not None and new is not None and old != new:
                out.append((name, old, new))
    return out
