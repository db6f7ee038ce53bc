"""dapo-lightning: DAPO reinforcement learning for LLMs as a PyTorch Lightning library.

Public API::

    from dapo_lightning import DAPOModule, DAPODataModule
    from dapo_lightning import compute_policy_loss, compute_advantages
    from dapo_lightning.callbacks import OverlongRewardShaping, EntropyScheduler, CollapseDetector
"""

from dapo_lightning.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from dapo_lightning.data import (
    DAPODataModule,
    DynamicSamplingConfig,
    RolloutBatch,
    RolloutProducer,
    ScoredRollouts,
    validation_metrics,
)
from dapo_lightning.lora import LoraSettings
from dapo_lightning.loss import LOSS_AGG_MODES, aggregate_loss, compute_policy_loss
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.module import DAPOModule
from dapo_lightning.rollout import (
    Completion,
    EngineSession,
    HFRolloutEngine,
    RolloutEngine,
    SamplingConfig,
    create_engine,
)
from dapo_lightning.schedules import WarmupConstantLR, WarmupCosineLR
from dapo_lightning.strategy import StrategyAdapter

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "Completion",
    "DAPODataModule",
    "DAPOModule",
    "DynamicSamplingConfig",
    "EngineSession",
    "HFRolloutEngine",
    "LoraSettings",
    "MetricAccumulator",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutProducer",
    "SamplingConfig",
    "ScoredRollouts",
    "StrategyAdapter",
    "WarmupConstantLR",
    "WarmupCosineLR",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "create_engine",
    "validation_metrics",
]


def __getattr__(name: str):
    # vLLM is imported only when its engine is asked for.
    if name == "VLLMRolloutEngine":
        from dapo_lightning.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine
    raise AttributeError(f"module 'dapo_lightning' has no attribute {name!r}")
