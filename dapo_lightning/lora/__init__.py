"""LoRA (and QLoRA) adapters on the policy with ``peft``: only the adapters train.

:class:`LoraSettings` (``model.init_args.lora`` in a config) is the one place the adapter
settings are declared. With it, :class:`~dapo_lightning.module.DAPOModule`

* wraps the loaded policy with :func:`apply_lora` (peft ``get_peft_model``; every base weight
  frozen), before any sharding, so the optimizer gets the adapter parameters only;
* checkpoints the adapter weights and the optimizer state only (:func:`adapter_state_keys`,
  :func:`check_adapter_checkpoint`): the base comes back from ``model_name_or_path``;
* and the engine session pushes :func:`merged_named_tensors` to an engine that holds its own
  weights: the base checkpoint names with ``W + scaling * B @ A`` computed on the side, so
  training is never disturbed (peft's ``merge_adapter`` / ``unmerge_adapter`` would add and
  subtract the delta in place, and ``(W + d) - d`` is not ``W`` in floating point).

QLoRA (``quantize_4bit: true``) loads the base in 4-bit NF4 with bitsandbytes, on CUDA only
(:func:`load_quantized_policy`); on a machine without CUDA it is refused with a clear error.

One file per job: :mod:`.settings` (:class:`LoraSettings`), :mod:`.adapters` (the base, the
adapters on it, the KL reference), :mod:`.merge` (merged and adapter-only weights for engines
and export) and :mod:`.checkpoint` (adapter-only checkpoints). Every name is importable from
here.

Example::

    module = DAPOModule("Qwen/Qwen2.5-0.5B", lora=LoraSettings(r=16, alpha=32))

    # config.yaml
    model:
      init_args:
        lora: {r: 8, alpha: 16, dropout: 0.0}
"""

from __future__ import annotations

from dapo_lightning.lora.adapters import (
    apply_lora,
    check_quantize_supported,
    is_peft_model,
    load_base_policy,
    load_quantized_policy,
    reference_policy,
    reference_without_adapters,
    with_adapters,
)
from dapo_lightning.lora.checkpoint import (
    LORA_CHECKPOINT_KEY,
    adapter_state_keys,
    check_adapter_checkpoint,
    keep_adapters_only,
    restore_adapter_checkpoint,
)
from dapo_lightning.lora.merge import adapter_named_tensors, merged_model, merged_named_tensors
from dapo_lightning.lora.settings import DEFAULT_TARGET_MODULES, LoraSettings, as_lora_settings

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LORA_CHECKPOINT_KEY",
    "LoraSettings",
    "adapter_named_tensors",
    "adapter_state_keys",
    "apply_lora",
    "as_lora_settings",
    "check_adapter_checkpoint",
    "check_quantize_supported",
    "is_peft_model",
    "keep_adapters_only",
    "load_base_policy",
    "load_quantized_policy",
    "merged_model",
    "merged_named_tensors",
    "reference_policy",
    "reference_without_adapters",
    "restore_adapter_checkpoint",
    "with_adapters",
]
