"""Adapter-only checkpoints: a LoRA run saves the adapters (and the optimizer state) only;
the frozen base comes back from ``model_name_or_path`` when it is loaded."""

from __future__ import annotations

from typing import Any

from torch import nn

from dapo_lightning.lora.adapters import is_peft_model

#: Where a LoRA run's checkpoint says it holds the adapter weights only (``checkpoint["dapo"]``).
LORA_CHECKPOINT_KEY = "lora"


def adapter_state_keys(module: nn.Module) -> set[str]:
    """Names in ``module.state_dict()`` of the parameters that train (the adapters; biases too
    with ``bias``): what a LoRA checkpoint keeps."""
    return {name for name, p in module.named_parameters() if p.requires_grad}


def check_adapter_checkpoint(
    state_dict: dict[str, Any], module: nn.Module, where: str = "the checkpoint"
) -> None:
    """Check that an adapter-only ``state_dict`` fits ``module`` (every trained parameter, no
    name it does not have): it is then loaded with ``strict=False`` over the base.

    Raises:
        ValueError: a trained parameter is missing or a name is unknown (names both).
    """
    wanted = adapter_state_keys(module)
    known = set(module.state_dict())
    missing = sorted(wanted - set(state_dict))
    unexpected = sorted(set(state_dict) - known)
    if missing or unexpected:
        raise ValueError(
            f"the LoRA adapter weights in {where} do not fit the module's adapters (missing "
            f"{missing[:4]}, unexpected {unexpected[:4]}): resume with the model.lora settings "
            "(r, target_modules, bias) the run was started with."
        )


def keep_adapters_only(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Drop the frozen base from ``checkpoint["state_dict"]`` (it comes back from
    ``model_name_or_path``) and mark the checkpoint adapter-only."""
    keep = adapter_state_keys(module)
    state = checkpoint.get("state_dict", {})
    checkpoint["state_dict"] = {k: v for k, v in state.items() if k in keep}
    settings = module.lora.to_dict() if module.lora is not None else None
    checkpoint["dapo"][LORA_CHECKPOINT_KEY] = {"adapter_only": True, "settings": settings}


def restore_adapter_checkpoint(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Check an adapter-only checkpoint (its ``dapo`` state's :data:`LORA_CHECKPOINT_KEY`)
    against ``module`` (a DAPOModule) and fill in the frozen base (the module's own, loaded
    from ``model_name_or_path``), so the load is strict.

    Raises:
        ValueError: the checkpoint and the module disagree on LoRA, or the adapters do not
            fit (names the setting to fix).
    """
    lora_state = checkpoint.get("dapo", {}).get(LORA_CHECKPOINT_KEY)
    peft = is_peft_model(module.policy)
    weights = checkpoint.get("state_dict")
    if lora_state is None:
        if peft and weights:
            raise ValueError(
                "the checkpoint holds a full policy (written without model.lora) but this "
                "module trains LoRA adapters: resume it without model.lora, or export it and "
                "start a LoRA run from the exported folder."
            )
        return
    if not peft:
        raise ValueError(
            "the checkpoint holds LoRA adapter weights only (written with model.lora="
            f"{lora_state.get('settings')}): set model.lora to those settings to load it."
        )
    if weights is None:  # distributed checkpoint: the strategy loads it (non-strict)
        return
    check_adapter_checkpoint(weights, module)
    own = module.state_dict()
    checkpoint["state_dict"] = {**{k: v for k, v in own.items() if k not in weights}, **weights}
