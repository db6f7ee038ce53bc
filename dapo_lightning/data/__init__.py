"""Data: prompt sources, the arithmetic task, the dynamic-sampling buffer and the DataModule."""

from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.buffer import (
    STAT_KEYS,
    DynamicSamplingBuffer,
    DynamicSamplingError,
    concat_rollouts,
    group_has_variance,
)
from dapo_lightning.data.datamodule import DAPODataModule, RolloutTicket, ValidationTicket
from dapo_lightning.data.difficulty import DifficultyTracker, PromptStats, subsample_keep_variance
from dapo_lightning.data.metrics import validation_metrics
from dapo_lightning.data.sampler import PromptSampler
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
from dapo_lightning.tasks.arithmetic import LEVELS, make_arithmetic_rows

__all__ = [
    "LEVELS",
    "STAT_KEYS",
    "DAPODataModule",
    "DifficultyTracker",
    "DynamicSamplingBuffer",
    "DynamicSamplingError",
    "FieldMap",
    "PromptDataError",
    "PromptRecord",
    "PromptSampler",
    "PromptStats",
    "RolloutBatch",
    "RolloutTicket",
    "ScoredRollouts",
    "ValidationTicket",
    "concat_rollouts",
    "deduplicate",
    "group_has_variance",
    "load_prompt_records",
    "make_arithmetic_rows",
    "read_rows",
    "records_from_rows",
    "split_train_val",
    "subsample_keep_variance",
    "tokenize_records",
    "validation_metrics",
]
