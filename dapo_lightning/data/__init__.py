"""Data: prompt sources, batches, the rollout producer (dynamic sampling) and the DataModule."""

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.data.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.datamodule import DAPODataModule, RolloutTicket, ValidationTicket
from dapo_lightning.data.difficulty import (
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
    PromptStats,
    zero_variance_prob,
)
from dapo_lightning.data.dynamic_sampling import DynamicSamplingConfig
from dapo_lightning.data.end_game import DynamicSamplingError, TrainingComplete
from dapo_lightning.data.metrics import validation_metrics
from dapo_lightning.data.one_step_off import OneStepOffConfig
from dapo_lightning.data.producer import RolloutProducer
from dapo_lightning.data.rank_layout import RankLayout
from dapo_lightning.data.rollout_groups import concat_rollouts, group_has_variance
from dapo_lightning.data.sampler import PromptSampler, PromptsExhausted
from dapo_lightning.data.sources import (
    FieldMap,
    PromptDataError,
    PromptRecord,
    deduplicate,
    load_prompt_records,
    read_rows,
    records_from_rows,
    split_train_val,
    tokenize_records,
)
from dapo_lightning.data.step_stats import STAT_OPS, StepStats

__all__ = [
    "STAT_OPS",
    "DAPODataModule",
    "DifficultyTracker",
    "DynamicSamplingConfig",
    "DynamicSamplingError",
    "EndOfTraining",
    "FieldMap",
    "OneStepOffConfig",
    "PromptConfig",
    "PromptDataError",
    "PredictiveSelector",
    "PromptRecord",
    "PromptSampler",
    "PromptSelectionConfig",
    "PromptStats",
    "PromptsExhausted",
    "RankLayout",
    "RolloutBatch",
    "RolloutProducer",
    "RolloutTicket",
    "ScoredRollouts",
    "ScoringConfig",
    "StepStats",
    "TrainingComplete",
    "ValidationConfig",
    "ValidationTicket",
    "concat_rollouts",
    "deduplicate",
    "group_has_variance",
    "load_prompt_records",
    "read_rows",
    "records_from_rows",
    "split_train_val",
    "zero_variance_prob",
    "tokenize_records",
    "validation_metrics",
]
