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

Example::

    module = DAPOModule("Qwen/Qwen2.5-0.5B", lora=LoraSettings(r=16, alpha=32))

    # config.yaml
    model:
      init_args:
        lora: {r: 8, alpha: 16, dropout: 0.0}
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dapo_lightning.weights import (
    eval_mode,
    frozen_copy,
    full_plain_tensor,
    is_4bit,
    load_policy,
    strip_wrapper_prefixes,
)

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
    "load_quantized_policy",
    "merged_model",
    "merged_named_tensors",
    "reference_without_adapters",
]

#: The attention and MLP projections of Qwen2 / Llama / Mistral / SmolLM2 decoder layers.
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

#: Where a LoRA run's checkpoint says it holds the adapter weights only (``checkpoint["dapo"]``).
LORA_CHECKPOINT_KEY = "lora"

_PEFT_HINT = "LoRA needs peft: install it with `pip install 'dapo-lightning[lora]'`."


@dataclass
class LoraSettings:
    """LoRA adapters on the policy's linear layers (peft ``LoraConfig``).

    Each targeted ``nn.Linear`` computes ``y = x W^T + (alpha / r) * dropout(x) A^T B^T``
    with ``A`` (``r x in``, random) and ``B`` (``out x r``, zero: the initial policy is the
    base model); only ``A`` and ``B`` (and biases, with ``bias``) train.

    Args:
        r: Rank of the adapters.
        alpha: Scale numerator: the adapter output is multiplied by ``alpha / r``.
        dropout: Dropout on the adapter input while training. 0 (default) keeps the update
            deterministic and the first epoch's ratio exactly 1; > 0 makes the module compute
            old log-probs in eval mode (an extra forward).
        target_modules: Names (last component) of the linear layers that get adapters; default
            the attention and MLP projections of Qwen2 / Llama
            (:data:`DEFAULT_TARGET_MODULES`).
        bias: Which biases train too: ``"none"``, ``"all"`` or ``"lora_only"`` (of targeted
            layers). Merged weights include them either way.
        quantize_4bit: QLoRA: load the frozen base in 4-bit NF4 (bitsandbytes, double
            quantisation, compute in the module's ``torch_dtype``). CUDA only.

    Raises:
        ValueError: a value out of range (the message names the field).

    Example::

        LoraSettings(r=16, alpha=32, target_modules=("q_proj", "v_proj"))
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    bias: Literal["none", "all", "lora_only"] = "none"
    quantize_4bit: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = (self.target_modules,)
        self.target_modules = tuple(self.target_modules)
        if int(self.r) != self.r or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer (the adapter rank), got {self.r}.")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0 (scale alpha / r), got {self.alpha}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}.")
        if not self.target_modules:
            raise ValueError(
                "lora.target_modules is empty: name the linear layers that get adapters, e.g. "
                f"{list(DEFAULT_TARGET_MODULES)}."
            )
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"lora.bias must be 'none', 'all' or 'lora_only', got {self.bias!r}.")

    @property
    def scaling(self) -> float:
        """``alpha / r``, the factor of the adapter output."""
        return self.alpha / self.r

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig`` (task ``CAUSAL_LM``)."""
        LoraConfig = _import_peft().LoraConfig
        return LoraConfig(
            r=int(self.r),
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias=self.bias,
            task_type="CAUSAL_LM",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what checkpoints store: ``weights_only`` loads read them)."""
        out = dataclasses.asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out


# The module's hyper-parameters (saved in checkpoints) may hold it: allow it in weights_only loads.
torch.serialization.add_safe_globals([LoraSettings])


def as_lora_settings(value: LoraSettings | dict[str, Any] | None) -> LoraSettings | None:
    """``value`` as :class:`LoraSettings` (LightningCLI may hand a dict for a dataclass argument).

    Raises:
        TypeError: ``value`` is neither, or the dict has a key that is not a field.
    """
    if value is None or isinstance(value, LoraSettings):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(LoraSettings)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise TypeError(
                f"model.lora has unknown keys {unknown}: the fields are {sorted(fields)}."
            )
        return LoraSettings(**value)
    raise TypeError(
        "model.lora must be LoraSettings, a dict of its fields or None, got "
        f"{type(value).__name__}."
    )


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ImportError(_PEFT_HINT) from err
    return peft


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
    prepare = _import_peft().prepare_model_for_kbit_training
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
    peft = _import_peft()
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


# ---------------------------------------------------------------------- merged weights
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


def keep_adapters_only(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Drop the frozen base from ``checkpoint["state_dict"]`` (it comes back from
    ``model_name_or_path``) and mark the checkpoint adapter-only."""
    keep = adapter_state_keys(module)
    state = checkpoint.get("state_dict", {})
    checkpoint["state_dict"] = {k: v for k, v in state.items() if k in keep}
    settings = module.lora.to_dict() if module.lora is not None else None
    checkpoint["dapo"][LORA_CHECKPOINT_KEY] = {"adapter_only": True, "settings": settings}


def restore_adapter_checkpoint(
    module: nn.Module, checkpoint: dict[str, Any], lora_state: dict[str, Any] | None
) -> None:
    """Check an adapter-only checkpoint against ``module`` (a DAPOModule) and fill in the
    frozen base (the module's own, loaded from ``model_name_or_path``), so the load is strict.

    Raises:
        ValueError: the checkpoint and the module disagree on LoRA, or the adapters do not
            fit (names the setting to fix).
    """
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
