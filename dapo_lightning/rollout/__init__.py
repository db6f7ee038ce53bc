"""Rollout engines: the protocol, the embedded HF engine, the vLLM engine, the table by name.

``vllm`` itself is imported only when a vLLM engine is built: importing this package (or
``dapo_lightning``) never imports it.
"""

from __future__ import annotations

from dapo_lightning.rollout.base import (
    Completion,
    EngineCapabilities,
    EngineSetup,
    FinishReason,
    RolloutEngine,
    SamplingConfig,
)
from dapo_lightning.rollout.engines import (
    ENGINES,
    check_engine,
    create_engine,
    engine_capabilities,
    register_engine,
)
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.rollout.parity import logprob_parity
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.rollout.vllm import VLLMRolloutEngine
from dapo_lightning.weights import full_named_tensors

__all__ = [
    "ENGINES",
    "Completion",
    "EngineCapabilities",
    "EngineSession",
    "EngineSetup",
    "FinishReason",
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMRolloutEngine",
    "check_engine",
    "create_engine",
    "engine_capabilities",
    "full_named_tensors",
    "logprob_parity",
    "register_engine",
]
