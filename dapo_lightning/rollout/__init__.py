"""Rollout engines: the protocol, the embedded HF engine, the vLLM engine and a factory.

``vllm`` is imported lazily: importing this package (or ``dapo_lightning``) never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dapo_lightning.rollout.base import Completion, FinishReason, RolloutEngine, SamplingConfig
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.rollout.parity import ParityMonitor, logprob_parity
from dapo_lightning.rollout.session import EngineSession, full_named_tensors

if TYPE_CHECKING:
    from dapo_lightning.rollout.vllm import VLLMRolloutEngine

__all__ = [
    "Completion",
    "EngineSession",
    "FinishReason",
    "HFRolloutEngine",
    "ParityMonitor",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMRolloutEngine",
    "create_engine",
    "full_named_tensors",
    "logprob_parity",
    "ENGINE_KINDS",
]

#: Engine kinds :func:`create_engine` builds.
ENGINE_KINDS = ("hf", "vllm")


def __getattr__(name: str) -> Any:
    if name == "VLLMRolloutEngine":
        from dapo_lightning.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_engine(
    kind: str,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_path: str | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> RolloutEngine:
    """Build a rollout engine by name.

    Args:
        kind: ``"hf"`` (samples with ``model`` itself; needs ``model``) or ``"vllm"`` (an
            in-process ``vllm.LLM`` on ``model_path``).
        model: The policy module (``"hf"``).
        tokenizer: Gives the HF engine its EOS / pad ids (``"hf"``).
        model_path: Checkpoint folder or hub id vLLM loads (``"vllm"``).
        seed: Base sampling seed; engines add the data-parallel rank themselves where relevant
            (``"vllm"``); for ``"hf"`` pass ``seed + rank``.
        **kwargs: Passed to the engine's constructor.
    """
    if kind == "hf":
        if model is None:
            raise ValueError("create_engine('hf') needs model=<the policy module>.")
        return HFRolloutEngine(model, tokenizer, seed=seed, **kwargs)
    if kind == "vllm":
        if model_path is None:
            raise ValueError("create_engine('vllm') needs model_path=<checkpoint folder>.")
        from dapo_lightning.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(str(model_path), seed=seed, **kwargs)
    raise ValueError(f"Unknown rollout engine kind {kind!r}: choose one of {list(ENGINE_KINDS)}.")
