"""Merged weights of a LoRA policy, computed on the side (``W + scaling * B @ A``; the
training weights are never touched), its adapters alone in peft's file format, and a merged
plain ``transformers`` model for export."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from dapo_lightning.weights import full_plain_tensor, is_4bit, strip_wrapper_prefixes


def _checkpoint_name(name: str) -> str:
    """Base checkpoint name of a peft model's state-dict / module name."""
    name = strip_wrapper_prefixes(name)
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _merged_weight(layer: nn.Module, name: str, base: Tensor) -> Tensor:
    """``W + sum_adapters scaling * B @ A`` of one LoRA linear layer (``base`` = full ``W``)."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return base  # merged: W already holds the delta; disabled: the forward is the base's
    out = base
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if layer.use_dora.get(adapter, False):
            raise ValueError(
                f"{name}: DoRA adapters are not merged here (the weight norm rescales W): "
                "train with plain LoRA (LoraSettings) or merge with peft's merge_and_unload."
            )
        if not isinstance(layer.lora_A[adapter], nn.Linear):
            raise ValueError(
                f"{name}: only LoRA on linear layers is merged here, got "
                f"{type(layer.lora_A[adapter]).__name__}: target linear layers only."
            )
        a = full_plain_tensor(layer.lora_A[adapter].weight)
        b = full_plain_tensor(layer.lora_B[adapter].weight)
        wide = torch.promote_types(torch.float32, torch.promote_types(a.dtype, base.dtype))
        delta = (b.to(wide) @ a.to(wide)) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        out = (out.to(wide) + delta).to(base.dtype)
    return out


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(base checkpoint name, tensor)`` of the merged model: what ``merge_and_unload``
    would hold, without touching ``model``.

    Every entry of the base model's ``state_dict()`` comes once, under its base name (peft's
    ``base_model.model.`` and ``.base_layer.`` dropped; adapter tensors left out), tied weights
    included under each name (``lm_head.weight``: the format engines load). A LoRA layer's
    weight is computed as ``W + (alpha / r) * B @ A`` (float32 or wider, cast back to ``W``'s
    dtype); other tensors are yielded as they are. Sharded parameters (FSDP2, ZeRO-3) are
    gathered one at a time (a collective: every rank must iterate) and 4-bit bases dequantized.

    Args:
        model: A peft model (possibly sharded), e.g. ``DAPOModule.policy`` with ``lora``.

    Raises:
        ValueError: a LoRA layer uses DoRA or adapts a non-linear layer.

    Example::

        engine.load_weights(merged_named_tensors(module.policy))
    """
    from peft.tuners.lora import LoraLayer

    layers = {_checkpoint_name(n): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    state = model.state_dict(keep_vars=True)
    quantized = {_checkpoint_name(k) for k, v in state.items() if is_4bit(v)}
    for key, value in state.items():
        name = _checkpoint_name(key)
        if ".lora_" in name:
            continue  # the adapters themselves (lora_A / lora_B / lora_dropout ...)
        owner, _, leaf = name.rpartition(".")
        if quantized and ".weight." in name and name.split(".weight.")[0] + ".weight" in quantized:
            continue  # bitsandbytes' quant-state entries of a 4-bit weight
        if owner.endswith(".base_layer"):
            layer_name = owner[: -len(".base_layer")]
            name = f"{layer_name}.{leaf}"
            if leaf == "weight" and layer_name in layers:
                yield name, _merged_weight(layers[layer_name], name, full_plain_tensor(value))
                continue
        yield name, full_plain_tensor(value)


def adapter_named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield the adapter weights of ``model`` under peft's file names (what
    ``adapter_model.safetensors`` holds: ``base_model.model.<layer>.lora_A.weight``), gathered
    when sharded (a collective: every rank must iterate).

    Raises:
        ValueError: the adapters cannot be served on their own by an engine that holds the
            original base (trained biases, a 4-bit base, DoRA): push merged weights instead.

    Example::

        save_file(dict(adapter_named_tensors(peft_model)), "adapter/adapter_model.safetensors")
    """
    from peft import get_peft_model_state_dict

    config = model.peft_config[model.active_adapter]
    problems = []
    if getattr(config, "bias", "none") != "none":
        problems.append(f"bias={config.bias!r} trains base biases")
    if getattr(config, "use_dora", False):
        problems.append("DoRA rescales the base weights")
    if any(is_4bit(p) for p in model.parameters()):
        problems.append("the trainer's base is 4-bit, the engine's is not")
    if problems:
        raise ValueError(
            "adapter-only engine sync cannot reproduce this policy ("
            + "; ".join(problems)
            + "): build the vLLM engine without enable_lora (merged weights are pushed then)."
        )
    state = model.state_dict(keep_vars=True)  # keeps ZeRO-3's partition handles (ds_id)
    for name, value in get_peft_model_state_dict(model, state_dict=state).items():
        yield name, full_plain_tensor(value)


def merged_model(model: nn.Module) -> nn.Module:
    """A plain ``transformers`` model (no peft) holding :func:`merged_named_tensors` of
    ``model``: for export. ``model`` is left as it is; memory: one more copy of the weights.

    Example::

        merged_model(module.policy).save_pretrained("out/merged")
    """
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    config = copy.deepcopy(base.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the merged weights are dequantized
    tensors = dict(merged_named_tensors(model))
    dtype = tensors[next(iter(tensors))].dtype
    with torch.device("cpu"):
        out = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = out.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"merged weights do not fit {type(out).__name__} (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}): the peft model's base is not a standard transformers model."
        )
    if getattr(base, "generation_config", None) is not None:
        out.generation_config = copy.deepcopy(base.generation_config)
    return out.eval()
