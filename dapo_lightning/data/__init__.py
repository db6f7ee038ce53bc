"""Data: the DataModule and what it is made of, by concern.

* ``prompts/``: where prompts come from and how they are prepared (sources, loading), with
  the prompt, validation and scoring settings (config);
* ``selection/``: which prompts a rank draws next (sampler, difficulty);
* ``sampling/``: dynamic sampling, one rollout step's batch (settings, producer, rounds, ...);
* ``streams/``: batches for the module, sync or one-step-off;
* ``datamodule.py`` (``DAPODataModule``), ``legacy_checkpoints.py`` (what older checkpoints
  name).
"""

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.data.datamodule import DAPODataModule, RolloutTicket, ValidationTicket
from dapo_lightning.data.legacy_checkpoints import alias_moved_modules
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.prompts.sources import (
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
from dapo_lightning.data.sampling.end_game import DynamicSamplingError, TrainingComplete
from dapo_lightning.data.sampling.groups import concat_rollouts, group_has_variance
from dapo_lightning.data.sampling.metrics import validation_metrics
from dapo_lightning.data.sampling.producer import RolloutProducer
from dapo_lightning.data.sampling.rank_layout import RankLayout
from dapo_lightning.data.sampling.settings import DynamicSamplingConfig, OneStepOffConfig
from dapo_lightning.data.sampling.step_stats import STAT_OPS, StepStats
from dapo_lightning.data.selection.difficulty import (
    DifficultyTracker,
    PredictiveSelector,
    PromptSelectionConfig,
    PromptStats,
    zero_variance_prob,
)
from dapo_lightning.data.selection.sampler import PromptSampler, PromptsExhausted

alias_moved_modules()  # checkpoints of older releases name the modules before the regrouping

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
