"""The data module's side of episodes: an engine session whose engine runs them, and the
environment's instructions in front of the prompts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from dapo_lightning.checks import ConfigError
from dapo_lightning.envs.base import Environment, EnvironmentConfig, declared_metrics
from dapo_lightning.envs.replay import (
    complete_episode,
    play_demonstrations,
    writes_demonstrations,
)
from dapo_lightning.envs.runner import Episode, EpisodeRunner, ObservationFormatter
from dapo_lightning.envs.stats import env_stats
from dapo_lightning.envs.tools import template_renders_tools
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rollout.base import RolloutEngine
from dapo_lightning.rollout.session import EngineSession


class EpisodeSession(EngineSession):
    """An :class:`~dapo_lightning.rollout.session.EngineSession` whose engine is an
    :class:`~dapo_lightning.envs.runner.EpisodeRunner` around the engine it builds (or is
    given): weights, sleep mode and RNG state go to the wrapped engine as before.

    Args:
        engine: As for :class:`EngineSession`.
        environment: The environment settings.
        make_env: Builds one episode's environment.
        records: Every prompt record the engine may be asked about (train and validation).
        max_episode_tokens: Resolved ``environment.max_episode_tokens``.
        use_chat_template: Render observations with the tokenizer's chat template.
        decode: Token ids -> text for the environment.
        **session_kwargs: :class:`EngineSession`'s keyword arguments (``tokenizer`` required).
    """

    def __init__(
        self,
        engine: str | RolloutEngine,
        *,
        environment: EnvironmentConfig,
        make_env: Callable[[], Environment],
        records: Sequence[PromptRecord],
        max_episode_tokens: int,
        use_chat_template: bool,
        decode: Callable[[list[int]], str],
        **session_kwargs: Any,
    ) -> None:
        if environment.demonstrate_unsolved and not writes_demonstrations(make_env()):
            raise ConfigError(
                f"data.init_args.environment.demonstrate_unsolved: environment "
                f"{environment.name!r} writes no demonstrations: give its class a "
                "solution_turns(record) method (ToolEnvironment.solution_turns), or set it to false."
            )
        super().__init__(engine, **session_kwargs)
        self.environment = environment
        self.make_env = make_env
        self.records = list(records)
        self.max_episode_tokens = max_episode_tokens
        self.decode = decode
        self.formatter = ObservationFormatter(
            self.tokenizer, environment.observation_role, use_chat_template
        )
        if self._engine is not None:
            self._engine = self._wrap(self._engine)

    def _wrap(self, engine: RolloutEngine) -> EpisodeRunner:
        return EpisodeRunner(
            engine,
            self.environment,
            make_env=self.make_env,
            formatter=self.formatter,
            decode=self.decode,
            records=self.records,
            max_episode_tokens=self.max_episode_tokens,
        )

    def _build(self) -> RolloutEngine:
        return self._wrap(super()._build())

    def demonstrations(
        self, records: Sequence[PromptRecord], max_tokens: int
    ) -> list[Episode | None]:
        """The environment's demonstration of each record played as an episode
        (:func:`~dapo_lightning.envs.replay.play_demonstrations`); None where there is none
        or it does not finish."""
        episodes = play_demonstrations(
            records, self.make_env, self.environment, self.formatter, decode=self.decode,
            max_tokens=max_tokens, max_episode_tokens=self.max_episode_tokens,
        )  # fmt: skip
        return [e if complete_episode(e) else None for e in episodes]

    def take_stats(self) -> dict[str, float]:
        """The runner's ``env/*`` metrics since the last call (zeros before it is built)."""
        engine = self._engine
        if isinstance(engine, EpisodeRunner):
            return engine.take_stats()
        return env_stats(None, declared_metrics(self.make_env()))


def prompt_tools(
    env: Any, tokenizer: Any, use_chat_template: bool
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """How prompts tell the policy about ``env``'s tools: ``(instructions, tools)``.

    ``(None, schemas)`` when the chat template renders tools in the tag format
    (:func:`~dapo_lightning.envs.tools.template_renders_tools`) and the environment has tool
    schemas; else ``(env.instructions(), None)`` (None when it has no ``instructions``)."""
    schemas = env.tool_schemas() if callable(getattr(env, "tool_schemas", None)) else []
    if schemas and use_chat_template and template_renders_tools(tokenizer):
        return None, schemas
    instructions = getattr(env, "instructions", None)
    return (instructions() if callable(instructions) else None), None


def introduce_tools(
    records: Sequence[PromptRecord],
    env: Any,
    tokenizer: Any,
    use_chat_template: bool,
    observation_role: str = "tool",
) -> list[dict[str, Any]] | None:
    """Tell the prompts about ``env``'s tools (:func:`prompt_tools`): put its instructions in
    front of every record's prompt, in place, or return the schemas the chat template renders
    (``tools=`` of :func:`~dapo_lightning.prompts.encode_prompt`); then its worked example,
    if it has one (``prompt_example()``; its ``"tool"`` messages take ``observation_role``)."""
    example = getattr(env, "prompt_example", None)
    messages = example() if callable(example) else None
    if messages:
        messages = [{**m, "role": observation_role} if m["role"] == "tool" else m for m in messages]
    with_demonstration(records, messages)  # first: the instructions go in front of it
    text, tools = prompt_tools(env, tokenizer, use_chat_template)
    with_instructions(records, text, use_chat_template)
    return tools


def with_demonstration(
    records: Sequence[PromptRecord], messages: Sequence[dict[str, str]] | None
) -> None:
    """Put the chat turns ``messages`` (a worked example) in every record's prompt, in place,
    after its system message and before its first other message; prompts of plain text get
    the turns as ``role: content`` lines in front."""
    if not messages:
        return
    for r in records:
        prompt = r.prompt
        if isinstance(prompt, str):
            lines = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            r.prompt = f"{lines}\n\n{prompt}"
            continue
        head = 1 if prompt and prompt[0].get("role") == "system" else 0
        r.prompt = [*prompt[:head], *(dict(m) for m in messages), *prompt[head:]]


def with_instructions(
    records: Sequence[PromptRecord], instructions: str | None, use_chat_template: bool
) -> None:
    """Put ``instructions`` in front of every record's prompt, in place: a system message
    (merged into a system message the prompt has) with a chat template, else a text prefix."""
    if not instructions:
        return
    for r in records:
        prompt = r.prompt
        if not use_chat_template:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
            r.prompt = f"{instructions}\n\n{text}"
            continue
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0])
            first["content"] = f"{first['content']}\n\n{instructions}"
            messages[0] = first
        else:
            messages.insert(0, {"role": "system", "content": instructions})
        r.prompt = messages


def unsolved_demonstrations(
    session: EngineSession, max_tokens: int
) -> Callable[[Sequence[PromptRecord]], list[Episode | None]] | None:
    """``session``'s demonstrations for the groups with no right episode
    (``environment.demonstrate_unsolved``, :meth:`EpisodeSession.demonstrations` with
    ``max_tokens``); None when the session runs no episodes or the setting is off."""
    if isinstance(session, EpisodeSession) and session.environment.demonstrate_unsolved:
        return functools.partial(session.demonstrations, max_tokens=max_tokens)
    return None
