"""``DAPODataModule``: prompts in, on-policy ``RolloutBatch`` es out.

On-policy by construction (docs/design.md, invariant 2): Lightning prefetches one batch ahead,
so the train DataLoader yields only lightweight :class:`RolloutTicket` s; the rollouts for a
step are generated in :meth:`DAPODataModule.on_before_batch_transfer`, which Lightning runs
right before that step's ``training_step`` (after the previous step's updates). The prompt
cursor advances only there, so prefetching changes nothing. Validation works the same way with
:class:`ValidationTicket` s, returning :class:`~dapo_lightning.batch.ScoredRollouts` of
``validation.n`` responses per held-out prompt.

The pieces it wires together, each with one home: the prompt sources
(:mod:`dapo_lightning.data.prompts.sources`, or a built-in task from :mod:`dapo_lightning.tasks`), the
reward runner, the engine session (:mod:`dapo_lightning.rollout.session`: building the engine,
its weights) and the rollout producer (:mod:`dapo_lightning.data.sampling.producer`: dynamic sampling).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from dapo_lightning.batch import EndOfTraining, RolloutBatch, ScoredRollouts
from dapo_lightning.contract import PolicyHandle, RolloutSpec
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.prompts.loading import (
    as_file_list,
    engine_group_shard,
    load_tokenizer,
    make_reward_runner,
    prepare_prompts,
    prompt_fields,
    prompt_task,
)
from dapo_lightning.data.sampling.producer import RolloutProducer
from dapo_lightning.data.sampling.rank_layout import RankLayout
from dapo_lightning.data.sampling.rounds import RoundHooks
from dapo_lightning.data.sampling.settings import DynamicSamplingConfig, OneStepOffConfig
from dapo_lightning.data.selection.difficulty import PromptSelectionConfig
from dapo_lightning.data.streams.one_step_off import (
    build_stream,
    check_pipeline,
    rollout_process_group,
)
from dapo_lightning.data.streams.stream import RolloutStream
from dapo_lightning.envs import environment_factory, unsolved_demonstrations
from dapo_lightning.envs.base import EnvironmentConfig
from dapo_lightning.envs.session import EpisodeSession
from dapo_lightning.hooks import call_dapo_hook, warn_undeclared_dapo_hooks
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.ranks import gather_objects, sum_over_group, sum_over_ranks
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import RolloutEngine, SamplingConfig
from dapo_lightning.rollout.engines import check_engine, engine_capabilities
from dapo_lightning.rollout.session import EngineSession
from dapo_lightning.shared_cores import SharedCores


@dataclass(frozen=True)
class RolloutTicket:
    """Placeholder the train DataLoader yields; replaced by a RolloutBatch just before the step."""

    step: int


@dataclass(frozen=True)
class ValidationTicket:
    """Placeholder for validation chunk ``index`` (``validation.batch_size`` held-out prompts)."""

    index: int


class _Tickets(IterableDataset):
    def __init__(self, make: Any, length: int | None) -> None:
        self.make = make
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        i = 0
        while self.length is None or i < self.length:
            yield self.make(i)
            i += 1

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("infinite ticket stream")
        return self.length


# The data module's hyper-parameters (saved in checkpoints) hold these plain dataclasses:
# allow them in ``torch.load(weights_only=True)``.
torch.serialization.add_safe_globals(
    [
        SamplingConfig,
        DynamicSamplingConfig,
        OneStepOffConfig,
        PromptSelectionConfig,
        EnvironmentConfig,
        PromptConfig,
        ScoringConfig,
        ValidationConfig,
    ]
)

#: The paper's sampling: 20480-token responses at temperature 1.0.
PAPER_SAMPLING = SamplingConfig(max_tokens=20480)
#: The paper's dynamic sampling: 512 groups of 16 per step, the "acc" filter.
PAPER_DYNAMIC_SAMPLING = DynamicSamplingConfig()


class DAPODataModule(pl.LightningDataModule):
    """Prompts, rollout engine, reward and dynamic sampling of a DAPO run.

    Args:
        model_name_or_path: Checkpoint folder or hub id; the tokenizer is loaded from it in
            ``setup()`` (and the vLLM engine, with ``engine="vllm"``).
        prompts: Where the prompts come from (``train_files`` or a built-in ``task`` and its
            ``task_kwargs``), where a row's fields are, the chat template, de-duplication and
            the prompt length (:class:`~dapo_lightning.data.prompts.config.PromptConfig`).
        reward: "dapo" (paper "Answer:" rule), "math_verify", "arithmetic", "last_number", or a
            reward object; None: the task's reward (else "dapo").
        scoring: The reward's options, timeout, workers and failure budget
            (:class:`~dapo_lightning.data.prompts.config.ScoringConfig`).
        engine: "hf" (samples with the policy module itself), "vllm", or an engine object
            (a :class:`~dapo_lightning.rollout.base.RolloutEngine`).
        engine_kwargs: Constructor options of the engine.
        sampling: How training rollouts are sampled: ``max_tokens`` (the maximum response
            length, paper 20480), ``temperature`` (paper 1.0; the module's log-probs use the
            same, read from each batch), ``top_p``, ``top_k``.
        dynamic_sampling: Group size, batch sizes, the filter and its end game
            (:class:`~dapo_lightning.data.sampling.producer.DynamicSamplingConfig`).
        validation: Held-out files (or a fraction of the train prompts), responses per prompt,
            temperature and batch size (:class:`~dapo_lightning.data.prompts.config.ValidationConfig`).
        steps_per_epoch: Rollout steps per Lightning epoch; None makes one endless epoch
            (stop with ``max_steps``).
        seed: Seeds the prompt order, validation split, subsampling and the engines; None uses
            the run's ``seed_everything`` (0 when there is none).
        environment: Multi-turn episodes in an environment instead of single responses
            (:class:`~dapo_lightning.envs.EnvironmentConfig`: ``name`` (``"calculator"`` or
            your class path), ``init_args``, ``max_turns``, ``max_episode_tokens``,
            ``call_timeout_s``, ...); None: single-turn rollouts.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        prompts: PromptConfig = PromptConfig(),  # noqa: B008 - a plain dataclass
        reward: str | Any | None = None,
        scoring: ScoringConfig = ScoringConfig(),  # noqa: B008 - a plain dataclass
        engine: str | Any = "hf",
        engine_kwargs: dict[str, Any] | None = None,
        sampling: SamplingConfig = PAPER_SAMPLING,
        dynamic_sampling: DynamicSamplingConfig = PAPER_DYNAMIC_SAMPLING,
        validation: ValidationConfig = ValidationConfig(),  # noqa: B008 - a plain dataclass
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        environment: EnvironmentConfig | None = None,
    ) -> None:
        super().__init__()
        self.task = prompt_task(prompts)
        check_engine(
            engine, model_name_or_path, field="data.engine", path_field="data.model_name_or_path"
        )
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1 or None, got {steps_per_epoch}.")
        self.save_hyperparameters(ignore=["reward", "engine"])
        self.model_name_or_path = model_name_or_path
        self.train_files = as_file_list(prompts.train_files)
        self.task_kwargs = dict(prompts.task_kwargs or {})
        #: Prompt fields and preparation; the reward's runner settings; validation.
        self.prompts, self.scoring, self.validation = prompts, scoring, validation
        self.fields = prompt_fields(prompts, self.task)
        self.reward = reward if reward is not None else (self.task.reward if self.task else "dapo")
        self.engine_spec: str | RolloutEngine = engine
        self.engine_kwargs = dict(engine_kwargs or {})
        #: Sampling settings of training rollouts (the module reads them from each batch).
        self.sampling = dataclasses.replace(sampling)
        #: Dynamic-sampling settings (declared to the module by :meth:`rollout_spec`).
        self.dynamic_sampling = dynamic_sampling
        #: Sampling settings of validation.
        self.val_sampling = dataclasses.replace(sampling, temperature=validation.temperature)
        self.steps_per_epoch = steps_per_epoch
        self._seed = seed
        #: Multi-turn environment settings (None: single-turn rollouts).
        self.environment = environment
        self._make_env = environment_factory(environment) if environment is not None else None
        self.tokenizer: Any = None
        self.train_records: list[PromptRecord] = []
        self.val_records: list[PromptRecord] = []
        self.reward_runner: RewardRunner | None = None
        self.dropped_prompts = 0
        #: uids drawn at each training step (this rank), for logging and tests.
        self.drawn_log: list[list[str]] = []
        self._pending_state: dict[str, Any] | None = None
        #: This rank's rollouts: the one object that holds the engine session, the producer
        #: and the published weights (sync or one-step-off, :func:`build_stream`); None until
        #: ``setup`` (:attr:`is_set_up`).
        self.stream: RolloutStream | None = None
        #: The one-step-off rollout thread's process group (None: the trainer's reduce).
        self._rollout_group: Any = None

    @property
    def max_prompt_length(self) -> int:
        """Most prompt tokens (``prompts.max_prompt_length``)."""
        return self.prompts.max_prompt_length

    @property
    def seed(self) -> int:
        """``seed``, else the run's ``seed_everything`` (``PL_GLOBAL_SEED``), else 0."""
        if self._seed is not None:
            return self._seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    @property
    def is_set_up(self) -> bool:
        """Whether ``setup`` built the rollout stream (before it, a checkpoint's state waits)."""
        return self.stream is not None

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine once built (None before the first generation)."""
        return self.stream.session.built_engine if self.stream is not None else None

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and prompts, build the reward runner and the rollout stream
        (once)."""
        if self.is_set_up:
            return
        warn_undeclared_dapo_hooks(self.trainer)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_name_or_path)
        prepared = prepare_prompts(
            self.prompts, self.tokenizer, seed=self.seed, validation=self.validation,
            environment=self.environment, make_env=self._make_env,
        )  # fmt: skip
        self.train_records, self.val_records = prepared.train, prepared.val
        self.dropped_prompts = prepared.dropped
        rank, world = self._rank_world()
        if self.dynamic_sampling.pipeline == "one_step_off":
            check_pipeline(self.trainer, self.engine_kwargs)
            self._rollout_group = rollout_process_group(world)
        self.reward_runner = make_reward_runner(self.reward, self.scoring)
        self.stream = build_stream(
            self.dynamic_sampling,
            lambda cores: _engine_session(self, rank, cores, self._make_env),
            lambda session: _rollout_producer(
                self, session, RankLayout(rank, world, self._tp_size), self._sum_over_ranks
            ),
            self.drawn_log,
        )
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def _sum_over_ranks(self, flags: list[int]) -> list[int]:
        if self._rollout_group is not None:  # the rollout thread's own collectives
            return sum_over_group(flags, self._rollout_group)
        return sum_over_ranks(flags, getattr(self.trainer, "strategy", None))

    def teardown(self, stage: str | None = None) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.reward_runner is not None:
            self.reward_runner.close()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Tickets(RolloutTicket, self.steps_per_epoch), batch_size=None)

    @property
    def _tp_size(self) -> int:
        """Ranks per rollout engine (vLLM tensor parallelism): they submit the same prompts."""
        if not engine_capabilities(self.engine_spec).tensor_parallel:
            return 1
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    def _val_shard(self) -> list[PromptRecord]:
        rank, world = self._rank_world()
        return engine_group_shard(self.val_records, rank, world, self._tp_size)

    def val_dataloader(self) -> DataLoader | list:
        shard = self._val_shard()
        if not shard:
            return []
        chunks = math.ceil(len(shard) / self.validation.batch_size)
        return DataLoader(_Tickets(ValidationTicket, chunks), batch_size=None)

    def rollout_spec(self) -> RolloutSpec:
        """What every rollout batch of this run will be (the module checks it at fit start)."""
        return RolloutSpec(
            group_size=self.dynamic_sampling.n,
            train_batch_size=self.dynamic_sampling.train_batch_size,
            max_prompt_length=self.max_prompt_length,
            max_response_tokens=self.sampling.max_tokens,
        )

    def publish_policy(self, handle: PolicyHandle) -> None:
        """Sample from now on with ``handle``'s weights, stamped with its version: the engine
        session pushes them at the next generation (waking a sleep-mode engine first). Then a
        one-step-off batch waiting for ``start_after_updates`` publishes starts if they are
        done."""
        stream = self._ready("publishing a policy")
        stream.publish(handle)
        stream.start_if_due()

    def core_share(self) -> SharedCores | None:
        """The update's share of the cores while the one-step-off rollout thread generates
        beside it (None in sync mode, or before ``setup``)."""
        return self.stream.cores if self.stream is not None else None

    def rewind_rollout_batch(self) -> None:
        """Put the producer and the engine's RNG back to before the last
        :meth:`next_rollout_batch` (on resume the same rollouts are generated again)."""
        if self.stream is not None:
            self.stream.rewind()

    def _ready(self, doing: str) -> RolloutStream:
        if self.stream is None:
            raise RuntimeError(f"call setup() before {doing}.")
        return self.stream

    def next_rollout_batch(self) -> RolloutBatch | EndOfTraining:
        """Generate, score, shape and filter the rollouts of the current step."""
        return self._ready("generating rollouts").next_batch(self.dropped_prompts)

    def validation_rollouts(self, index: int) -> ScoredRollouts:
        """``validation.n`` scored responses for each prompt of validation chunk ``index``."""
        stream, size = self._ready("validating"), self.validation.batch_size
        chunk = self._val_shard()[index * size : (index + 1) * size]
        return stream.validate(chunk, self.validation.n, self.val_sampling)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn a ticket into its rollouts, right before the step that consumes them."""
        if isinstance(batch, RolloutTicket):
            return self.next_rollout_batch()
        if isinstance(batch, ValidationTicket):
            return self.validation_rollouts(batch.index)
        return batch

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Rollout batches move their tensors; scored rollouts and the end marker stay as they
        are (validation reads them on the CPU)."""
        if isinstance(batch, RolloutBatch):
            return batch.to(device)
        if isinstance(batch, (ScoredRollouts, EndOfTraining)):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's prompt cursor, RNGs, per-prompt statistics, carried groups and engine
        RNG (ranks draw different prompts: each resumes its own). Collective: Lightning calls
        it on every rank when it saves."""
        if self.stream is None:
            return dict(self._pending_state or {})
        self.stream.quiesce()  # the one-step-off batch in flight finishes: the checkpoint holds it
        return {"ranks": gather_objects(self.stream.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's part of :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint was written by a different number of ranks.
        """
        if not self.is_set_up:
            self._pending_state = state_dict
            return
        self._pending_state = None
        ranks = state_dict.get("ranks")
        if not ranks:
            return
        rank, world = self._rank_world()
        if len(ranks) != world:
            raise ValueError(
                f"the checkpoint's data state is from {len(ranks)} ranks, this run has {world}: "
                "resume with the same number of ranks (the prompt shards differ otherwise)."
            )
        self._ready("resuming").load_state_dict(ranks[rank])


def _engine_session(
    dm: DAPODataModule, rank: int, cores: SharedCores | None, make_env: Callable[[], Any] | None
) -> EngineSession:
    """``dm``'s engine session on ``rank`` (``cores``: the one-step-off split, handed to its
    engine); with an environment (``make_env`` builds one), one whose engine runs episodes."""
    kwargs: dict[str, Any] = dict(
        engine_kwargs=dm.engine_kwargs,
        model_path=dm.model_name_or_path,
        tokenizer=dm.tokenizer,
        seed=dm.seed,
        rank=rank,
        own_copy=dm.dynamic_sampling.pipeline == "one_step_off",
        cores=cores,
    )
    if dm.environment is None:
        return EngineSession(dm.engine_spec, **kwargs)
    budget = dm.environment.episode_budget(dm.max_prompt_length, dm.sampling.max_tokens)
    return EpisodeSession(
        dm.engine_spec,
        environment=dm.environment,
        make_env=make_env,
        records=dm.train_records + dm.val_records,
        max_episode_tokens=budget,
        use_chat_template=dm.prompts.apply_chat_template,
        decode=lambda ids: dm.tokenizer.decode(ids, skip_special_tokens=True),
        **kwargs,
    )


def _rollout_producer(
    dm: DAPODataModule,
    session: EngineSession,
    layout: RankLayout,
    sync: Callable[[list[int]], list[int]],
) -> RolloutProducer:
    """``dm``'s dynamic-sampling producer at ``layout`` on ``session`` (``sync``: its sums over
    ranks; its ``on_rollouts_scored`` and ``on_rollouts_discarded`` hooks go through ``dm``)."""
    pad = dm.tokenizer.pad_token_id
    pad = pad if pad is not None else dm.tokenizer.eos_token_id
    return RolloutProducer(
        session,
        dm.reward_runner,
        dm.train_records,
        dm.dynamic_sampling,
        decode=lambda ids: dm.tokenizer.decode(ids, skip_special_tokens=True),
        pad_token_id=int(pad),
        sampling=dm.sampling,
        seed=dm.seed,
        layout=layout,
        sync=sync,
        hooks=RoundHooks(
            scored=lambda rollouts: call_dapo_hook(dm.trainer, "on_rollouts_scored", rollouts),
            discarded=lambda index: call_dapo_hook(dm.trainer, "on_rollouts_discarded", index),
        ),
        demonstrations=unsolved_demonstrations(session, dm.sampling.max_tokens),
    )
