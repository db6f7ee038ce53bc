"""The rollout engine protocol, its declared capabilities, and the plain data it exchanges."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import Tensor

from dapo_lightning.checks import ConfigError, check_count, check_finite

FinishReason = Literal["stop", "length"]

#: Where :class:`SamplingConfig` sits in a run's YAML (its errors name this path).
SAMPLING_PATH = "data.sampling"


@dataclass
class SamplingConfig:
    """How responses are sampled.

    Args:
        max_tokens: Most response tokens per sample (the paper's max response length).
        temperature: Softmax temperature; 1.0 samples from the policy itself (paper setting).
        top_p: Nucleus sampling mass; 1.0 disables it.
        top_k: Keep the k most likely tokens; -1 disables it.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        path = SAMPLING_PATH
        check_count(f"{path}.max_tokens", self.max_tokens, 1, "tokens per response")
        check_finite(f"{path}.temperature", self.temperature, "Give a temperature > 0.")
        if not self.temperature > 0:
            raise ConfigError(
                f"{path}.temperature must be > 0 for RL sampling, got {self.temperature}."
            )
        if not 0 < self.top_p <= 1:  # False for NaN
            raise ConfigError(f"{path}.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"{path}.top_k must be -1 (off) or >= 1, got {self.top_k}.")


@dataclass
class Completion:
    """One sampled response.

    Args:
        token_ids: Response tokens, EOS included when the sample stopped on it.
        log_probs: Log-probability of each token under the sampling distribution
            (after temperature / top-p / top-k), same length as ``token_ids``.
        finish_reason: ``"stop"`` (EOS or a stop token) or ``"length"`` (hit ``max_tokens``).
        text: The text the reward scores; None decodes ``token_ids``.
        loss_mask: Per token, 1 where the token was sampled by the policy (it enters the loss)
            and 0 where it was not (an environment's observation in a multi-turn episode,
            :mod:`dapo_lightning.envs`; its ``log_probs`` entry is 0). None: every token is
            sampled.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    text: str | None = field(default=None, compare=False)
    loss_mask: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Completion has {len(self.token_ids)} token_ids but {len(self.log_probs)} log_probs."
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != len(self.token_ids):
                raise ValueError(
                    f"Completion has {len(self.token_ids)} token_ids but a loss_mask of "
                    f"{len(self.loss_mask)}."
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("Completion.loss_mask entries must be 0 or 1.")


#: Sent into a ``stream_groups`` generator (:class:`RolloutEngine`): finish the groups already
#: started, abort the ones not started yet.
DRAIN = "drain"


@dataclass(frozen=True)
class EngineCapabilities:
    """What a kind of engine can do besides ``generate`` and ``load_weights``, declared on its
    class (:attr:`RolloutEngine.capabilities`). The engine session, the rollout producer and the
    data module read these, never an engine's name.

    Args:
        streaming: It has ``stream_groups`` (:class:`RolloutEngine`): the producer's in-flight
            rounds score groups as they finish.
        tensor_parallel: One engine spans ``engine_kwargs.tensor_parallel_size`` consecutive
            ranks, which submit the same prompts (the data module shards prompts per group).
        sleep: ``sleep`` / ``wake_up`` free and restore its memory between rollouts (used when
            the engine's ``sleep_mode`` is on).
        adapters: ``load_adapter`` serves LoRA adapters over its own base (used when the
            engine's ``lora_enabled`` is on).
    """

    streaming: bool = False
    tensor_parallel: bool = False
    sleep: bool = False
    adapters: bool = False


@dataclass(frozen=True)
class EngineSetup:
    """What the engine session builds an engine selected by name from
    (:meth:`RolloutEngine.from_setup`).

    Args:
        kwargs: The engine's own options (``data.engine_kwargs``).
        model_path: The run's checkpoint folder or hub id (``data.model_name_or_path``).
        tokenizer: The run's tokenizer.
        seed: The run's base sampling seed.
        rank: This process's rank (an engine per rank adds it to ``seed``).
        sampling_module: Returns ``(module, owned)``: the module to sample with, the policy
            itself (``owned`` False: it needs no weight push) or, when the policy is sharded,
            an unsharded copy loaded from ``model_path`` (``owned`` True); None: no policy.
    """

    kwargs: dict[str, Any] = field(default_factory=dict)
    model_path: str | None = None
    tokenizer: Any = None
    seed: int = 0
    rank: int = 0
    sampling_module: Callable[[], tuple[Any, bool]] | None = None


class RolloutEngine(abc.ABC):
    """What the library needs from a generation backend: subclass it for your own engine.

    Two methods are required, :meth:`generate` and :meth:`load_weights`. The other capabilities
    the engine session uses have defaults that do nothing, so an engine implements only what
    it has:

    * ``model``: the ``nn.Module`` the engine samples with when that is the policy itself
      (the HF engine without sharding): nothing is pushed then. Default None.
    * ``sleep_mode`` / :meth:`wake_up` / :meth:`sleep`: an engine that frees its memory
      between rollouts (vLLM sleep mode, CUDA only) is woken before each generation and put
      back to sleep after it. Default: never asleep.
    * ``lora_enabled`` / :meth:`load_adapter`: an engine that serves LoRA adapters over its
      own base receives the adapter weights instead of merged ones. Default: merged weights.
    * :meth:`state_dict` / :meth:`load_state_dict`: the sampling RNG state, checkpointed to
      resume exactly. Default: no state.
    * ``stream_groups(prompts, n, sampling)``: a generator yielding, after each engine step
      that finished groups, ``[(prompt position, its n completions), ...]``; the producer's
      in-flight rounds use it (the vLLM engine has it). Sending :data:`DRAIN` into it
      (``stream.send(DRAIN)``) aborts the requests not started yet and lets the started ones
      finish (they are yielded, then the generator ends); closing it aborts everything left.

    * :attr:`max_context_tokens`: the most prompt + response tokens of one sequence. Default
      None (unknown).

    :attr:`capabilities` declares which of streaming, tensor parallelism, sleep and adapters
    the class has (a class that declares one defines its methods, and one that defines
    ``stream_groups`` declares streaming: checked when the class is created). An engine
    selected by name (``data.engine``, registered with
    :func:`~dapo_lightning.rollout.engines.register_engine`) is built by :meth:`from_setup`;
    :attr:`needs_model_path` and :attr:`requires_package` are checked before that.

    Example::

        class EchoEngine(RolloutEngine):
            def generate(self, prompts, n, sampling):
                return [[Completion([1], [0.0], "stop") for _ in range(n)] for _ in prompts]

            def load_weights(self, named_tensors):
                for _ in named_tensors:  # consume them (a gather may be a collective)
                    pass
    """

    #: The module the engine samples with when it is the policy itself (nothing to push).
    model: Any = None
    #: True when the engine sleeps between rollouts (:meth:`wake_up` before generating).
    sleep_mode: bool = False
    #: True when the engine serves LoRA adapters itself (:meth:`load_adapter` is pushed).
    lora_enabled: bool = False
    #: What this kind of engine can do (:class:`EngineCapabilities`); none by default.
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()
    #: Built by name, it needs the run's ``model_path`` (the checkpoint it loads itself).
    needs_model_path: ClassVar[bool] = False
    #: ``(import name, install hint)`` of an optional package it needs; None: none.
    requires_package: ClassVar[tuple[str, str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a class whose declared capabilities and methods disagree: a capability
        declared without its methods, or methods of a capability it does not declare (the
        library would never call them). A class whose ``capabilities`` is a property (an
        engine that wraps another and has its capabilities,
        :class:`~dapo_lightning.envs.runner.EpisodeRunner`) declares them per instance: it is
        not checked here."""
        super().__init_subclass__(**kwargs)
        caps = cls.capabilities
        if not isinstance(caps, EngineCapabilities):
            return
        for capability, methods, defined in (
            ("streaming", "stream_groups", callable(getattr(cls, "stream_groups", None))),
            ("sleep", "sleep and wake_up", _overrides(cls, "sleep", "wake_up")),
            ("adapters", "load_adapter", _overrides(cls, "load_adapter")),
        ):
            if getattr(caps, capability) != defined:
                raise TypeError(
                    f"{cls.__name__}: the {capability} capability and its methods ({methods}) "
                    f"go together: {'define them' if not defined else 'declare it'} "
                    f"(capabilities = EngineCapabilities({capability}=True)), or neither."
                )

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> RolloutEngine:
        """Build the engine selected by name for the engine session: ``cls(**setup.kwargs)``.
        Override it to take the model path, tokenizer, seed or module of ``setup``."""
        return cls(**setup.kwargs)

    @property
    def max_context_tokens(self) -> int | None:
        """The most prompt + response tokens one sequence may have (the model's context); None
        when the engine does not say (the default). The episode runner keeps episodes within
        it."""
        return None

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt (token ids, no padding).

        Returns one list of ``n`` completions per prompt, in prompt order.
        """

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights with the trainer's (checkpoint-format names; iterate
        them all: gathering a sharded policy is a collective)."""

    def load_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], peft_config: Any) -> None:
        """Serve these LoRA adapter weights (peft names) over the engine's own base.

        Raises:
            NotImplementedError: always, unless the engine overrides it with ``lora_enabled``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} serves no LoRA adapters (lora_enabled is False): the "
            "engine session pushes merged weights to it instead."
        )

    def wake_up(self) -> bool:
        """Bring a sleeping engine's weights and cache back (called when ``sleep_mode``);
        False when it was not asleep (the default: never)."""
        return False

    def sleep(self) -> bool:
        """Free the engine's memory until the next :meth:`wake_up` (called when
        ``sleep_mode``); False when it cannot (the default)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The sampling RNG state to checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Restore :meth:`state_dict` (default: nothing to restore)."""


def _overrides(cls: type, *methods: str) -> bool:
    """True when ``cls`` replaces any of the :class:`RolloutEngine` defaults ``methods``."""
    return any(getattr(cls, m) is not getattr(RolloutEngine, m) for m in methods)
