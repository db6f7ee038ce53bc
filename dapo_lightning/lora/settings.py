"""The LoRA settings (``model.init_args.lora``): :class:`LoraSettings`, the one place the
adapter settings are declared, and peft's import with the hint to install it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

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
        LoraConfig = import_peft().LoraConfig
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
# The module's hyper-parameters (saved in checkpoints) may hold it: allow it in weights_only loads,
# also under the name checkpoints written before lora.py became a package use.
torch.serialization.add_safe_globals(
    [LoraSettings, (LoraSettings, "dapo_lightning.lora.LoraSettings")]
)


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


def import_peft() -> Any:
    """``peft``, or an ImportError that names the extra to install."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(_PEFT_HINT) from err
    return peft
