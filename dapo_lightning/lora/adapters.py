"""Adapters on the policy: the (4-bit) base, wrapping it with peft, and the KL reference that
is the policy with its adapters switched off."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dapo_lightning.lora.settings import LoraSettings, import_peft
from dapo_lightning.weights import eval_mode, frozen_copy, is_4bit, load_policy


def check_quantize_supported(settings: LoraSettings) -> None:
    """Refuse ``quantize_4bit`` where it cannot run (no CUDA, or no bitsandbytes).

    Raises:
        RuntimeError: ``quantize_4bit`` without a CUDA device.
        ImportError: ``quantize_4bit`` without bitsandbytes installed.
    """
    if not settings.quantize_4bit:
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            "lora.quantize_4bit needs CUDA (bitsandbytes 4-bit kernels): this machine has no "
            "CUDA device. Set model.lora.quantize_4bit: false to train LoRA adapters on the "
            "full-precision base (torch_dtype), or run on a GPU."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "lora.quantize_4bit needs bitsandbytes: `pip install bitsandbytes` (CUDA build), "
            "or set model.lora.quantize_4bit: false."
        ) from err


def load_quantized_policy(model_name_or_path: str, torch_dtype: str) -> nn.Module:
    """The QLoRA base: ``from_pretrained`` in 4-bit NF4 on the current CUDA device, prepared for
    adapter training (peft ``prepare_model_for_kbit_training``: norms in float32, input grads).

    Args:
        model_name_or_path: The base checkpoint.
        torch_dtype: Compute dtype of the 4-bit layers and dtype of the other weights
            (``"bfloat16"``, ``"float16"`` or ``"float32"``: the module's ``torch_dtype``).

    Raises:
        RuntimeError / ImportError: see :func:`check_quantize_supported`.
    """
    check_quantize_supported(LoraSettings(quantize_4bit=True))
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, torch_dtype)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_name_or_path,
        dtype=dtype,
        quantization_config=quantization,
        device_map={"": torch.cuda.current_device()},
        trust_remote_code=False,
    )
    prepare = import_peft().prepare_model_for_kbit_training
    return prepare(model, use_gradient_checkpointing=False)


def is_peft_model(module: nn.Module | None) -> bool:
    """True when ``module`` is a peft model (``PeftModel``) with LoRA layers."""
    if module is None:
        return False
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def apply_lora(policy: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap ``policy`` with LoRA adapters (peft ``get_peft_model``); only adapters train.

    Args:
        policy: A ``transformers`` causal LM, not yet sharded (apply before FSDP2) and, with
            ``settings.quantize_4bit``, loaded by :func:`load_quantized_policy`.
        settings: The adapters.

    Returns:
        The ``PeftModelForCausalLM`` (its base is ``policy``, modified in place).

    Raises:
        ValueError: ``policy`` already has adapters, no module matches
            ``settings.target_modules``, or ``quantize_4bit`` with a full-precision policy.

    Example::

        policy = apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=8))
    """
    peft = import_peft()
    if is_peft_model(policy):
        raise ValueError("apply_lora: the policy already has peft adapters (apply them once).")
    quantized = any(is_4bit(p) for p in policy.parameters())
    if settings.quantize_4bit and not quantized:
        raise ValueError(
            "lora.quantize_4bit is set but the policy is not 4-bit: load it with "
            "dapo_lightning.lora.load_quantized_policy (DAPOModule does when it loads "
            "model_name_or_path itself)."
        )
    leaf_names = {name.rpartition(".")[2] for name, _ in policy.named_modules()}
    if not set(settings.target_modules) & leaf_names:
        raise ValueError(
            f"lora.target_modules={list(settings.target_modules)} matches no module of "
            f"{type(policy).__name__}: name some of its linear layers (e.g. "
            f"{sorted(n for n, m in policy.named_modules() if isinstance(m, nn.Linear))[:4]})."
        )
    model = peft.get_peft_model(policy, settings.peft_config())
    return model


class _AdaptersOff(nn.Module):
    """The base model of a peft model, run through the peft model with its adapters switched
    off and in eval mode: the initial policy, without a copy of the weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "peft_model", model)  # not a submodule: nothing is duplicated

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter(), eval_mode(self.peft_model):
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return self.peft_model.get_output_embeddings()


def reference_without_adapters(model: nn.Module) -> nn.Module:
    """The KL reference of a LoRA policy: ``model`` with its adapters off (the base, which is
    the initial policy since ``B = 0``), as a module whose forward takes the policy's
    arguments. It shares ``model``'s weights: no copy.

    Example::

        ref_logits = reference_without_adapters(peft_model)(input_ids=ids).logits
    """
    return _AdaptersOff(model)


def load_base_policy(
    model_name_or_path: str, torch_dtype: str, settings: LoraSettings | None
) -> nn.Module:
    """The policy's base: 4-bit (QLoRA, CUDA) when ``settings.quantize_4bit``, else as is."""
    if settings is not None and settings.quantize_4bit:
        return load_quantized_policy(model_name_or_path, torch_dtype)
    return load_policy(model_name_or_path, torch_dtype)


def with_adapters(policy: nn.Module, settings: LoraSettings, strategy_kind: str) -> nn.Module:
    """``policy`` wrapped with LoRA adapters (:func:`apply_lora`).

    Raises:
        ValueError: a 4-bit base under a sharding strategy (FSDP, DeepSpeed).
    """
    if settings.quantize_4bit and strategy_kind not in ("single", "ddp"):
        raise ValueError(
            f"lora.quantize_4bit with the {strategy_kind} strategy: 4-bit bases are not sharded "
            "here. Use one GPU or DDP, or set lora.quantize_4bit: false."
        )
    return apply_lora(policy, settings)


def reference_policy(policy: nn.Module) -> nn.Module:
    """The frozen initial policy of the KL penalty: with adapters, the policy itself with them
    switched off (no copy of the base); else a frozen copy."""
    if is_peft_model(policy):
        return reference_without_adapters(policy)
    return frozen_copy(policy)
