"""Demonstrations played as episodes: an environment's scripted turns through the same
:class:`~dapo_lightning.envs.runner.EpisodeRunner` that runs RL episodes.

:meth:`~dapo_lightning.envs.ToolEnvironment.solution_turns` gives the assistant turns of a correct
episode on a prompt record; :class:`ReplayEngine` writes those turns instead of sampling them,
so a played demonstration has exactly an RL episode's tokens (the observation messages between
the turns) and loss mask. The supervised cold start trains on them (:mod:`dapo_lightning.sft`);
``environment.demonstrate_unsolved`` puts one into each group RL samples no right answer for.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import Tensor

from dapo_lightning.envs.base import Environment, EnvironmentConfig
from dapo_lightning.envs.runner import Episode, EpisodeRunner, ObservationFormatter
from dapo_lightning.envs.tools import ToolEnvironment
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rollout.base import Completion, RolloutEngine, SamplingConfig


class ReplayEngine(RolloutEngine):
    """A rollout engine that writes given assistant turns instead of sampling them.

    ``turns`` maps a prompt's token ids to the texts of its episode's assistant turns; the
    k-th call for a context that starts with that prompt returns turn k, tokenized, EOS
    appended, log-probabilities 0. Each prompt is played once (``n = 1``). It has no weights
    and no context limit (:attr:`max_context_tokens` None).
    """

    def __init__(self, tokenizer: Any, turns: dict[tuple[int, ...], list[str]]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.played: dict[tuple[int, ...], int] = {}

    def _prompt_of(self, context: Sequence[int]) -> tuple[int, ...]:
        for prompt in self.turns:
            if tuple(context[: len(prompt)]) == prompt:
                return prompt
        raise ValueError("ReplayEngine got a context that starts with none of its prompts.")

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Each context's next scripted turn (``n`` must be 1)."""
        if n != 1:
            raise ValueError(f"ReplayEngine plays each demonstration once (n=1), got n={n}.")
        out = []
        for context in prompts:
            prompt = self._prompt_of(context)
            k = self.played.get(prompt, 0)
            self.played[prompt] = k + 1
            script = self.turns[prompt]
            text = script[min(k, len(script) - 1)]
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(int(self.tokenizer.eos_token_id))
            out.append([Completion(ids, [0.0] * len(ids), "stop", text)])
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Consume the weights (a gather may be a collective) and keep none: the turns are
        written, not sampled."""
        collections.deque(named_tensors, maxlen=0)


def play_demonstrations(
    records: Sequence[PromptRecord],
    make_env: Callable[[], Environment],
    environment: EnvironmentConfig,
    formatter: ObservationFormatter,
    *,
    decode: Callable[[list[int]], str],
    max_tokens: int,
    max_episode_tokens: int,
) -> list[Episode | None]:
    """Each record's demonstration (``make_env().solution_turns(record)``) played as an episode;
    None where the environment writes none. Records with the same prompt share one episode.
    An episode may end unfinished (cut by ``max_tokens`` / ``max_episode_tokens``, or a failed
    environment): :func:`complete_episode` tells."""
    turns: dict[tuple[int, ...], list[str]] = {}
    for r in records:
        solution_turns = getattr(make_env(), "solution_turns", None)
        script = solution_turns(r) if callable(solution_turns) else None
        if script:
            turns.setdefault(tuple(r.prompt_ids or ()), list(script))
    if not turns:
        return [None] * len(records)
    runner = EpisodeRunner(
        ReplayEngine(formatter.tokenizer, turns), environment, make_env=make_env,
        formatter=formatter, decode=decode,
        records=[r for r in records if tuple(r.prompt_ids or ()) in turns],
        max_episode_tokens=max_episode_tokens,
    )  # fmt: skip
    prompts = list(turns)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0)
    played = dict(
        zip(prompts, (g[0] for g in runner.generate([list(p) for p in prompts], 1, sampling)))
    )
    return [played.get(tuple(r.prompt_ids or ())) for r in records]


def writes_demonstrations(env: Any) -> bool:
    """True when ``env``'s class has a ``solution_turns`` of its own (not
    :class:`~dapo_lightning.envs.tools.ToolEnvironment`'s default, which writes none)."""
    solution_turns = getattr(type(env), "solution_turns", None)
    return callable(solution_turns) and solution_turns is not ToolEnvironment.solution_turns


def complete_episode(episode: Completion | None) -> bool:
    """True for an episode that ended on its own (``"stop"``) without an environment failure."""
    return (
        isinstance(episode, Episode) and episode.finish_reason == "stop" and episode.failure is None
    )


__all__ = ["ReplayEngine", "complete_episode", "play_demonstrations", "writes_demonstrations"]
