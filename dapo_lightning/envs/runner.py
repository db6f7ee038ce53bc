"""The episode runner: multi-turn episodes on any rollout engine, returned as completions.

:class:`EpisodeRunner` is a :class:`~dapo_lightning.rollout.base.RolloutEngine` around another
engine (its sampling, weights, sleep mode, adapters, RNG state and context are that engine's),
so the rollout producer treats an episode like a single-turn response (dynamic sampling,
overlong shaping, retire/park and the end game unchanged). For each prompt it runs ``n`` episodes, batched turn by turn:

1. every live episode's context (prompt + everything so far) is continued by one
   ``engine.generate(contexts, 1, ...)`` call (the HF engine re-reads the growing prefix;
   vLLM's prefix cache, on by default in vLLM v1, reuses its KV blocks);
2. each assistant turn is handed to its environment's ``step`` (in worker threads, with
   ``call_timeout_s``); an observation is rendered by the chat template as a message of
   ``observation_role`` plus the next generation prompt, tokenized and appended.

The episode is one :class:`Episode` (a :class:`~dapo_lightning.rollout.base.Completion`):
``token_ids`` = assistant turns and observations concatenated, ``loss_mask`` 1 on assistant
tokens and 0 on observation tokens, ``log_probs`` the engine's on assistant tokens and 0 on
observation tokens, ``text`` the final assistant turn (what the reward function scores).

Budgets: the assistant tokens of an episode are at most ``sampling.max_tokens`` (the maximum
response length overlong shaping uses); prompt + all turns + all observations are at most
``max_episode_tokens`` (kept within the engine's
:attr:`~dapo_lightning.rollout.base.RolloutEngine.max_context_tokens` by
:meth:`~dapo_lightning.envs.base.EnvironmentConfig.within_context`). An episode that reaches either ends with finish reason ``"length"`` (the environment does not see that cut turn; the reward
function scores the text); one whose environment says ``done``, or that used ``max_turns``
assistant turns (the environment sees the last one and may give its reward), ends with
``"stop"``.

Faults are data: an environment constructor, ``reset`` or ``step`` call that raises, runs over
``call_timeout_s`` (:mod:`dapo_lightning.envs.calls`: every call runs there, under the stop
checks) or returns something that is not a :class:`~dapo_lightning.envs.base.StepResult` fails
its episode (it is scored with the reward's ``failure_score``, acc False; ``env/failures``,
``env/timeouts``); more than ``max_failure_frac`` failed episodes in one generation raise
:class:`EnvironmentFailureError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dapo_lightning.envs.base import (
    Environment,
    EnvironmentConfig,
    check_step_result,
    declared_metrics,
)
from dapo_lightning.envs.calls import (
    EnvironmentFailureError,
    build_environment,
    call_all,
    error_text,
)
from dapo_lightning.envs.stats import STAT_KEYS, env_stats
from dapo_lightning.prompts import PromptRecord
from dapo_lightning.rewards.base import failure_result
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutEngine,
    SamplingConfig,
)

log = logging.getLogger(__name__)


@dataclass
class Episode(Completion):
    """One multi-turn episode as a completion (see the module docstring), plus its record.

    Args:
        turns: Assistant turns.
        tool_calls: Tool calls the environment reported.
        tool_errors: Those that failed.
        env_reward: The environment's reward (None: the reward function scores ``text``).
        env_acc: Its correctness (None: ``env_reward > 0``).
        failure: Why the environment failed the episode (``"timeout"`` or the error), or None.
        episode_tokens: Prompt + response tokens.
        metrics: The environment's ``StepResult.metrics`` summed over the episode's turns.
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None
    env_acc: bool | None = None
    failure: str | None = None
    episode_tokens: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def episode_results(
    completions: Sequence[Completion], results: Sequence[RewardResult], reward: Any
) -> list[RewardResult]:
    """``results`` with each episode's outcome applied: a failed episode scores
    ``reward.failure_score`` (acc False), an episode the environment rewarded scores that
    (acc ``env_acc``, else ``env_reward > 0``); every other completion keeps its result."""
    out = []
    for c, r in zip(completions, results, strict=True):
        if isinstance(c, Episode) and c.failure is not None:
            r = failure_result(reward, f"environment: {c.failure}")
        elif isinstance(c, Episode) and c.env_reward is not None:
            acc = c.env_acc if c.env_acc is not None else c.env_reward > 0
            r = RewardResult(score=float(c.env_reward), acc=bool(acc), extra=dict(r.extra))
        out.append(r)
    return out


def token_masks(completions: Sequence[Completion]) -> list[list[int]] | None:
    """Per-token loss masks of ``completions`` (all ones where one has none); None when no
    completion has one (single-turn rollouts)."""
    if all(c.loss_mask is None for c in completions):
        return None
    return [list(c.loss_mask or [1] * len(c.token_ids)) for c in completions]


def episode_tool_calls(completions: Sequence[Completion]) -> list[int] | None:
    """Tool calls of each completion (0 for one that is not an episode); None when none is
    an episode (single-turn rollouts)."""
    if not any(isinstance(c, Episode) for c in completions):
        return None
    return [c.tool_calls if isinstance(c, Episode) else 0 for c in completions]


class ObservationFormatter:
    """Observation text -> the tokens that follow an assistant turn's EOS.

    With a chat template: what the template renders after an assistant message for a message
    ``{"role": role, "content": text}`` plus the generation prompt (so the policy sees a
    conversation it knows). Without one: ``"\\n<tool_response>TEXT</tool_response>\\n"``.
    """

    def __init__(self, tokenizer: Any, role: str = "tool", use_chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.role = role
        #: Most characters one token can stand for (its longest vocabulary entry): a text of
        #: more than N x this many characters is more than N tokens, known without tokenizing.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.use_chat_template = bool(
            use_chat_template and getattr(tokenizer, "chat_template", None)
        )
        self._head: list[dict[str, str]] = [
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
        ]
        if self.use_chat_template:
            base = tokenizer.apply_chat_template(self._head, tokenize=False)
            marker = "A" + str(tokenizer.eos_token)
            if marker not in base:
                raise ValueError(
                    "the chat template does not end an assistant message with the EOS token "
                    f"{tokenizer.eos_token!r}: observations cannot follow a turn. Set "
                    "data.prompts.apply_chat_template: false, or use a tokenizer whose template does."
                )
            self._prefix = base[: base.rindex(marker) + len(marker)]

    def text(self, observation: str) -> str:
        """The text inserted after an assistant turn for ``observation``."""
        if not self.use_chat_template:
            return f"\n<tool_response>{observation}</tool_response>\n"
        full = self.tokenizer.apply_chat_template(
            self._head + [{"role": self.role, "content": observation}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not full.startswith(self._prefix):
            raise ValueError(
                f"the chat template renders a conversation differently once a {self.role!r} "
                "message follows (it cannot be continued turn by turn); choose another "
                "environment.observation_role."
            )
        return full[len(self._prefix) :]

    def __call__(self, observation: str) -> list[int]:
        return list(self.tokenizer(self.text(observation), add_special_tokens=False)["input_ids"])


@dataclass
class _State:
    """One running episode."""

    prompt: list[int]
    record: Any
    env: Environment | None  # None: it could not be built (the episode failed)
    ids: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish: str | None = None
    failure: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    acc: bool | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, ids: list[int], logps: list[float], sampled: int) -> None:
        self.ids += ids
        self.logps += logps
        self.mask += [sampled] * len(ids)

    @property
    def assistant_tokens(self) -> int:
        return sum(self.mask)


class EpisodeRunner(RolloutEngine):
    """A rollout engine that runs multi-turn episodes on ``engine`` (module docstring).

    It is the engine the session and the module see: the optional parts of the
    :class:`~dapo_lightning.rollout.base.RolloutEngine` interface (the policy it samples with,
    sleep mode, LoRA adapters, the sampling RNG state, the context length) are the wrapped
    engine's; streaming is not (an episode is generated turn by turn and scored whole).

    Args:
        engine: The engine that samples each turn.
        config: The environment settings.
        make_env: Builds one episode's environment.
        formatter: Observation text -> tokens.
        decode: Token ids -> text (special tokens skipped) for the environment.
        records: Prompt records by their ``prompt_ids`` (an episode starts from its record).
        max_episode_tokens: Resolved ``config.max_episode_tokens``
            (:meth:`EnvironmentConfig.episode_budget`); when ``config.max_episode_tokens`` is
            None (the default budget) it is lowered to the engine's context
            (:attr:`max_context_tokens`), with a warning.

    Raises:
        ValueError: a set ``max_episode_tokens`` exceeds the engine's context.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        config: EnvironmentConfig,
        *,
        make_env: Callable[[], Environment],
        formatter: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        records: Iterable[PromptRecord],
        max_episode_tokens: int,
    ) -> None:
        self.engine = engine
        self.config = config
        self.make_env = make_env
        self.formatter = formatter
        self.decode = decode
        self.records = {tuple(r.prompt_ids): r for r in records if r.prompt_ids is not None}
        self.metric_names = declared_metrics(
            build_environment(make_env, config.call_timeout_s, config.name)
        )
        self.max_episode_tokens = config.within_context(
            int(max_episode_tokens), engine.max_context_tokens
        )
        self.totals = self._zero_totals()
        self._warned_cut = False

    def _zero_totals(self) -> dict[str, float]:
        return {**dict.fromkeys(STAT_KEYS, 0), **{f"metric:{n}": 0.0 for n in self.metric_names}}

    # ---------------------------------------------------------------- the wrapped engine's
    @property
    def capabilities(self) -> EngineCapabilities:
        """The wrapped engine's, without streaming: an episode is generated turn by turn and
        scored whole."""
        return dataclasses.replace(self.engine.capabilities, streaming=False)

    @property
    def max_context_tokens(self) -> int | None:
        """The wrapped engine's context (:attr:`RolloutEngine.max_context_tokens`)."""
        return self.engine.max_context_tokens

    @property
    def model(self) -> Any:
        """The module the wrapped engine samples with when it is the policy itself."""
        return self.engine.model

    @property
    def sleep_mode(self) -> bool:
        """Whether the wrapped engine sleeps between rollouts."""
        return self.engine.sleep_mode

    @property
    def lora_enabled(self) -> bool:
        """Whether the wrapped engine serves LoRA adapters itself."""
        return self.engine.lora_enabled

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Pass the weights to the wrapped engine."""
        self.engine.load_weights(named_tensors)

    def load_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], peft_config: Any) -> None:
        """Pass the adapter weights to the wrapped engine."""
        self.engine.load_adapter(named_tensors, peft_config)

    def wake_up(self) -> bool:
        """Wake the wrapped engine."""
        return self.engine.wake_up()

    def sleep(self) -> bool:
        """Put the wrapped engine to sleep."""
        return self.engine.sleep()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped engine's sampling RNG state."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped engine's sampling RNG state."""
        self.engine.load_state_dict(state)

    # ---------------------------------------------------------------- episodes
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """``n`` episodes per prompt; see :class:`~dapo_lightning.rollout.base.RolloutEngine`."""
        if n < 1:
            raise ValueError(f"generate(n=...) must be >= 1, got {n}.")
        states = self._start([list(p) for p in prompts for _ in range(n)])
        self._reset([s for s in states if s.finish is None])
        for turn in range(self.config.max_turns):
            live = [s for s in states if s.finish is None]
            if not live:
                break
            self._assistant_turn(live, sampling)
            stepping = [s for s in live if s.finish is None]
            if stepping:
                self._observe(stepping, last=turn == self.config.max_turns - 1)
        episodes = [self._episode(s) for s in states]
        self._account(episodes)
        return [episodes[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _start(self, prompts: list[list[int]]) -> list[_State]:
        """One episode per prompt, its environment built under ``call_timeout_s`` (all at
        once; a constructor that raises or runs over fails its episode)."""
        records = [self.records.get(tuple(p)) for p in prompts]
        if any(r is None for r in records):
            raise ValueError(
                "EpisodeRunner.generate got a prompt that is not one of its records: an "
                "episode starts from its prompt record (pass the records it may see)."
            )
        built = call_all([self.make_env] * len(prompts), self.config.call_timeout_s)
        states = []
        for prompt, record, (status, value) in zip(prompts, records, built):
            states.append(_State(prompt, record, value if status == "ok" else None))
            if status != "ok":
                self._fail(states[-1], status, value)
        return states

    def _reset(self, states: list[_State]) -> None:
        calls = [lambda s=s: s.env.reset(s.record) for s in states]
        for s, (status, value) in zip(states, call_all(calls, self.config.call_timeout_s)):
            if status != "ok":
                self._fail(s, status, value)

    def _fail(self, s: _State, status: str, message: Any) -> None:
        s.finish = "stop"
        s.failure = "timeout" if status == "timeout" else error_text(message)

    def _assistant_turn(self, live: list[_State], sampling: SamplingConfig) -> None:
        """One assistant turn of every live episode (one engine call, per-episode caps)."""
        caps = [
            min(
                sampling.max_tokens - s.assistant_tokens,
                self.max_episode_tokens - len(s.prompt) - len(s.ids),
            )
            for s in live
        ]
        for s, cap in zip(live, caps):
            if cap <= 0:
                s.finish = "length"
        going = [(s, cap) for s, cap in zip(live, caps) if cap > 0]
        if not going:
            return
        turn = dataclasses.replace(sampling, max_tokens=max(cap for _, cap in going))
        outs = self.engine.generate([s.prompt + s.ids for s, _ in going], 1, turn)
        for (s, cap), (c,) in zip(going, outs):
            over = len(c.token_ids) > cap
            ids, logps = list(c.token_ids[:cap]), list(c.log_probs[:cap])
            s.add(ids, [float(x) for x in logps], 1)
            s.text = self.decode(ids)
            s.turns += 1
            if over or c.finish_reason == "length":
                s.finish = "length"

    def _observe(self, stepping: list[_State], last: bool) -> None:
        """Each environment's answer to its episode's last turn: an observation or the end
        (after the ``last`` allowed turn the episode ends either way; a reward given then
        counts)."""
        names = self.metric_names
        calls = [lambda s=s: check_step_result(s.env.step(s.text), names) for s in stepping]
        for s, (status, value) in zip(stepping, call_all(calls, self.config.call_timeout_s)):
            if status != "ok":
                self._fail(s, status, value)
                continue
            s.tool_calls += value.tool_calls
            s.tool_errors += value.tool_errors
            for name, number in value.metrics.items():
                s.metrics[name] = s.metrics.get(name, 0.0) + float(number)
            if value.done or last:
                s.finish = "stop"
                s.reward, s.acc = value.reward, value.acc
                continue
            used = len(s.prompt) + len(s.ids)
            room = self.max_episode_tokens - used  # an observation too long by its characters
            too_long = len(value.observation) > room * self.formatter.max_token_chars
            obs = [] if too_long else self.formatter(value.observation)  # is never tokenized
            if too_long or used + len(obs) >= self.max_episode_tokens:
                s.finish = "length"  # no room for the observation and another turn
                self.totals["observations_cut"] += 1
                self._warn_cut(used, f"more than {room}" if too_long else str(len(obs)))
                continue
            s.add(obs, [0.0] * len(obs), 0)

    def _warn_cut(self, used: int, observation: str) -> None:
        if self._warned_cut:
            return
        self._warned_cut = True
        log.warning(
            "an observation of %s tokens did not fit: its episode had used %d of "
            "environment.max_episode_tokens=%d, so it ended as 'length' (env/observations_cut "
            "counts these); raise max_episode_tokens (or max_observation_tokens when it is null)",
            observation, used, self.max_episode_tokens,
        )  # fmt: skip

    def _episode(self, s: _State) -> Episode:
        return Episode(
            token_ids=s.ids,
            log_probs=s.logps,
            finish_reason="length" if s.finish == "length" else "stop",
            text=s.text,
            loss_mask=s.mask,
            turns=s.turns,
            tool_calls=s.tool_calls,
            tool_errors=s.tool_errors,
            env_reward=s.reward,
            env_acc=s.acc,
            failure=s.failure,
            episode_tokens=len(s.prompt) + len(s.ids),
            metrics=dict(s.metrics),
        )

    # ---------------------------------------------------------------- accounting
    def _account(self, episodes: list[Episode]) -> None:
        failed = [e for e in episodes if e.failure is not None]
        add = {
            "episodes": len(episodes),
            "turns": sum(e.turns for e in episodes),
            "tool_calls": sum(e.tool_calls for e in episodes),
            "calling": sum(e.tool_calls > 0 for e in episodes),
            "tool_errors": sum(e.tool_errors for e in episodes),
            "failures": len(failed),
            "timeouts": sum(e.failure == "timeout" for e in failed),
            "tokens": sum(e.episode_tokens for e in episodes),
        }
        for key, value in add.items():
            self.totals[key] += value
        for e in episodes:
            for name, value in e.metrics.items():
                self.totals[f"metric:{name}"] += value
        if episodes and len(failed) > self.config.max_failure_frac * len(episodes):
            raise EnvironmentFailureError(
                f"{len(failed)} of {len(episodes)} episodes failed in the environment "
                f"(more than environment.max_failure_frac={self.config.max_failure_frac}); "
                f"e.g. {failed[0].failure!r}. Fix the environment, raise "
                "environment.call_timeout_s if calls time out, or raise max_failure_frac."
            )

    def take_stats(self) -> dict[str, float]:
        """:func:`env_stats` of the episodes since the last call, and a fresh count."""
        totals, self.totals = self.totals, self._zero_totals()
        return env_stats(totals, self.metric_names)
