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
from dapo_lightning.data.metrics import validation_metrics
from dapo_lightning.data.producer import (
    STAT_OPS,
    DynamicSamplingConfig,
    DynamicSamplingError,
    RolloutProducer,
    TrainingComplete,
    concat_rollouts,
    group_has_variance,
)
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

__all__ = [
    "STAT_OPS",
    "DAPODataModule",
    "DifficultyTracker",
    "DynamicSamplingConfig",
    "DynamicSamplingError",
    "EndOfTraining",
    "FieldMap",
    "PromptConfig",
    "PromptDataError",
    "PredictiveSelector",
    "PromptRecord",
    "PromptSampler",
    "PromptSelectionConfig",
    "PromptStats",
    "PromptsExhausted",
    "RolloutBatch",
    "RolloutProducer",
    "RolloutTicket",
    "ScoredRollouts",
    "ScoringConfig",
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
