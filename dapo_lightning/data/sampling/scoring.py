"""Sampling and scoring responses: the part of a generation round that training and validation
share (no shaping, no filter).

:class:`RolloutScorer` asks the engine for ``n`` completions per prompt, decodes them (unless
the engine gave text), scores them with the reward runner (a multi-turn episode's own reward or
failure where there is one) and returns them as :class:`~dapo_lightning.batch.ScoredRollouts`,
one group per prompt, adding the time and counts to the step's
:class:`~dapo_lightning.data.sampling.step_stats.StepStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dapo_lightning.batch import EPISODE_TEXT, PROMPT_TEXT, RESPONSE_TEXT, ScoredRollouts
from dapo_lightning.data.sampling.step_stats import StepStats, numeric_extras
from dapo_lightning.envs.runner import episode_results, episode_tool_calls, token_masks
from dapo_lightning.prompts import PromptRecord, prompt_text
from dapo_lightning.rewards.base import RewardRunner
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.rollout.session import EngineSession


class RolloutScorer:
    """Samples and scores groups of responses.

    Args:
        session: The engine session (its ``engine`` generates).
        reward_runner: Scores responses (:class:`~dapo_lightning.rewards.base.RewardRunner`).
        decode: Token ids -> response text for the reward; used when the engine gives no text.
    """

    def __init__(
        self,
        session: EngineSession,
        reward_runner: RewardRunner,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.session = session
        self.reward_runner = reward_runner
        self.decode = decode

    def score(
        self,
        records: Sequence[PromptRecord],
        sizes: Sequence[int],
        sampling: SamplingConfig,
        policy_version: int,
        stats: StepStats | None = None,
    ) -> ScoredRollouts:
        """Sample ``sizes[i]`` responses for ``records[i]`` and score them (no shaping, no filter).

        Raises:
            RuntimeError: the engine returned another number of completions than asked for.
        """
        stats = stats if stats is not None else StepStats()
        t0 = time.perf_counter()
        engine = self.session.engine
        completions: list[list[Any]] = [[] for _ in records]
        for size in sorted(set(sizes)):
            which = [i for i, s in enumerate(sizes) if s == size]
            out = engine.generate([records[i].prompt_ids for i in which], size, sampling)
            if len(out) != len(which) or any(len(c) != size for c in out):
                raise RuntimeError(
                    f"engine {type(engine).__name__} returned {[len(c) for c in out]} "
                    f"completions for {len(which)} prompts x n={size}: it must return n per prompt."
                )
            for i, c in zip(which, out):
                completions[i] = c
        stats.gen_seconds += time.perf_counter() - t0
        return self.score_completions(records, completions, sampling, policy_version, stats)

    def score_completions(
        self,
        records: Sequence[PromptRecord],
        completions: Sequence[Sequence[Any]],
        sampling: SamplingConfig,
        policy_version: int,
        stats: StepStats,
    ) -> ScoredRollouts:
        """Score ``completions[i]`` (the samples of ``records[i]``): group ``i`` of the result."""
        t1 = time.perf_counter()
        flat = [(g, rec, c) for g, (rec, cs) in enumerate(zip(records, completions)) for c in cs]
        texts = [c.text if c.text is not None else self.decode(list(c.token_ids)) for *_, c in flat]
        results = self.reward_runner.score(
            texts,
            [rec.answer for _, rec, _ in flat],
            [
                {"data_source": rec.data_source, **rec.meta.get("reward_kwargs", {})}
                for _, rec, _ in flat
            ],
        )
        # multi-turn episodes (dapo_lightning.envs): the environment's reward or failure
        results = episode_results([c for *_, c in flat], results, self.reward_runner.reward)
        t2 = time.perf_counter()
        extra_keys = set().union(*(r.extra.keys() for r in results)) if results else set()
        rollouts = ScoredRollouts(
            prompt_ids=[list(rec.prompt_ids) for _, rec, _ in flat],
            response_ids=[list(c.token_ids) for *_, c in flat],
            rollout_log_probs=[list(c.log_probs) for *_, c in flat],
            finish_reason=[c.finish_reason for *_, c in flat],
            group_index=torch.tensor([g for g, *_ in flat], dtype=torch.long),
            prompt_uid=[rec.uid for _, rec, _ in flat],
            score=torch.tensor([r.score for r in results], dtype=torch.float32),
            acc=torch.tensor([float(r.acc) for r in results], dtype=torch.float32),
            sampling=sampling,
            policy_version=policy_version,
            extra={k: [r.extra.get(k) for r in results] for k in extra_keys},
            token_mask=token_masks([c for *_, c in flat]),
            tool_calls=episode_tool_calls([c for *_, c in flat]),
        )
        rollouts.extra[RESPONSE_TEXT] = texts
        rollouts.extra[PROMPT_TEXT] = [prompt_text(rec.prompt) for _, rec, _ in flat]
        if rollouts.token_mask is not None:  # multi-turn episodes: the whole exchange as text
            rollouts.extra[EPISODE_TEXT] = [
                self.decode(list(c.token_ids)) if c.loss_mask is not None else None
                for *_, c in flat
            ]
        stats.score_seconds += t2 - t1
        stats.generated_samples += float(len(flat))
        # the policy's own tokens; a multi-turn episode's observations (tool output) apart
        sampled = float(rollouts.response_length.sum())
        stats.generated_tokens += sampled
        if rollouts.token_mask is not None:
            episode = float(sum(len(r) for r in rollouts.response_ids))
            stats.env_observation_tokens += episode - sampled
        stats.reward_failures += float(self.reward_runner.last_failures)
        stats.add_reward_extras(numeric_extras(rollouts.extra))
        return rollouts
