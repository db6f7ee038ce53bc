"""dapo-lightning: DAPO reinforcement learning for LLMs as a PyTorch Lightning library.

Public API::

    from dapo_lightning import DAPOModule, DAPODataModule
    from dapo_lightning import compute_policy_loss, compute_advantages
    from dapo_lightning import PolicyLossConfig, BatchingConfig, OptimizerStepConfig
    from dapo_lightning import PolicyHandle, RolloutSpec, RolloutChannel, UpdateLoop
    from dapo_lightning import register_policy_objective, register_advantage_estimator
    from dapo_lightning import register_reward, register_task, register_environment, register_engine
    from dapo_lightning import Sandbox, SandboxConfig, SandboxResult  # model-written code, isolated
    from dapo_lightning.callbacks import OverlongRewardShaping, EntropyScheduler, CollapseDetector
"""

# isort: split
# First, before torch loads its OpenMP runtime: it sets OMP_WAIT_POLICY=PASSIVE (idle OpenMP
# threads sleep instead of spinning; dapo_lightning/threads.py says when it cannot).
import dapo_lightning.threads  # noqa: F401

# isort: split
from dapo_lightning.advantages import (
    ADVANTAGE_ESTIMATORS,
    GroupStats,
    compute_advantages,
    register_advantage_estimator,
)
from dapo_lightning.contract import PolicyHandle, RolloutChannel, RolloutSpec
from dapo_lightning.data import (
    DAPODataModule,
    DynamicSamplingConfig,
    OneStepOffConfig,
    PromptConfig,
    PromptSelectionConfig,
    RolloutBatch,
    RolloutProducer,
    ScoredRollouts,
    ScoringConfig,
    ValidationConfig,
    validation_metrics,
)
from dapo_lightning.envs import register_environment
from dapo_lightning.lora import LoraSettings
from dapo_lightning.loss import LOSS_AGG_MODES, LossInputs, PolicyLossConfig, aggregate_loss
from dapo_lightning.metrics import MetricAccumulator
from dapo_lightning.module import DAPOModule
from dapo_lightning.objectives import POLICY_OBJECTIVES, register_policy_objective
from dapo_lightning.policy_loss import compute_policy_loss, policy_loss
from dapo_lightning.rewards import register_reward
from dapo_lightning.rollout import (
    Completion,
    EngineCapabilities,
    EngineSession,
    HFRolloutEngine,
    RolloutEngine,
    SamplingConfig,
    VLLMRolloutEngine,
    create_engine,
    register_engine,
)
from dapo_lightning.rollout_correction import RolloutCorrection
from dapo_lightning.sandbox import Sandbox, SandboxConfig, SandboxResult
from dapo_lightning.schedules import WarmupConstantLR, WarmupCosineLR
from dapo_lightning.slurm import replace_srun_hint
from dapo_lightning.strategy import StrategyAdapter
from dapo_lightning.tasks import register_task
from dapo_lightning.update import BatchingConfig, OptimizerStepConfig
from dapo_lightning.update_loop import StepContext, UpdateLoop

# Lightning's "srun is available but not used" hint on every local run where SLURM is installed
replace_srun_hint()

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_OBJECTIVES",
    "BatchingConfig",
    "Completion",
    "DAPODataModule",
    "DAPOModule",
    "DynamicSamplingConfig",
    "OneStepOffConfig",
    "EngineCapabilities",
    "EngineSession",
    "GroupStats",
    "HFRolloutEngine",
    "LoraSettings",
    "LossInputs",
    "MetricAccumulator",
    "OptimizerStepConfig",
    "PolicyHandle",
    "PolicyLossConfig",
    "PromptConfig",
    "PromptSelectionConfig",
    "RolloutBatch",
    "RolloutChannel",
    "RolloutCorrection",
    "RolloutEngine",
    "RolloutProducer",
    "RolloutSpec",
    "SamplingConfig",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "ScoredRollouts",
    "ScoringConfig",
    "StepContext",
    "StrategyAdapter",
    "UpdateLoop",
    "ValidationConfig",
    "VLLMRolloutEngine",
    "WarmupConstantLR",
    "WarmupCosineLR",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "create_engine",
    "policy_loss",
    "register_advantage_estimator",
    "register_engine",
    "register_environment",
    "register_policy_objective",
    "register_reward",
    "register_task",
    "validation_metrics",
]
