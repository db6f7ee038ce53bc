"""What the data module loads and builds at set-up, as plain functions: the tokenizer, the
prompt preparation (:func:`prepare_prompts`: the train and held-out prompt records from files or
a built-in task, an environment's tools introduced, tokenized and cut to ``max_prompt_length``;
the cold start, :mod:`dapo_lightning.sft`, prepares its prompts with it too), the reward runner,
and each engine group's share of the held-out prompts."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.prompts.progress import is_rank_zero
from dapo_lightning.data.prompts.sources import (
    FieldMap,
    load_prompt_records,
    records_from_rows,
    split_train_val,
    tokenize_records,
)
from dapo_lightning.envs import environment_factory
from dapo_lightning.envs.base import Environment, EnvironmentConfig
from dapo_lightning.envs.session import introduce_tools
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rewards import get_reward
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.tasks import get_task
from dapo_lightning.tasks.base import Task

__all__ = [
    "PreparedPrompts",
    "as_file_list",
    "engine_group_shard",
    "load_prompt_sets",
    "load_tokenizer",
    "make_reward_runner",
    "prepare_prompts",
    "prompt_task",
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


def load_tokenizer(model_name_or_path: str | None, field: str = "data.model_name_or_path") -> Any:
    """The tokenizer of ``model_name_or_path`` (``field``: the setting that gives it, named in
    the errors).

    Raises:
        ValueError: no path; FileNotFoundError: nothing loadable there.
    """
    if model_name_or_path is None:
        raise ValueError(f"{field} is needed to load the tokenizer.")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name_or_path)
    except OSError as err:
        raise FileNotFoundError(
            f"{field}={model_name_or_path!r}: no tokenizer could be "
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


@dataclass
class PreparedPrompts:
    """Prompt records ready for rollouts (``prompt_ids`` set), from :func:`prepare_prompts`.

    Args:
        train: The training prompts.
        val: The held-out prompts.
        dropped: Prompts dropped for being over ``max_prompt_length`` (``overlong_prompts:
            drop``), train and held-out.
    """

    train: list[PromptRecord]
    val: list[PromptRecord]
    dropped: int


#: Responses one validation may generate before :func:`warn_huge_validation` says so.
HUGE_VALIDATION_RESPONSES = 20_000


def warn_huge_validation(num_val: int, num_train: int, validation: ValidationConfig) -> None:
    """One line on stderr (rank 0) when a validation would generate more than
    :data:`HUGE_VALIDATION_RESPONSES` responses (held-out prompts x ``validation.n``): a
    ``fraction`` of a large prompt file holds out hundreds of thousands of prompts, and each
    validation (one before update 1 with ``ValidateAtStart``) generates them all, silently."""
    responses = num_val * validation.n
    if responses <= HUGE_VALIDATION_RESPONSES or not is_rank_zero():
        return
    source = (
        f"data.validation.files={validation.files}"
        if validation.files is not None
        else f"data.validation.fraction={validation.fraction} of {num_val + num_train:,} prompts"
    )
    cap = max(1, HUGE_VALIDATION_RESPONSES // (validation.n * validation.batch_size))
    print(
        f"warning: {num_val:,} held-out prompts ({source}) x validation.n={validation.n}: "
        f"every validation generates {responses:,} responses (the one before update 1 too). "
        f"Cap it with trainer.limit_val_batches (e.g. {cap}: {cap} batches of "
        f"validation.batch_size={validation.batch_size} prompts a rank), or hold out fewer "
        "(a lower data.validation.fraction, smaller data.validation.files).",
        file=sys.stderr,
        flush=True,
    )


def prepare_prompts(
    prompts: PromptConfig,
    tokenizer: Any,
    *,
    seed: int,
    validation: ValidationConfig | None,
    environment: EnvironmentConfig | None = None,
    make_env: Callable[[], Environment] | None = None,
) -> PreparedPrompts:
    """The prompts of a run as ``prompts`` prepares them, in this order:

    1. the records: a built-in task's rows (``task``, ``task_kwargs``, ``seed``) or the prompt
       files (``train_files``), the held-out ones split off as ``validation`` says
       (:func:`load_prompt_sets`); ``validation`` None: no held-out prompts (a task's own
       held-out rows are left out);
    2. with an ``environment`` that adds instructions, its tools introduced in front of every
       prompt (:func:`~dapo_lightning.envs.session.introduce_tools` on ``make_env()``, default
       :func:`~dapo_lightning.envs.environment_factory` of ``environment``);
    3. tokenized with or without the chat template, prompts over ``max_prompt_length`` tokens
       refused or dropped (:func:`~dapo_lightning.data.prompts.sources.tokenize_records`).

    The data module and the cold start (:mod:`dapo_lightning.sft`) both prepare their prompts
    here, so a demonstration starts from the tokens an RL episode starts from.

    Raises:
        ValueError: an unknown task or option, a task's own split with a held-out setting;
            :class:`~dapo_lightning.prompts.PromptDataError` for a bad row or a prompt too long.
    """
    task = prompt_task(prompts)
    train, val = load_prompt_sets(
        task, dict(prompts.task_kwargs or {}), as_file_list(prompts.train_files),
        prompt_fields(prompts, task), prompts, validation or ValidationConfig(), seed,
    )  # fmt: skip
    if validation is None:
        val = []
    elif val:
        warn_huge_validation(len(val), len(train), validation)
    tools = None  # the prompts learn of the tools by the template's tools= or instructions
    if environment is not None and environment.add_instructions:
        env = (make_env or environment_factory(environment))()
        template, role = prompts.apply_chat_template, environment.observation_role
        tools = introduce_tools(train + val, env, tokenizer, template, role)
    kw = dict(
        apply_chat_template=prompts.apply_chat_template,
        max_prompt_length=prompts.max_prompt_length,
        overlong_prompts=prompts.overlong_prompts,
        tools=tools,
    )
    train, dropped = tokenize_records(train, tokenizer, **kw)
    dropped_val = 0
    if val:
        val, dropped_val = tokenize_records(val, tokenizer, **kw)
    return PreparedPrompts(train, val, dropped + dropped_val)


def make_reward_runner(reward: Any, scoring: ScoringConfig) -> RewardRunner:
    """The reward runner of ``reward`` (a name or an object) with ``scoring``'s settings."""
    return RewardRunner(
        get_reward(reward, **scoring.reward_kwargs),
        timeout_s=scoring.timeout_s,
        num_workers=scoring.workers,
        max_failure_frac=scoring.max_failure_frac,
        in_process=scoring.in_process,
    )
