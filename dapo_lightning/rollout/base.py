"""The rollout engine protocol and the plain data it exchanges."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

from dapo_lightning.checks import check_finite

FinishReason = Literal["stop", "length"]


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
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}.")
        check_finite("temperature", self.temperature, "Give a temperature > 0.")
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature must be > 0 for RL sampling, got {self.temperature}."
            )
        if not 0 < self.top_p <= 1:  # False for NaN
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or >= 1, got {self.top_k}.")


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


@runtime_checkable
class RolloutEngine(Protocol):
    """What the data module needs from a generation backend."""

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt (token ids, no padding).

        Returns one list of ``n`` completions per prompt, in prompt order.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights with the trainer's (checkpoint-format names)."""
        ...
