"""The dynamic-sampling buffer (DAPO, paper Sec. 3.2): generate, score, shape, filter, repeat.

One call of :meth:`DynamicSamplingBuffer.next_batch` runs *generation rounds*: each draws
``gen_batch_size / world_size`` prompts for this rank, samples ``n`` responses per prompt, scores
them, lets ``on_rollouts_scored`` callbacks shape rewards (overlong punishment), then keeps only
groups whose *filter metric* varies within the group (a group where every response is equally
right or wrong has zero advantage and only dilutes the batch). Rounds repeat until
``train_batch_size / world_size`` groups are kept.

Ranks stay in lockstep: after every round all ranks all-reduce (not full, failed) flags; a full
rank generates nothing but keeps joining the all-reduce until every rank is full, so no
collective can hang. An exception on one rank is raised on every rank after the same round.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from dapo_lightning.data.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.data.difficulty import DifficultyTracker, subsample_keep_variance
from dapo_lightning.data.sampler import PromptSampler
from dapo_lightning.data.sources import PromptRecord
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import RolloutEngine, SamplingConfig

FilterMetric = Literal["acc", "score", "reward"] | None

#: Keys every batch's ``stats`` has.
STAT_KEYS = (
    "generated_groups",
    "kept_groups",
    "zero_variance_frac",
    "gen_rounds",
    "gen_seconds",
    "score_seconds",
    "generated_tokens",
    "retired",
    "parked",
    "reward_failures",
    "stale_groups",
)


class DynamicSamplingError(RuntimeError):
    """Generation rounds ran out (``max_num_gen_batches``) before the batch was full."""


def concat_rollouts(parts: Sequence[ScoredRollouts]) -> ScoredRollouts:
    """Concatenate rollouts; group ids are renumbered so groups stay distinct and contiguous."""
    if not parts:
        raise ValueError("nothing to concatenate.")
    group_index, offset = [], 0
    for p in parts:
        if len(p):
            group_index.append(p.group_index + offset)
            offset += int(p.group_index.max()) + 1
    keys = set().union(*(p.extra.keys() for p in parts))
    return ScoredRollouts(
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        response_ids=[x for p in parts for x in p.response_ids],
        rollout_log_probs=[x for p in parts for x in p.rollout_log_probs],
        finish_reason=[x for p in parts for x in p.finish_reason],
        group_index=torch.cat(group_index) if group_index else torch.zeros(0, dtype=torch.long),
        prompt_uid=[x for p in parts for x in p.prompt_uid],
        score=torch.cat([p.score for p in parts]),
        acc=torch.cat([p.acc for p in parts]),
        max_response_length=max(p.max_response_length for p in parts),
        policy_version=max(p.policy_version for p in parts),
        reward=torch.cat([p.reward for p in parts]),
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        extra={k: [x for p in parts for x in p.extra.get(k, [None] * len(p))] for k in keys},
    )


def group_has_variance(values: Tensor, group_index: Tensor) -> Tensor:
    """``[G]`` bool: True where the group's values are not all equal (std > 0 <=> max > min)."""
    num_groups = int(group_index.max()) + 1 if len(group_index) else 0
    v = values.float()
    hi = torch.full((num_groups,), -torch.inf).scatter_reduce(0, group_index, v, "amax")
    lo = torch.full((num_groups,), torch.inf).scatter_reduce(0, group_index, v, "amin")
    return hi > lo


def _rollouts_to_state(r: ScoredRollouts) -> dict[str, Any]:
    return {
        "prompt_ids": r.prompt_ids,
        "response_ids": r.response_ids,
        "rollout_log_probs": r.rollout_log_probs,
        "finish_reason": r.finish_reason,
        "group_index": r.group_index.tolist(),
        "prompt_uid": r.prompt_uid,
        "score": r.score.tolist(),
        "acc": r.acc.tolist(),
        "reward": r.reward.tolist(),
        "loss_mask": r.loss_mask.tolist(),
        "max_response_length": r.max_response_length,
        "policy_version": r.policy_version,
        "extra": r.extra,
    }


def _rollouts_from_state(s: dict[str, Any]) -> ScoredRollouts:
    return ScoredRollouts(
        prompt_ids=s["prompt_ids"],
        response_ids=s["response_ids"],
        rollout_log_probs=s["rollout_log_probs"],
        finish_reason=s["finish_reason"],
        group_index=torch.tensor(s["group_index"], dtype=torch.long),
        prompt_uid=s["prompt_uid"],
        score=torch.tensor(s["score"], dtype=torch.float32),
        acc=torch.tensor(s["acc"], dtype=torch.float32),
        reward=torch.tensor(s["reward"], dtype=torch.float32),
        loss_mask=torch.tensor(s["loss_mask"], dtype=torch.bool),
        max_response_length=s["max_response_length"],
        policy_version=s["policy_version"],
        extra=s["extra"],
    )


def all_reduce_flags(flags: list[int]) -> list[int]:
    """Sum integer flags over all ranks (identity without an initialised process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(flags)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(flags, dtype=torch.long, device=device)
    dist.all_reduce(t)
    return t.tolist()


class DynamicSamplingBuffer:
    """Produces on-policy :class:`RolloutBatch` es of exactly ``train_batch_size`` groups of ``n``.

    Works without Lightning: callbacks, trainer and module are passed to :meth:`next_batch`.

    Args:
        engine: The generation backend (:class:`~dapo_lightning.rollout.base.RolloutEngine`).
        reward_runner: Scores responses (:class:`~dapo_lightning.rewards.base.RewardRunner`).
        records: Training prompts, tokenized (``prompt_ids`` set).
        decode: Token ids -> response text for the reward (e.g. ``tokenizer.decode`` without
            special tokens); used when the engine's ``Completion.text`` is None.
        pad_token_id: Padding id of the batch tensors.
        sampling: Sampling settings of training rollouts.
        n: Responses per prompt (group size; paper 16). >= 2 when filtering.
        train_batch_size: Groups per batch over all ranks (paper 512); divisible by world_size.
        gen_batch_size: Prompts per generation round over all ranks (default train_batch_size);
            divisible by world_size.
        filter_metric: Per-response value whose within-group std must be > 0 for a group to be
            kept: "acc" (default; shaping never decides the filter), "score" (raw reward),
            "reward" (shaped reward), or None (keep everything: the GRPO baseline).
        max_num_gen_batches: Most generation rounds per batch before
            :class:`DynamicSamplingError`; 0 means unlimited.
        carry_over: False (verl's behaviour): kept groups beyond the batch are dropped. True:
            they open the next batch, one update stale (their ``sample_version`` says so).
        tracker: Per-prompt statistics with retire / park rules (None: no statistics).
        adaptive_n: Difficulty-adaptive group sizes (needs ``tracker``; see
            :mod:`dapo_lightning.data.difficulty`).
        max_n: Largest adaptive group size (default ``2 * n``).
        seed: Seeds the prompt order and the adaptive subsampling.
        rank: This rank.
        world_size: Number of ranks.
        sync: Sums integer flags over ranks (default: ``torch.distributed`` all-reduce when
            initialised).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        reward_runner: RewardRunner,
        records: Sequence[PromptRecord],
        *,
        decode: Callable[[list[int]], str],
        pad_token_id: int,
        sampling: SamplingConfig,
        n: int = 16,
        train_batch_size: int = 512,
        gen_batch_size: int | None = None,
        filter_metric: FilterMetric = "acc",
        max_num_gen_batches: int = 10,
        carry_over: bool = False,
        tracker: DifficultyTracker | None = None,
        adaptive_n: bool = False,
        max_n: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        sync: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        gen_batch_size = gen_batch_size or train_batch_size
        if n < 1:
            raise ValueError(f"n (responses per prompt) must be >= 1, got {n}.")
        if filter_metric not in ("acc", "score", "reward", None):
            raise ValueError(
                f"filter_metric must be 'acc', 'score', 'reward' or None, got {filter_metric!r}."
            )
        if filter_metric is not None and n < 2:
            raise ValueError(
                f"n={n} with filter_metric={filter_metric!r}: a group of one response never has "
                "variance; use n >= 2 or filter_metric=None."
            )
        for name, value in (
            ("train_batch_size", train_batch_size),
            ("gen_batch_size", gen_batch_size),
        ):
            if value < world_size or value % world_size:
                raise ValueError(
                    f"{name}={value} is global (over all ranks) and must be a positive multiple "
                    f"of world_size={world_size}: use e.g. {max(1, value // world_size) * world_size}."
                )
        if max_num_gen_batches < 0:
            raise ValueError(
                f"max_num_gen_batches must be >= 0 (0 = unlimited), got {max_num_gen_batches}."
            )
        if adaptive_n and tracker is None:
            raise ValueError("adaptive_n needs a DifficultyTracker (pass tracker=...).")
        max_n = max_n if max_n is not None else 2 * n
        if adaptive_n and max_n < n:
            raise ValueError(f"max_n={max_n} must be >= n={n}.")
        missing = [r.uid for r in records if r.prompt_ids is None]
        if missing:
            raise ValueError(f"{len(missing)} prompts are not tokenized (e.g. uid {missing[0]}).")
        self.engine = engine
        self.reward_runner = reward_runner
        self.records = list(records)
        self.decode = decode
        self.pad_token_id = pad_token_id
        self.sampling = sampling
        self.n = n
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.local_train = train_batch_size // world_size
        self.local_gen = gen_batch_size // world_size
        self.filter_metric = filter_metric
        self.max_num_gen_batches = max_num_gen_batches
        self.carry_over = carry_over
        self.tracker = tracker
        self.adaptive_n = adaptive_n
        self.max_n = max_n
        self.rank = rank
        self.world_size = world_size
        self.sync = sync or all_reduce_flags
        self.sampler = PromptSampler(len(self.records), seed=seed, rank=rank, world_size=world_size)
        self.rng = random.Random(f"{seed}-{rank}-subsample")
        self.carried: list[tuple[ScoredRollouts, list[int]]] = []
        self.drawn_uids: list[str] = []  # uids drawn by the last next_batch (for tests / logging)

    # ------------------------------------------------------------------ rounds
    def _draw(self) -> tuple[list[PromptRecord], list[int]]:
        eligible = None
        if self.tracker is not None:
            tracker = self.tracker

            def eligible(i: int, epoch: int) -> bool:
                return tracker.eligible(self.records[i].uid, epoch)

        if not self.adaptive_n:
            idx = self.sampler.take(self.local_gen, eligible)
            recs = [self.records[i] for i in idx]
            return recs, [self.n] * len(recs)
        budget = self.local_gen * self.n
        recs, sizes = [], []
        while budget >= self.n:
            rec = self.records[self.sampler.take(1, eligible)[0]]
            size = min(self.tracker.group_size(rec.uid, self.n, self.max_n), budget)
            recs.append(rec)
            sizes.append(size)
            budget -= size
        return recs, sizes

    def generate_scored(
        self,
        records: Sequence[PromptRecord],
        sizes: Sequence[int],
        sampling: SamplingConfig,
        policy_version: int,
        stats: dict[str, float] | None = None,
    ) -> ScoredRollouts:
        """Sample ``sizes[i]`` responses for ``records[i]`` and score them (no shaping, no filter)."""
        stats = stats if stats is not None else {}
        t0 = time.perf_counter()
        completions: list[list[Any]] = [[] for _ in records]
        for size in sorted(set(sizes)):
            which = [i for i, s in enumerate(sizes) if s == size]
            out = self.engine.generate([records[i].prompt_ids for i in which], size, sampling)
            if len(out) != len(which) or any(len(c) != size for c in out):
                raise RuntimeError(
                    f"engine {type(self.engine).__name__} returned {[len(c) for c in out]} "
                    f"completions for {len(which)} prompts x n={size}: it must return n per prompt."
                )
            for i, c in zip(which, out):
                completions[i] = c
        t1 = time.perf_counter()
        prompt_ids, response_ids, logps, finish, gidx, uids = [], [], [], [], [], []
        texts, truths, kwargs = [], [], []
        for g, (rec, comps) in enumerate(zip(records, completions)):
            for c in comps:
                prompt_ids.append(list(rec.prompt_ids))
                response_ids.append(list(c.token_ids))
                logps.append(list(c.log_probs))
                finish.append(c.finish_reason)
                gidx.append(g)
                uids.append(rec.uid)
                texts.append(c.text if c.text is not None else self.decode(list(c.token_ids)))
                truths.append(rec.answer)
                kwargs.append({"data_source": rec.data_source})
        results = self.reward_runner.score(texts, truths, kwargs)
        t2 = time.perf_counter()
        extra_keys = set().union(*(r.extra.keys() for r in results)) if results else set()
        rollouts = ScoredRollouts(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            rollout_log_probs=logps,
            finish_reason=finish,
            group_index=torch.tensor(gidx, dtype=torch.long),
            prompt_uid=uids,
            score=torch.tensor([r.score for r in results], dtype=torch.float32),
            acc=torch.tensor([float(r.acc) for r in results], dtype=torch.float32),
            max_response_length=sampling.max_tokens,
            policy_version=policy_version,
            extra={k: [r.extra.get(k) for r in results] for k in extra_keys},
        )
        stats["gen_seconds"] = stats.get("gen_seconds", 0.0) + (t1 - t0)
        stats["score_seconds"] = stats.get("score_seconds", 0.0) + (t2 - t1)
        stats["generated_tokens"] = stats.get("generated_tokens", 0.0) + float(
            sum(len(r) for r in response_ids)
        )
        stats["reward_failures"] = stats.get("reward_failures", 0.0) + float(
            self.reward_runner.last_failures
        )
        return rollouts

    def _round(
        self,
        policy_version: int,
        callbacks: Sequence[Any],
        trainer: Any,
        pl_module: Any,
        stats: dict[str, float],
    ) -> ScoredRollouts | None:
        records, sizes = self._draw()
        self.drawn_uids.extend(r.uid for r in records)
        rollouts = self.generate_scored(records, sizes, self.sampling, policy_version, stats)
        if self.tracker is not None:
            for g, rec in enumerate(records):
                self.tracker.update(
                    rec.uid, rollouts.acc[rollouts.group_index == g].tolist(), self.sampler.epoch
                )
        if any(s != self.n for s in sizes):
            keep: list[int] = []
            for g in range(len(records)):
                members = (rollouts.group_index == g).nonzero().flatten().tolist()
                sub = subsample_keep_variance(rollouts.acc[members].tolist(), self.n, self.rng)
                keep.extend(members[j] for j in sub)
            rollouts = rollouts.select(keep)
        for cb in callbacks:
            hook = getattr(cb, "on_rollouts_scored", None)
            if callable(hook):
                hook(trainer, pl_module, rollouts)
        stats["generated_groups"] += len(records)
        if self.filter_metric is None:
            return rollouts
        values = getattr(rollouts, self.filter_metric)
        keep_group = group_has_variance(values, rollouts.group_index)
        stats["kept_groups_filter"] += float(keep_group.sum())
        keep_idx = keep_group[rollouts.group_index].nonzero().flatten().tolist()
        return rollouts.select(keep_idx) if keep_idx else None

    # ------------------------------------------------------------------- batch
    def next_batch(
        self,
        policy_version: int = 0,
        *,
        callbacks: Sequence[Any] = (),
        trainer: Any = None,
        pl_module: Any = None,
        before_round: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """Run generation rounds until this rank holds ``train_batch_size / world_size`` groups.

        Args:
            policy_version: Optimizer updates done so far (stamped on the new responses).
            callbacks: Objects whose ``on_rollouts_scored(trainer, pl_module, rollouts)`` is called
                on every round's scored rollouts before the filter.
            trainer: Passed to the callbacks.
            pl_module: Passed to the callbacks.
            before_round: Called before each round that generates (e.g. a weight push).
        """
        stats = {k: 0.0 for k in STAT_KEYS}
        stats["kept_groups_filter"] = 0.0
        kept: list[tuple[ScoredRollouts, list[int]]] = list(self.carried)
        self.carried = []
        self.drawn_uids = []
        have = sum(int(r.group_index.max()) + 1 for r, _ in kept)
        rounds = 0
        while True:
            error: BaseException | None = None
            if have < self.local_train:
                try:
                    if before_round is not None:
                        before_round()
                    got = self._round(policy_version, callbacks, trainer, pl_module, stats)
                    stats["gen_rounds"] += 1
                    if got is not None and len(got):
                        kept.append((got, [policy_version] * len(got)))
                        have += int(got.group_index.max()) + 1
                except Exception as e:  # noqa: BLE001 - re-raised after the collective below
                    error = e
            rounds += 1
            not_full, failed = self.sync([int(have < self.local_train), int(error is not None)])
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(
                    "another rank failed during a generation round (its own error is in its log)."
                )
            if not not_full:
                break
            if self.max_num_gen_batches and rounds >= self.max_num_gen_batches:
                gen = stats["generated_groups"]
                frac = 1 - stats["kept_groups_filter"] / gen if gen else 0.0
                raise DynamicSamplingError(
                    f"dynamic sampling gave up after max_num_gen_batches={self.max_num_gen_batches} "
                    f"generation rounds: this rank kept {have} of the {self.local_train} groups "
                    f"a batch needs ({not_full} of {self.world_size} ranks short). Of {int(gen)} "
                    f"groups generated here, {frac:.0%} were filtered out for zero variance of "
                    f"{self.filter_metric!r} (every response equally right or wrong). Raise n, "
                    "lower the task difficulty, add prompts, raise max_num_gen_batches "
                    "(0 = unlimited), or set filter_metric=None to disable dynamic sampling."
                )
        return self._assemble(kept, policy_version, stats)

    def _assemble(
        self,
        kept: list[tuple[ScoredRollouts, list[int]]],
        policy_version: int,
        stats: dict[str, float],
    ) -> RolloutBatch:
        allr = concat_rollouts([r for r, _ in kept])
        versions = [v for _, vs in kept for v in vs]
        end = int((allr.group_index < self.local_train).sum())
        if end < len(allr) and self.carry_over:
            rest = list(range(end, len(allr)))
            self.carried = [(allr.select(rest), versions[end:])]
        batch_r = allr.select(list(range(end)))
        sample_version = torch.tensor(versions[:end], dtype=torch.long)
        gen = stats["generated_groups"]
        kept_by_filter = stats.pop("kept_groups_filter")
        kept_filter = kept_by_filter if self.filter_metric else gen
        stats["kept_groups"] = float(kept_filter)
        stats["zero_variance_frac"] = 1.0 - kept_filter / gen if gen else 0.0
        stats["kept_frac"] = kept_filter / gen if gen else 1.0
        stats["carried_groups"] = float(
            int(self.carried[0][0].group_index.max()) + 1 if self.carried else 0
        )
        stats["stale_groups"] = float((sample_version[:: self.n] < policy_version).sum())
        if self.tracker is not None:
            stats["retired"] = float(self.tracker.num_retired)
            stats["parked"] = float(self.tracker.num_parked)
        stats["epoch"] = float(self.sampler.epoch)
        return RolloutBatch.from_rollouts(
            batch_r,
            group_size=self.n,
            pad_token_id=self.pad_token_id,
            sample_version=sample_version,
            stats=stats,
        )

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Prompt cursor and epoch, subsampling RNG, per-prompt statistics, carried groups."""
        return {
            "sampler": self.sampler.state_dict(),
            "rng": self.rng.getstate(),
            "tracker": self.tracker.state_dict() if self.tracker is not None else None,
            "carried": [(_rollouts_to_state(r), v) for r, v in self.carried],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        if self.tracker is not None and state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])
        self.carried = [(_rollouts_from_state(r), list(v)) for r, v in state["carried"]]
