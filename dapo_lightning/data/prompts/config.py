"""The data module's setting groups besides sampling: where the prompts' fields are and how
they are prepared, from files or a built-in task (:class:`PromptConfig`), how responses are scored (:class:`ScoringConfig`)
and how the held-out set is validated (:class:`ValidationConfig`).

Each is declared, documented and validated here once (NaN and infinities refused, the field
named, :class:`~dapo_lightning.checks.ConfigError`: one ``error:`` line from the CLI); the data
module takes them whole. YAML::

    data:
      init_args:
        prompts: {train_files: data/train.jsonl, prompt_key: question, answer_key: answer,
                  max_prompt_length: 512}
        scoring: {timeout_s: 10.0, workers: 4}
        validation: {files: data/test.jsonl, n: 4, temperature: 0.6}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dapo_lightning.checks import ConfigError, check_choice, check_finite, choices_of
from dapo_lightning.data.prompts.sources import FieldMap

__all__ = ["PromptConfig", "ScoringConfig", "ValidationConfig", "check_batch_split"]


def _finite(owner: str, name: str, value: float, fix: str) -> None:
    check_finite(f"data.{owner}.{name}", value, fix)


#: What a prompt longer than the prompt budget does (PromptConfig.overlong_prompts).
OverlongPrompts = Literal["error", "drop"]


@dataclass
class PromptConfig:
    """Where the training prompts come from, where a row's fields are, and how prompts become
    token ids.

    Args:
        train_files: Prompt files (JSONL, Parquet, a ``save_to_disk`` folder or a hub name).
        task: A built-in task instead of files (:data:`dapo_lightning.tasks.TASKS`:
            ``"arithmetic"``, ``"word_problems"``, ``"reasoning_gym"``). A task whose rows carry
            a ``split`` field holds out its own ``"val"`` rows (then ``validation.fraction``
            must be 0). Exactly one of ``train_files`` and ``task`` is given.
        task_kwargs: Options of the task's problem generator (``seed`` defaults to the run's).
        prompt_key: Field holding the prompt (string or chat messages).
        answer_key: Field holding the ground truth; dotted paths reach nested fields.
        uid_key: Field holding a stable prompt id; None hashes the prompt text.
        data_source_key: Field naming the data source (passed to the reward).
        apply_chat_template: Wrap prompts in the tokenizer's chat template (string prompts
            become one user message) with the generation prompt appended.
        dedup: Remove repeated prompts (the public DAPO-Math-17k file repeats each ~100x).
        max_prompt_length: Most prompt tokens (after the chat template).
        overlong_prompts: Prompts over ``max_prompt_length`` tokens: ``"error"`` or
            ``"drop"`` (counted in ``data/dropped_prompts``).

    A built-in task (``data.prompts.task``) brings its own fields; the keys are not read then.
    """

    train_files: str | list[str] | None = None
    task: str | None = None
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    uid_key: str | None = None
    data_source_key: str | None = "data_source"
    apply_chat_template: bool = True
    dedup: bool = True
    max_prompt_length: int = 2048
    overlong_prompts: OverlongPrompts = "error"

    def __post_init__(self) -> None:
        if isinstance(self.max_prompt_length, bool) or not isinstance(self.max_prompt_length, int):
            raise ConfigError(
                f"data.prompts.max_prompt_length must be an integer number of tokens, got "
                f"{self.max_prompt_length!r}."
            )
        if self.max_prompt_length < 1:
            raise ConfigError(
                f"data.prompts.max_prompt_length must be >= 1 token, got {self.max_prompt_length}."
            )
        check_choice(
            "data.prompts.overlong_prompts", self.overlong_prompts, choices_of(OverlongPrompts)
        )
        for name in ("prompt_key", "answer_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(
                    f"data.prompts.{name} must name a field, got {getattr(self, name)!r}."
                )

    def field_map(self) -> FieldMap:
        """The row fields as :class:`~dapo_lightning.data.prompts.sources.FieldMap`."""
        return FieldMap(self.prompt_key, self.answer_key, self.uid_key, self.data_source_key)


@dataclass
class ScoringConfig:
    """How the reward scores responses (:class:`~dapo_lightning.rewards.base.RewardRunner`).

    Args:
        reward_kwargs: Constructor options of a reward given by name (``data.reward``).
        timeout_s: Most seconds scoring one response may take (then it fails).
        workers: Reward worker processes.
        max_failure_frac: Largest share of a round whose scoring may fail before the run
            stops with an error, in [0, 1].
        in_process: Score on a thread of the training process (fast, for trusted rewards
            and tests; needed for a reward that cannot be pickled): ``timeout_s`` and a stop
            still apply, but a timed-out call is abandoned, not killed.
    """

    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    workers: int = 1
    max_failure_frac: float = 0.1
    in_process: bool = False

    def __post_init__(self) -> None:
        self.reward_kwargs = dict(self.reward_kwargs or {})
        _finite("scoring", "timeout_s", self.timeout_s, "Give the seconds one response may take.")
        _finite("scoring", "max_failure_frac", self.max_failure_frac, "Give a share in [0, 1].")
        if self.timeout_s <= 0:
            raise ConfigError(f"data.scoring.timeout_s must be > 0 seconds, got {self.timeout_s}.")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(
                f"data.scoring.workers must be an integer >= 1, got {self.workers!r}."
            )
        if not 0 <= self.max_failure_frac <= 1:
            raise ConfigError(
                f"data.scoring.max_failure_frac must be in [0, 1], got {self.max_failure_frac}."
            )


@dataclass
class ValidationConfig:
    """The held-out prompts and how they are sampled.

    Args:
        files: Held-out prompt files (JSONL, Parquet, a ``save_to_disk`` folder or a hub
            name); None: ``fraction`` of the train prompts (or no validation).
        fraction: Share of train prompts held out when ``files`` is None, in [0, 1).
        n: Responses per held-out prompt (``val/pass@n`` is logged).
        temperature: Sampling temperature of validation (> 0).
        batch_size: Held-out prompts per validation step (per rank).
    """

    files: str | list[str] | None = None
    fraction: float = 0.0
    n: int = 1
    temperature: float = 1.0
    batch_size: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.files, Path):
            self.files = str(self.files)
        _finite("validation", "fraction", self.fraction, "Give a share in [0, 1).")
        _finite("validation", "temperature", self.temperature, "Give a temperature > 0 (1.0).")
        if not 0 <= self.fraction < 1:
            raise ConfigError(f"data.validation.fraction must be in [0, 1), got {self.fraction}.")
        if self.temperature <= 0:
            raise ConfigError(f"data.validation.temperature must be > 0, got {self.temperature}.")
        for name in ("n", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.validation.{name} must be an integer >= 1, got {value!r}.")


def check_batch_split(
    train_batch_size: int, gen_batch_size: int | None, world_size: int, num_prompts: int
) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` naming the ``data.dynamic_sampling``
    field unless the global batch sizes split over ``world_size`` ranks and one round's prompts
    (``gen_batch_size``, or ``train_batch_size`` when it is None) fit the ``num_prompts``
    training prompts: a round draws each prompt at most once, ``num_prompts // world_size`` per
    rank."""
    per_round = gen_batch_size or train_batch_size
    field_name = "gen_batch_size" if gen_batch_size else "train_batch_size"
    for name, value in (("train_batch_size", train_batch_size), (field_name, per_round)):
        if value < world_size or value % world_size:
            raise ConfigError(
                f"data.dynamic_sampling.{name}={value} is global (over all ranks) and must be a "
                f"positive multiple of world_size={world_size}: use e.g. "
                f"{max(1, value // world_size) * world_size}."
            )
    per_rank = num_prompts // world_size
    if per_round // world_size > per_rank:
        null = "" if gen_batch_size else " (gen_batch_size is null: the prompts per round)"
        raise ConfigError(
            f"data.dynamic_sampling.{field_name}={per_round}{null} is more than the {num_prompts} "
            f"training prompts ({per_rank} per rank): every round would draw the same prompts "
            f"several times. Fix: set data.dynamic_sampling.gen_batch_size to at most "
            f"{per_rank * world_size}, or add prompts."
        )
