"""The cold start of agent RL: a short supervised warm-up on episodes an environment writes.

A small model that never calls a tool gives RL no tool use to reinforce (SmolLM2-135M-Instruct
made 0 calls in 3,500 episodes with the calculator's instructions). Peers start agent RL from a
model fine-tuned on tool-use traces (verl's ReTool recipe). Here the traces are written by the
environment itself: :meth:`~dapo_lightning.envs.ToolEnvironment.solution_turns` gives the
assistant turns of a correct episode on a prompt record, and those turns are played through the
same :class:`~dapo_lightning.envs.runner.EpisodeRunner` that runs RL episodes (by
:class:`~dapo_lightning.envs.replay.ReplayEngine`), so a demonstration has exactly the token layout and the loss mask of an
RL episode: the chat template's observation messages between the turns, observation tokens
masked out.

The loss is the token-mean negative log-likelihood of the assistant tokens
(:func:`masked_nll`)::

    L = - sum_{b,t} m[b,t] log pi(y[b,t] | x[b], y[b,<t]) / sum_{b,t} m[b,t]

with ``m`` the episode's loss mask (1 on assistant tokens, 0 on observations and padding).

Run it with ``dapo-lightning sft --config configs/sft/smollm2_tool_use.yaml``
(:mod:`dapo_lightning.cli.sft_command`, the options of :class:`SFTConfig`):
it writes a Hugging Face model folder that ``fit`` loads as ``model.model_name_or_path``. The
problems demonstrated are the ``prompts`` of the sft config: simpler ones than the RL task's, so
the warm-up teaches the call format, not the task.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from dapo_lightning.batch import pad_sequences
from dapo_lightning.checks import ConfigError, check_choice, check_count, check_finite
from dapo_lightning.data.prompts.config import PromptConfig
from dapo_lightning.data.prompts.loading import load_tokenizer, prepare_prompts
from dapo_lightning.envs import environment_factory
from dapo_lightning.envs.base import EnvironmentConfig
from dapo_lightning.envs.replay import complete_episode, play_demonstrations
from dapo_lightning.envs.runner import ObservationFormatter
from dapo_lightning.export import check_new_folder, export_pretrained
from dapo_lightning.logprobs import response_log_probs
from dapo_lightning.precision import resolve_trainer_precision
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.weights import TORCH_DTYPES, load_policy

log = logging.getLogger(__name__)


def masked_nll(log_probs: Tensor, mask: Tensor) -> Tensor:
    """Token-mean negative log-likelihood: ``-sum(m * logp) / max(sum(m), 1)``.

    Args:
        log_probs: ``[B, T]`` log-probabilities of the target tokens.
        mask: ``[B, T]`` 1 on the tokens that count (assistant tokens), 0 elsewhere.
    """
    mask = mask.to(log_probs.dtype)
    return -(log_probs * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class Demonstrations:
    """Played demonstrations, what the warm-up trains on: row ``i`` of each list is one.

    Args:
        prompt_ids: The prompt's token ids (as ``fit`` prepares them).
        response_ids: The episode's tokens: assistant turns and the observations between them.
        token_mask: Per episode token, 1 on assistant tokens (they enter the loss), 0 on
            observations.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    token_mask: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, rows: Sequence[int]) -> Demonstrations:
        """The demonstrations ``rows``, in that order."""
        return Demonstrations(
            [self.prompt_ids[i] for i in rows],
            [self.response_ids[i] for i in rows],
            [self.token_mask[i] for i in rows],
        )


def training_demonstrations(
    records: Sequence[PromptRecord],
    environment: EnvironmentConfig,
    tokenizer: Any,
    *,
    max_tokens: int,
    max_episode_tokens: int,
    use_chat_template: bool = True,
) -> Demonstrations:
    """The environment's demonstrations on ``records``, played as RL episodes (module
    docstring).

    Records the environment writes no demonstration for are skipped; an episode the
    demonstration does not finish (cut by ``max_tokens`` / ``max_episode_tokens``, or an
    environment failure) is dropped with a warning.

    Raises:
        ConfigError: the environment wrote no complete demonstration at all.
    """
    make_env = environment_factory(environment)
    formatter = ObservationFormatter(tokenizer, environment.observation_role, use_chat_template)
    episodes = play_demonstrations(
        records, make_env, environment, formatter,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        max_tokens=max_tokens, max_episode_tokens=max_episode_tokens,
    )  # fmt: skip
    played = [(r, e) for r, e in zip(records, episodes) if e is not None]
    kept = [(list(r.prompt_ids or ()), e) for r, e in played if complete_episode(e)]
    if len(kept) < len(played):
        log.warning(
            "sft: %d of %d demonstrations did not finish (cut by sampling.max_tokens or "
            "max_episode_tokens, or the environment failed): left out",
            len(played) - len(kept), len(played),
        )  # fmt: skip
    if not kept:
        raise ConfigError(
            f"environment {environment.name!r} wrote no complete demonstration for "
            f"{len(records)} prompts: give it solution_turns(record) (ToolEnvironment), prompts "
            "it can solve, or more sampling.max_tokens / max_episode_tokens."
        )
    return Demonstrations(
        prompt_ids=[p for p, _ in kept],
        response_ids=[list(e.token_ids) for _, e in kept],
        token_mask=[list(e.loss_mask or [1] * len(e.token_ids)) for _, e in kept],
    )


@dataclass
class DemonstrationBatch:
    """Padded demonstrations (:func:`pad_demonstrations`).

    Args:
        input_ids: ``[B, P + T]`` prompt (left-padded) then episode (right-padded) tokens.
        attention_mask: ``[B, P + T]`` 1 on real tokens.
        response_mask: ``[B, T]`` the episode tokens' loss mask (0 on padding).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        """``T``: the episode columns at the right of ``input_ids``."""
        return self.response_mask.shape[1]


def pad_demonstrations(demos: Demonstrations, pad_token_id: int) -> DemonstrationBatch:
    """``demos`` as tensors, in the layout of :class:`~dapo_lightning.batch.RolloutBatch`:
    with ``P`` the longest prompt and ``T`` the longest episode (at least 1), row ``b`` is::

        input_ids[b]      = [pad] * (P - |x_b|) + x_b + y_b + [pad] * (T - |y_b|)
        attention_mask[b] = [0] * (P - |x_b|)   + [1] * (|x_b| + |y_b|) + [0] * (T - |y_b|)
        response_mask[b]  = m_b + [0] * (T - |y_b|)

    for prompt ``x_b``, episode ``y_b`` and its token mask ``m_b``
    (:func:`~dapo_lightning.batch.pad_sequences`)."""
    return DemonstrationBatch(
        *pad_sequences(demos.prompt_ids, demos.response_ids, demos.token_mask, pad_token_id)
    )


@dataclass
class SFTSettings:
    """The warm-up's optimisation.

    Args:
        steps: AdamW updates.
        lr: Learning rate (constant).
        batch_size: Demonstrations per update (drawn without replacement, reshuffled each
            pass over them).
        weight_decay: AdamW weight decay.
    """

    steps: int = 30
    lr: float = 1.0e-5
    batch_size: int = 8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_count("train.steps", self.steps, 1, "AdamW updates")
        check_count("train.batch_size", self.batch_size, 1, "demonstrations per update")
        check_finite("train.lr", self.lr, "Give a learning rate > 0, e.g. 1e-5.")
        check_finite("train.weight_decay", self.weight_decay, "Give a decay >= 0.")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ConfigError(
                f"train.lr must be > 0 and train.weight_decay >= 0, got {self.lr} and "
                f"{self.weight_decay}."
            )


class DemonstrationBatches(torch.utils.data.IterableDataset):
    """Endless padded batches of ``batch_size`` demonstrations (:func:`pad_demonstrations`),
    reshuffled each pass (a ``random.Random(seed)`` shuffle of the rows; a last short batch of
    a pass is left out)."""

    def __init__(self, demos: Demonstrations, batch_size: int, pad_token_id: int, seed: int):
        self.demos = demos
        self.batch_size = min(batch_size, len(demos))
        self.pad_token_id = pad_token_id
        self.seed = seed

    def __iter__(self) -> Iterator[DemonstrationBatch]:
        rng = random.Random(self.seed)
        while True:
            order = list(range(len(self.demos)))
            rng.shuffle(order)
            for i in range(0, len(order) - self.batch_size + 1, self.batch_size):
                part = self.demos.select(order[i : i + self.batch_size])
                yield pad_demonstrations(part, self.pad_token_id)


class SFTModule(LightningModule):
    """Masked next-token likelihood on padded demonstration batches (:func:`masked_nll`).

    Args:
        model_name_or_path: The model to warm up.
        settings: Optimisation settings.
        torch_dtype: Weights' dtype when loaded.
    """

    def __init__(
        self, model_name_or_path: str, settings: SFTSettings, torch_dtype: str = "float32"
    ) -> None:
        super().__init__()
        self.model_name_or_path = model_name_or_path
        self.settings = settings
        self.torch_dtype = torch_dtype
        self.policy: Any = None

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy = load_policy(self.model_name_or_path, self.torch_dtype)
            self.policy.train()

    def training_step(self, batch: DemonstrationBatch, batch_idx: int) -> Tensor:
        logp, _ = response_log_probs(
            self.policy, batch.input_ids, batch.attention_mask, batch.response_width
        )
        loss = masked_nll(logp, batch.response_mask)
        tokens = batch.response_mask.sum()
        self.log("sft/loss", loss.detach(), prog_bar=True, batch_size=batch.batch_size)
        self.log("sft/tokens", tokens, batch_size=batch.batch_size)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        s = self.settings
        return torch.optim.AdamW(self.policy.parameters(), lr=s.lr, weight_decay=s.weight_decay)


@dataclass
class SFTConfig:
    """``dapo-lightning sft``: the model, the problems demonstrated and their episodes.

    Args:
        model_name_or_path: The model to warm up (a folder or hub name).
        output_dir: The warmed-up model folder to write (must not exist, or be empty); ``fit``
            loads it as ``model.model_name_or_path``.
        prompts: The problems demonstrated (``data.prompts`` of a fit config, as a
            :class:`PromptConfig` or its keyword dict: a ``task`` with ``task_kwargs``, or
            ``train_files``); simpler ones than the RL task's teach the format without the
            task. Held-out rows of a task are not used.
        environment: The environment that writes and plays the demonstrations (the fit
            config's ``data.environment``, so the episodes have the same format).
        max_tokens: Most assistant tokens per episode (the fit config's ``sampling.max_tokens``).
        train: The optimisation (:class:`SFTSettings`).
        seed: Seeds the problems (a task's ``seed``) and the batch order.
        accelerator: Lightning's ``accelerator`` (``auto``, ``cpu``, ``gpu``).
        precision: Lightning's ``precision``; ``auto`` as ``fit`` decides
            (:mod:`dapo_lightning.precision`).
        torch_dtype: Weights' dtype when loaded (and written).
        log_dir: Where the ``metrics.csv`` of the warm-up goes; None: ``<output_dir>-logs``.
    """

    model_name_or_path: str
    output_dir: str
    prompts: PromptConfig | dict[str, Any] | None = None
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    max_tokens: int = 64
    train: SFTSettings = field(default_factory=SFTSettings)
    seed: int = 0
    accelerator: str = "auto"
    precision: str = "auto"
    torch_dtype: str = "float32"
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompts, PromptConfig):  # YAML / keyword form: one type after
            self.prompts = PromptConfig(**(self.prompts or {}))
        check_count("max_tokens", self.max_tokens, 1, "assistant tokens per episode")
        check_count("seed", self.seed, 0, "any integer >= 0")
        check_choice("torch_dtype", self.torch_dtype, TORCH_DTYPES)


def load_demonstration_records(config: SFTConfig, tokenizer: Any) -> list[PromptRecord]:
    """The training prompt records of ``config.prompts`` as ``fit`` prepares them
    (:func:`~dapo_lightning.data.prompts.loading.prepare_prompts`: the environment's instructions and
    worked example, tokenized); a task's held-out rows are not used.

    Raises:
        ConfigError: an environment that cannot be built, an unknown task or option, a bad
            prompt row or file (named).
    """
    try:
        make_env = environment_factory(config.environment)
    except ValueError as err:
        raise ConfigError(f"environment: {err}") from None
    try:
        prepared = prepare_prompts(
            config.prompts, tokenizer, seed=config.seed, validation=None,
            environment=config.environment, make_env=make_env,
        )  # fmt: skip
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as err:  # the task's own checks, a missing file
        raise ConfigError(f"prompts: {err}") from None
    return prepared.train


def fit_demonstrations(
    config: SFTConfig, demos: Demonstrations, tokenizer: Any
) -> tuple[SFTModule, float]:
    """:class:`SFTModule` fitted on ``demos`` for ``config.train.steps`` updates (seeded by
    ``config.seed``), logging ``sft/loss`` and ``sft/tokens`` to ``metrics.csv`` in
    :func:`sft_log_dir`, and its last ``sft/loss``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = DemonstrationBatches(demos, config.train.batch_size, int(pad), config.seed)
    module = SFTModule(config.model_name_or_path, config.train, config.torch_dtype)
    trainer = Trainer(
        accelerator=config.accelerator,
        devices=1,
        precision=resolve_trainer_precision(config.precision, config.accelerator),
        max_steps=config.train.steps,
        logger=CSVLogger(str(sft_log_dir(config)), name="", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(config.seed)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return module, float(trainer.callback_metrics.get("sft/loss", float("nan")))


def sft_log_dir(config: SFTConfig) -> Path:
    """``config.log_dir``, else ``<output_dir>-logs`` beside the output folder."""
    out = Path(config.output_dir)
    return Path(config.log_dir) if config.log_dir else out.parent / f"{out.name}-logs"


def run_sft(config: SFTConfig) -> Path:
    """Write demonstrations, fit :class:`SFTModule` on them, export the model folder; the
    run's numbers go to ``sft_summary.json`` in :func:`sft_log_dir`.

    Returns:
        The written model folder.
    """
    try:
        out = check_new_folder(config.output_dir)
    except FileExistsError as err:
        raise ConfigError(f"output_dir: {err}") from None
    started, cpu0 = time.perf_counter(), time.process_time()
    try:  # as the data module loads it
        tokenizer = load_tokenizer(config.model_name_or_path, field="model_name_or_path")
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    records = load_demonstration_records(config, tokenizer)
    max_prompt = max(len(r.prompt_ids or ()) for r in records)
    demos = training_demonstrations(
        records, config.environment, tokenizer, max_tokens=config.max_tokens,
        max_episode_tokens=config.environment.episode_budget(max_prompt, config.max_tokens),
        use_chat_template=config.prompts.apply_chat_template,
    )  # fmt: skip
    module, final_loss = fit_demonstrations(config, demos, tokenizer)
    export_pretrained(module.policy, tokenizer, out)
    summary = {
        "demonstrations": len(demos),
        "steps": config.train.steps,
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu0, 1),
        "final_loss": final_loss,
    }
    (sft_log_dir(config) / "sft_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"sft: wrote {out} ({json.dumps(summary)})")
    return out


__all__ = [
    "DemonstrationBatch",
    "DemonstrationBatches",
    "Demonstrations",
    "SFTConfig",
    "SFTModule",
    "SFTSettings",
    "fit_demonstrations",
    "load_demonstration_records",
    "masked_nll",
    "pad_demonstrations",
    "run_sft",
    "training_demonstrations",
]
