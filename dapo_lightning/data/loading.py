"""What the data module loads and builds at set-up, as plain functions: the train and
held-out prompt records (from files or a built-in task) and their token ids, the tokenizer,
the reward runner, and each engine group's share of the held-out prompts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dapo_lightning.data.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.sources import (
    FieldMap,
    PromptRecord,
    load_prompt_records,
    records_from_rows,
    split_train_val,
    tokenize_records,
)
from dapo_lightning.rewards import RewardRunner, get_reward
from dapo_lightning.tasks import Task, get_task

__all__ = [
    "as_file_list",
    "engine_group_shard",
    "load_prompt_sets",
    "load_tokenizer",
    "make_reward_runner",
    "prompt_task",
    "tokenize_prompt_sets",
]


def as_file_list(files: str | Path | list[str] | None) -> list[str] | None:
    """``files`` as a list of path strings (None stays None)."""
    if files is None:
        return None
    if isinstance(files, (str, Path)):
        return [str(files)]
    return [str(f) for f in files]


def prompt_task(prompts: PromptConfig) -> Task | None:
    """The built-in task ``prompts`` names (its options checked), or None for prompt files.

    Raises:
        ValueError: neither or both of ``train_files`` and ``task``; an unknown task or option.
    """
    if (prompts.train_files is None) == (prompts.task is None):
        raise ValueError(
            "DAPODataModule needs exactly one of train_files (prompt files) or task "
            "(a built-in task, see dapo_lightning.tasks.TASKS) in data.prompts."
        )
    task = get_task(prompts.task) if prompts.task is not None else None
    if task is not None and task.check is not None:
        task.check(**(prompts.task_kwargs or {}))
    return task


def prompt_fields(prompts: PromptConfig, task: Task | None) -> FieldMap:
    """Where a row's fields are: a built-in task's rows have ``prompt`` / ``answer`` / ``uid``;
    prompt files have the keys of ``prompts``."""
    if task is not None:
        return FieldMap("prompt", "answer", "uid", None)
    return prompts.field_map()


def load_prompt_sets(
    task: Any,
    task_kwargs: dict[str, Any],
    train_files: list[str] | None,
    fields: FieldMap,
    prompts: PromptConfig,
    validation: ValidationConfig,
    seed: int,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """``(train, held-out)`` prompt records: a task's rows (its own ``"val"`` split when its
    rows carry one) or ``train_files``; held out by ``validation.files`` or ``fraction``.

    Raises:
        ValueError: a task with its own split and a validation fraction or files.
    """
    if task is not None:
        rows = task.make_rows(**{"seed": seed, **task_kwargs})
        records = records_from_rows(rows, fields, name=task.name)
        if any("split" in r.meta for r in records):  # the task holds out its own problems
            if validation.fraction > 0 or validation.files is not None:
                raise ValueError(
                    f"task={task.name!r} has its own held-out problems (its rows' "
                    "split): set validation.fraction: 0 and no validation.files."
                )
            split = [r.meta.get("split") == "val" for r in records]
            return [r for r, v in zip(records, split) if not v], [
                r for r, v in zip(records, split) if v
            ]
    else:
        records = load_prompt_records(train_files, fields, dedup=prompts.dedup)
    val_files = as_file_list(validation.files)
    if val_files is not None:
        return records, load_prompt_records(val_files, fields, dedup=prompts.dedup)
    if validation.fraction > 0:
        return split_train_val(records, validation.fraction, seed)
    return records, []


def load_tokenizer(model_name_or_path: str | None) -> Any:
    """The tokenizer of ``model_name_or_path``.

    Raises:
        ValueError: no path; FileNotFoundError: nothing loadable there.
    """
    if model_name_or_path is None:
        raise ValueError("DAPODataModule needs model_name_or_path to load the tokenizer.")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name_or_path)
    except OSError as err:
        raise FileNotFoundError(
            f"data.model_name_or_path={model_name_or_path!r}: no tokenizer could be "
            f"loaded ({err}). Fix: give an existing folder written by save_pretrained or "
            "a hub id (with network access)."
        ) from err


def engine_group_shard(
    records: list[PromptRecord], rank: int, world: int, tp_size: int
) -> list[PromptRecord]:
    """This engine group's held-out prompts (the ``tp_size`` ranks of one engine share them),
    wrapped around so every group has the same number (a few prompts count twice)."""
    rank, world = rank // tp_size, world // tp_size
    if not records:
        return []
    per_rank = math.ceil(len(records) / world)
    padded = [records[i % len(records)] for i in range(per_rank * world)]
    return padded[rank::world]


def tokenize_prompt_sets(
    train: list[PromptRecord],
    val: list[PromptRecord],
    tokenizer: Any,
    prompts: PromptConfig,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord], int]:
    """``(train, held-out, prompts dropped)`` with token ids, as ``prompts`` prepares them
    (``tools``: an environment's tool schemas for a chat template that renders them)."""
    kw = dict(
        apply_chat_template=prompts.apply_chat_template,
        max_prompt_length=prompts.max_prompt_length,
        overlong_prompts=prompts.overlong_prompts,
        tools=tools,
    )
    train_records, dropped = tokenize_records(train, tokenizer, **kw)
    val_records: list[PromptRecord] = []
    if val:
        val_records, dropped_val = tokenize_records(val, tokenizer, **kw)
        dropped += dropped_val
    return train_records, val_records, dropped


def make_reward_runner(reward: Any, scoring: ScoringConfig) -> RewardRunner:
    """The reward runner of ``reward`` (a name or an object) with ``scoring``'s settings."""
    return RewardRunner(
        get_reward(reward, **scoring.reward_kwargs),
        timeout_s=scoring.timeout_s,
        num_workers=scoring.workers,
        max_failure_frac=scoring.max_failure_frac,
        in_process=scoring.in_process,
    )
