"""Rollout engines: the protocol, the embedded HF engine, the vLLM engine and a factory.

``vllm`` itself is imported only when a vLLM engine is built: importing this package (or
``dapo_lightning``) never imports it.
"""

from __future__ import annotations

from dapo_lightning.rollout.base import Completion, FinishReason, RolloutEngine, SamplingConfig
from dapo_lightning.rollout.engines import ENGINE_KINDS, check_engine, create_engine
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.rollout.parity import logprob_parity
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.rollout.vllm import VLLMRolloutEngine
from dapo_lightning.weights import full_named_tensors

__all__ = [
    "Completion",
    "EngineSession",
    "FinishReason",
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMRolloutEngine",
    "check_engine",
    "create_engine",
    "full_named_tensors",
    "logprob_parity",
    "ENGINE_KINDS",
]
