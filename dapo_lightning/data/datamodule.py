"""``DAPODataModule``: prompts in, on-policy ``RolloutBatch`` es out.

On-policy by construction (DESIGN.md invariant 2): Lightning prefetches one batch ahead, so the
train DataLoader yields only lightweight :class:`RolloutTicket` s; the rollouts for a step are
generated in :meth:`DAPODataModule.on_before_batch_transfer`, which Lightning runs right before
that step's ``training_step`` (after the previous step's updates). The prompt cursor advances
only there, so prefetching changes nothing. Validation works the same way with
:class:`ValidationTicket` s, returning :class:`~dapo_lightning.data.batch.ScoredRollouts` of
``val_n`` responses per held-out prompt.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset

from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.buffer import DynamicSamplingBuffer
from dapo_lightning.data.difficulty import DifficultyTracker
from dapo_lightning.data.sources import (
    FieldMap,
    PromptRecord,
    load_prompt_records,
    records_from_rows,
    split_train_val,
    tokenize_records,
)
from dapo_lightning.rewards import RewardRunner, get_reward
from dapo_lightning.rollout.base import RolloutEngine, SamplingConfig
from dapo_lightning.tasks.arithmetic import make_arithmetic_rows

log = logging.getLogger(__name__)

#: Built-in tasks (``task=...``).
TASKS = ("arithmetic",)


@dataclass(frozen=True)
class RolloutTicket:
    """Placeholder the train DataLoader yields; replaced by a RolloutBatch just before the step."""

    step: int


@dataclass(frozen=True)
class ValidationTicket:
    """Placeholder for validation chunk ``index`` (``val_batch_size`` held-out prompts)."""

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


def _as_list(files: str | Path | list[str] | None) -> list[str] | None:
    if files is None:
        return None
    if isinstance(files, (str, Path)):
        return [str(files)]
    return [str(f) for f in files]


class DAPODataModule(pl.LightningDataModule):
    """Prompts, rollout engine, reward and dynamic-sampling buffer of a DAPO run.

    Args:
        model_name_or_path: Checkpoint folder or hub id; the tokenizer is loaded from it in
            ``setup()`` (and the vLLM engine, with ``engine="vllm"``).
        train_files: Prompt files (JSONL, Parquet, a ``save_to_disk`` folder or a hub name).
        val_files: Held-out prompt files (else ``val_fraction`` of the train prompts).
        task: A built-in task instead of files: ``"arithmetic"``.
        task_kwargs: Options of the task (arithmetic: ``num_prompts``, ``level``,
            ``operand_range``, ``ops``; ``seed`` defaults to ``seed``).
        prompt_key: Field holding the prompt (string or chat messages).
        answer_key: Field holding the ground truth; dotted paths reach nested fields.
        uid_key: Field holding a stable prompt id; None hashes the prompt text.
        data_source_key: Field naming the data source (passed to the reward).
        apply_chat_template: Wrap prompts in the tokenizer's chat template (string prompts become
            one user message) with the generation prompt appended.
        dedup: Remove repeated prompts (the public DAPO-Math-17k file repeats each ~100x).
        val_fraction: Share of train prompts held out for validation when ``val_files`` is None.
        overlong_prompts: Prompts over ``max_prompt_length`` tokens: "error" or "drop" (counted).
        reward: "dapo" (paper "Answer:" rule), "math_verify", "arithmetic", or a reward object.
        reward_kwargs: Constructor options of a reward given by name.
        reward_timeout_s: Most seconds scoring one response may take (then it fails).
        reward_workers: Reward worker processes.
        max_reward_failure_frac: Largest share of a round whose scoring may fail before the run
            stops with an error.
        reward_in_process: Score in the training process without timeouts (fast, for trusted
            rewards and tests).
        engine: "hf" (samples with the policy module itself), "vllm", or an engine object.
        engine_kwargs: Constructor options of the engine.
        n: Responses per prompt, the group size G (paper 16).
        train_batch_size: Groups per rollout step over all ranks (paper 512).
        gen_batch_size: Prompts per generation round over all ranks (default train_batch_size;
            larger values waste less time in rounds when many groups are filtered).
        max_prompt_length: Most prompt tokens (after the chat template).
        max_response_length: Most response tokens (paper 20480).
        temperature: Sampling temperature of training rollouts (paper 1.0).
        top_p: Nucleus sampling mass (1.0 = off).
        top_k: Top-k sampling (-1 = off).
        filter_metric: Dynamic-sampling filter: "acc", "score", "reward" or None (no filter:
            the GRPO baseline).
        max_num_gen_batches: Most generation rounds per step before an explanatory error
            (0 = unlimited).
        carry_over: Keep surplus kept groups for the next step (one update stale) instead of
            dropping them.
        retire_after: Retire prompts all-correct in this many visits in a row (0 = never).
        park_after: Park prompts never solved after this many visits (0 = never).
        revisit_every: Epochs a parked prompt waits before it is visited again.
        adaptive_n: Difficulty-adaptive group sizes within a fixed sample budget
            (see :mod:`dapo_lightning.data.difficulty`).
        max_n: Largest adaptive group size (default 2n).
        val_n: Responses per held-out prompt (pass@val_n is logged).
        val_temperature: Sampling temperature for validation.
        val_batch_size: Held-out prompts per validation step (per rank).
        steps_per_epoch: Rollout steps per Lightning epoch; None makes one endless epoch
            (stop with ``max_steps``).
        seed: Seeds the prompt order, validation split, subsampling and the HF engine.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        train_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        task: Literal["arithmetic"] | None = None,
        task_kwargs: dict[str, Any] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "reward_model.ground_truth",
        uid_key: str | None = None,
        data_source_key: str | None = "data_source",
        apply_chat_template: bool = True,
        dedup: bool = True,
        val_fraction: float = 0.0,
        overlong_prompts: Literal["error", "drop"] = "error",
        reward: str | Any = "dapo",
        reward_kwargs: dict[str, Any] | None = None,
        reward_timeout_s: float = 10.0,
        reward_workers: int = 1,
        max_reward_failure_frac: float = 0.1,
        reward_in_process: bool = False,
        engine: str | Any = "hf",
        engine_kwargs: dict[str, Any] | None = None,
        n: int = 16,
        train_batch_size: int = 512,
        gen_batch_size: int | None = None,
        max_prompt_length: int = 2048,
        max_response_length: int = 20480,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        filter_metric: Literal["acc", "score", "reward"] | None = "acc",
        max_num_gen_batches: int = 10,
        carry_over: bool = False,
        retire_after: int = 0,
        park_after: int = 0,
        revisit_every: int = 1,
        adaptive_n: bool = False,
        max_n: int | None = None,
        val_n: int = 1,
        val_temperature: float = 1.0,
        val_batch_size: int = 32,
        steps_per_epoch: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if (train_files is None) == (task is None):
            raise ValueError(
                "DAPODataModule needs exactly one of train_files (prompt files) or task "
                f"(a built-in task: {list(TASKS)})."
            )
        if task is not None and task not in TASKS:
            raise ValueError(f"task={task!r} is unknown: use one of {list(TASKS)}.")
        if isinstance(engine, str) and engine not in ("hf", "vllm"):
            raise ValueError(f"engine={engine!r}: use 'hf', 'vllm' or an engine object.")
        if engine == "vllm" and model_name_or_path is None:
            raise ValueError("engine='vllm' needs model_name_or_path (the checkpoint vLLM loads).")
        if engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:  # fail now, not after set-up
                from dapo_lightning.rollout.vllm import _INSTALL_HINT

                raise ImportError(f"data.engine='vllm' but vllm is not installed. {_INSTALL_HINT}")
        if val_n < 1 or val_batch_size < 1:
            raise ValueError("val_n and val_batch_size must be >= 1.")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1 or None, got {steps_per_epoch}.")
        self.save_hyperparameters(ignore=["reward", "engine"])
        self.model_name_or_path = model_name_or_path
        self.train_files = _as_list(train_files)
        self.val_files = _as_list(val_files)
        self.task = task
        self.task_kwargs = dict(task_kwargs or {})
        self.fields = FieldMap(prompt_key, answer_key, uid_key, data_source_key)
        if task is not None:
            self.fields = FieldMap("prompt", "answer", "uid", None)
        self.apply_chat_template = apply_chat_template
        self.dedup = dedup
        self.val_fraction = val_fraction
        self.overlong_prompts = overlong_prompts
        self.reward = reward
        self.reward_kwargs = dict(reward_kwargs or {})
        self.reward_timeout_s = reward_timeout_s
        self.reward_workers = reward_workers
        self.max_reward_failure_frac = max_reward_failure_frac
        self.reward_in_process = reward_in_process
        self.engine_kind = engine if isinstance(engine, str) else None
        self.engine_kwargs = dict(engine_kwargs or {})
        self.n = n
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.filter_metric = filter_metric
        self.max_num_gen_batches = max_num_gen_batches
        self.carry_over = carry_over
        self.retire_after = retire_after
        self.park_after = park_after
        self.revisit_every = revisit_every
        self.adaptive_n = adaptive_n
        self.max_n = max_n
        self.val_n = val_n
        self.val_batch_size = val_batch_size
        self.steps_per_epoch = steps_per_epoch
        self.seed = seed
        #: Sampling settings of training rollouts.
        self.sampling = SamplingConfig(max_response_length, temperature, top_p, top_k)
        #: Sampling settings of validation.
        self.val_sampling = SamplingConfig(max_response_length, val_temperature, top_p, top_k)
        #: The rollout engine (built at the first generation when given by name).
        self.engine: RolloutEngine | None = None if isinstance(engine, str) else engine
        self.tokenizer: Any = None
        self.train_records: list[PromptRecord] = []
        self.val_records: list[PromptRecord] = []
        self.buffer: DynamicSamplingBuffer | None = None
        self.reward_runner: RewardRunner | None = None
        self.dropped_prompts = 0
        #: uids drawn at each training step (this rank), for logging and tests.
        self.drawn_log: list[list[str]] = []
        self._engine_version = 0
        self._pending_state: dict[str, Any] | None = None

    # ----------------------------------------------------------------- set-up
    def _rank_world(self) -> tuple[int, int]:
        trainer = self._trainer if hasattr(self, "_trainer") else None
        trainer = trainer or getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _load_records(self) -> tuple[list[PromptRecord], list[PromptRecord]]:
        if self.task == "arithmetic":
            kw = {"seed": self.seed, **self.task_kwargs}
            records = records_from_rows(make_arithmetic_rows(**kw), self.fields, name="arithmetic")
        else:
            records = load_prompt_records(self.train_files, self.fields, dedup=self.dedup)
        if self.val_files is not None:
            val = load_prompt_records(self.val_files, self.fields, dedup=self.dedup)
            return records, val
        if self.val_fraction > 0:
            return split_train_val(records, self.val_fraction, self.seed)
        return records, []

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and prompts, build the reward runner and the buffer (once)."""
        if self.buffer is not None:
            return
        if self.tokenizer is None:
            if self.model_name_or_path is None:
                raise ValueError("DAPODataModule needs model_name_or_path to load the tokenizer.")
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_name_or_path)
            except OSError as err:
                raise FileNotFoundError(
                    f"data.model_name_or_path={self.model_name_or_path!r}: no tokenizer could be "
                    f"loaded ({err}). Fix: give an existing folder written by save_pretrained or "
                    "a hub id (with network access)."
                ) from err
        train, val = self._load_records()
        tok_kw = dict(
            apply_chat_template=self.apply_chat_template,
            max_prompt_length=self.max_prompt_length,
            overlong_prompts=self.overlong_prompts,
        )
        self.train_records, dropped = tokenize_records(train, self.tokenizer, **tok_kw)
        self.dropped_prompts = dropped
        if val:
            self.val_records, dropped_val = tokenize_records(val, self.tokenizer, **tok_kw)
            self.dropped_prompts += dropped_val
        rank, world = self._rank_world()
        self.reward_runner = RewardRunner(
            get_reward(self.reward, **self.reward_kwargs),
            timeout_s=self.reward_timeout_s,
            num_workers=self.reward_workers,
            max_failure_frac=self.max_reward_failure_frac,
            in_process=self.reward_in_process,
        )
        tracker = None
        if self.retire_after or self.park_after or self.adaptive_n:
            tracker = DifficultyTracker(self.retire_after, self.park_after, self.revisit_every)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else self.tokenizer.eos_token_id
        self.buffer = DynamicSamplingBuffer(
            self.engine,  # type: ignore[arg-type]  # set at the first generation when None
            self.reward_runner,
            self.train_records,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            pad_token_id=int(pad),
            sampling=self.sampling,
            n=self.n,
            train_batch_size=self.train_batch_size,
            gen_batch_size=self.gen_batch_size,
            filter_metric=self.filter_metric,
            max_num_gen_batches=self.max_num_gen_batches,
            carry_over=self.carry_over,
            tracker=tracker,
            adaptive_n=self.adaptive_n,
            max_n=self.max_n,
            seed=self.seed,
            rank=rank,
            world_size=world,
        )
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None

    def teardown(self, stage: str | None = None) -> None:
        if self.reward_runner is not None:
            self.reward_runner.close()

    # ------------------------------------------------------------ dataloaders
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Tickets(RolloutTicket, self.steps_per_epoch), batch_size=None)

    def _val_shard(self) -> list[PromptRecord]:
        rank, world = self._rank_world()
        if not self.val_records:
            return []
        per_rank = math.ceil(len(self.val_records) / world)
        # Wrap around so every rank has the same number of chunks (a few prompts count twice).
        padded = [self.val_records[i % len(self.val_records)] for i in range(per_rank * world)]
        return padded[rank::world]

    def val_dataloader(self) -> DataLoader | list:
        shard = self._val_shard()
        if not shard:
            return []
        chunks = math.ceil(len(shard) / self.val_batch_size)
        return DataLoader(_Tickets(ValidationTicket, chunks), batch_size=None)

    # --------------------------------------------------------------- rollouts
    def _module(self) -> Any:
        module = self.trainer.lightning_module
        if getattr(module, "policy", None) is None and self.engine is None:
            raise RuntimeError(
                "the LightningModule has no `policy` for the 'hf' engine to sample with: build "
                "the policy in __init__ or configure_model, or pass an engine object."
            )
        return module

    def ensure_engine(self, module: Any) -> RolloutEngine:
        """Build the engine on first use (the HF engine shares ``module.policy``)."""
        if self.engine is None:
            from dapo_lightning.rollout import create_engine

            rank, _ = self._rank_world()
            if self.engine_kind == "hf":
                self.engine = create_engine(
                    "hf",
                    model=module.policy,
                    tokenizer=self.tokenizer,
                    seed=self.seed + rank,
                    **self.engine_kwargs,
                )
            else:
                self.engine = create_engine(
                    "vllm", model_path=self.model_name_or_path, seed=self.seed, **self.engine_kwargs
                )
            self._engine_version = 0
            if self._pending_engine_state is not None and hasattr(self.engine, "load_state_dict"):
                self.engine.load_state_dict(self._pending_engine_state)
            self._pending_engine_state = None
        if self.buffer is not None:
            self.buffer.engine = self.engine
        return self.engine

    _pending_engine_state: dict[str, Any] | None = None

    def push_weights(self, module: Any) -> None:
        """Send the policy's weights to the engine if it is older than ``module.policy_version``."""
        version = int(getattr(module, "policy_version", 0))
        if self._engine_version < version and getattr(module, "policy", None) is not None:
            self.engine.load_weights(module.policy.state_dict().items())
            self._engine_version = version

    def next_rollout_batch(self) -> RolloutBatch:
        """Generate, score, shape and filter the rollouts of the current step."""
        if self.buffer is None:
            raise RuntimeError("call setup() before generating rollouts.")
        module = self._module()
        self.ensure_engine(module)
        with self._engine_awake():
            batch = self.buffer.next_batch(
                int(getattr(module, "policy_version", 0)),
                callbacks=list(self.trainer.callbacks),
                trainer=self.trainer,
                pl_module=module,
                before_round=lambda: self.push_weights(module),
            )
        batch.stats["dropped_prompts"] = float(self.dropped_prompts)
        self.drawn_log.append(list(self.buffer.drawn_uids))
        return batch

    def validation_rollouts(self, index: int) -> ScoredRollouts:
        """``val_n`` scored responses for each prompt of validation chunk ``index``."""
        if self.buffer is None:
            raise RuntimeError("call setup() before validating.")
        module = self._module()
        self.ensure_engine(module)
        shard = self._val_shard()
        chunk = shard[index * self.val_batch_size : (index + 1) * self.val_batch_size]
        with self._engine_awake():
            self.push_weights(module)
            return self.buffer.generate_scored(
                chunk,
                [self.val_n] * len(chunk),
                self.val_sampling,
                int(getattr(module, "policy_version", 0)),
            )

    @contextlib.contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """With a sleep-mode vLLM engine: wake it for generation, put it back to sleep after,
        so the update runs with the engine's GPU memory (weights, KV cache) released."""
        sleeps = bool(getattr(self.engine, "sleep_mode", False))
        if sleeps:
            self.engine.wake_up()
        try:
            yield
        finally:
            if sleeps:
                self.engine.sleep()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn a ticket into its rollouts, right before the step that consumes them."""
        if isinstance(batch, RolloutTicket):
            return self.next_rollout_batch()
        if isinstance(batch, ValidationTicket):
            return self.validation_rollouts(batch.index)
        return batch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Prompt cursor, epoch, RNG, per-prompt statistics, carried groups, engine RNG."""
        if self.buffer is None:
            return dict(self._pending_state or {})
        state: dict[str, Any] = {"buffer": self.buffer.state_dict()}
        if self.engine is not None and hasattr(self.engine, "state_dict"):
            state["engine"] = self.engine.state_dict()
        return state

    def _apply_state(self, state: dict[str, Any]) -> None:
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])
        if "engine" in state:
            if self.engine is not None and hasattr(self.engine, "load_state_dict"):
                self.engine.load_state_dict(state["engine"])
            else:
                self._pending_engine_state = state["engine"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.buffer is None:
            self._pending_state = state_dict
        else:
            self._apply_state(state_dict)
