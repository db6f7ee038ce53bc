"""Rollouts as they move from the engine to the loss.

``ScoredRollouts`` is the flat, unpadded form the buffer and the
``on_rollouts_scored`` callbacks work on; ``RolloutBatch`` is the padded tensor
form ``DAPOModule.training_step`` consumes. Responses of one group (one prompt,
``n`` samples) are contiguous in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from dapo_lightning.rollout.base import SamplingConfig

#: ``finish_reason`` -> the code of ``RolloutBatch.finish``.
FINISH_CODES = {"stop": 0, "length": 1, "demonstration": 2}

#: The :attr:`ScoredRollouts.extra` keys the library sets beside the reward's: the response text
#: the reward scored and the prompt as text (set by the scorer), and the dynamic-sampling
#: filter's decision per response (``"kept"`` or ``"dropped: <metric> all <value>"``, set right
#: after ``on_rollouts_scored``); for multi-turn episodes, the whole exchange decoded (assistant
#: turns and the environment's observations; None for a single-turn response).
#: ``dapo_lightning.callbacks.SampleLog`` writes them.
RESPONSE_TEXT, PROMPT_TEXT, FILTER_DECISION = "response_text", "prompt_text", "filter"
EPISODE_TEXT = "episode_text"


@dataclass
class ScoredRollouts:
    """Flat list of ``N`` scored responses, ``n`` per group, groups contiguous.

    Callbacks may change ``reward`` (shaping) and ``loss_mask`` (filtering) in place in
    ``on_rollouts_scored``; ``score`` stays the raw reward and ``acc`` the correctness flag.

    Args:
        prompt_ids: Prompt token ids of each response (shared within a group).
        response_ids: Sampled response token ids.
        rollout_log_probs: The engine's log-probabilities of the sampled tokens.
        finish_reason: ``"stop"`` or ``"length"`` per response, or ``"demonstration"``: an
            environment's demonstration put in place of a sample
            (``environment.demonstrate_unsolved``), which no engine sampled.
        group_index: ``[N]`` long, the group each response belongs to (0..num_groups-1).
        prompt_uid: Stable id of the prompt of each response (for per-prompt statistics).
        score: ``[N]`` float, the reward function's raw score.
        acc: ``[N]`` float, 1.0 where the answer is correct.
        reward: ``[N]`` float, the shaped reward the advantages use (starts as ``score``).
        loss_mask: ``[N]`` bool, False removes the whole response from the loss and its
            token count (overlong filtering).
        sampling: The sampling settings the responses were drawn with (``max_tokens`` is the
            maximum response length).
        policy_version: Weight version (optimizer updates applied) the responses were
            sampled with.
        extra: Per-response extra information from the reward function (lists of length N),
            and the texts and the filter decision the library adds (:data:`RESPONSE_TEXT`,
            :data:`PROMPT_TEXT`, :data:`FILTER_DECISION`).
        token_mask: Per response, a per-token 0/1 list: 1 on tokens the policy sampled, 0 on
            tokens it did not (observations of a multi-turn episode); those leave the loss,
            its token count, the entropy, the KL and the parity check
            (:meth:`RolloutBatch.from_rollouts` ANDs it into ``response_mask``). None: every
            token was sampled.
        tool_calls: Per response, the tool calls its episode made (multi-turn episodes
            only; None for single-turn rollouts).
        batch_index: Which rollout batch of the run (0, 1, ...; the producer's count) these
            responses were generated for: a callback's per-round counts go to the step that
            trains that batch (``callbacks/round_counts.py``), whatever the timing.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_log_probs: list[list[float]]
    finish_reason: list[str]
    group_index: Tensor
    prompt_uid: list[str]
    score: Tensor
    acc: Tensor
    sampling: SamplingConfig
    policy_version: int = 0
    reward: Tensor | None = None
    loss_mask: Tensor | None = None
    extra: dict[str, list[Any]] = field(default_factory=dict)
    token_mask: list[list[int]] | None = None
    tool_calls: list[int] | None = None
    batch_index: int = 0

    def __post_init__(self) -> None:
        if self.reward is None:
            self.reward = self.score.clone().float()
        if self.loss_mask is None:
            self.loss_mask = torch.ones(len(self.response_ids), dtype=torch.bool)
        if self.token_mask is not None:
            if len(self.token_mask) != len(self.response_ids) or any(
                len(m) != len(r) for m, r in zip(self.token_mask, self.response_ids)
            ):
                raise ValueError("ScoredRollouts.token_mask needs one entry per response token.")

    def token_masks(self) -> list[list[int]]:
        """``token_mask``, with all-ones lists when it is None."""
        if self.token_mask is not None:
            return self.token_mask
        return [[1] * len(r) for r in self.response_ids]

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def max_response_length(self) -> int:
        """Most response tokens a sample could have (the sampling ``max_tokens``)."""
        return self.sampling.max_tokens

    @property
    def num_groups(self) -> int:
        return int(self.group_index.max()) + 1 if len(self) else 0

    @property
    def response_length(self) -> Tensor:
        """``[N]`` long, number of sampled tokens of each response (observation tokens of a
        multi-turn episode not counted: overlong shaping measures what the policy wrote)."""
        if self.token_mask is not None:
            return torch.tensor([sum(m) for m in self.token_mask], dtype=torch.long)
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    @property
    def truncated(self) -> Tensor:
        """``[N]`` bool, True where the response hit ``max_response_length``."""
        return torch.tensor([f == "length" for f in self.finish_reason], dtype=torch.bool)

    @property
    def finish_codes(self) -> Tensor:
        """``[N]`` long, each ``finish_reason`` as its :data:`FINISH_CODES` code."""
        return torch.tensor([FINISH_CODES[f] for f in self.finish_reason], dtype=torch.long)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python containers (``torch.load(weights_only=True)`` reads them back)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("group_index", "score", "acc", "reward", "loss_mask"):
            out[name] = out[name].tolist()
        out["sampling"] = asdict(self.sampling)
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ScoredRollouts:
        """Rebuild what :meth:`state_dict` returned."""
        s = dict(state)
        s["group_index"] = torch.tensor(s["group_index"], dtype=torch.long)
        for name in ("score", "acc", "reward"):
            s[name] = torch.tensor(s[name], dtype=torch.float32)
        s["loss_mask"] = torch.tensor(s["loss_mask"], dtype=torch.bool)
        s["sampling"] = SamplingConfig(**s["sampling"])
        return cls(**s)

    def select(self, index: list[int]) -> ScoredRollouts:
        """The responses at ``index`` (group ids are renumbered 0..k-1 in order of appearance)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        old_groups = self.group_index[idx]
        _, new_groups = torch.unique_consecutive(old_groups, return_inverse=True)
        return ScoredRollouts(
            prompt_ids=[self.prompt_ids[i] for i in index],
            response_ids=[self.response_ids[i] for i in index],
            rollout_log_probs=[self.rollout_log_probs[i] for i in index],
            finish_reason=[self.finish_reason[i] for i in index],
            group_index=new_groups,
            prompt_uid=[self.prompt_uid[i] for i in index],
            score=self.score[idx],
            acc=self.acc[idx],
            sampling=self.sampling,
            policy_version=self.policy_version,
            reward=self.reward[idx],
            loss_mask=self.loss_mask[idx],
            extra={k: [v[i] for i in index] for k, v in self.extra.items()},
            token_mask=None if self.token_mask is None else [self.token_mask[i] for i in index],
            tool_calls=None if self.tool_calls is None else [self.tool_calls[i] for i in index],
            batch_index=self.batch_index,
        )


@dataclass
class RolloutBatch:
    """Padded rollouts for one rollout step: ``B = num_groups * group_size`` sequences.

    Sequences are ``[left-padded prompt | right-padded response]``: the prompt part has
    width ``P = input_ids.shape[1] - T`` and the response part width ``T``.

    Args:
        input_ids: ``[B, P + T]`` long.
        attention_mask: ``[B, P + T]`` long, 1 on real tokens.
        response_mask: ``[B, T]`` float, 1 on response tokens that enter the loss
            (0 on padding, on responses removed by ``loss_mask`` and on observation tokens,
            ``ScoredRollouts.token_mask``).
        rollout_log_probs: ``[B, T]`` float, the engine's sampling log-probabilities.
        reward: ``[B]`` float, shaped reward (what the advantages use).
        score: ``[B]`` float, raw reward.
        acc: ``[B]`` float, correctness.
        group_index: ``[B]`` long, 0..num_groups-1, groups contiguous.
        finish: ``[B]`` long, how each response ended (:data:`FINISH_CODES`: stop, length,
            or an environment's demonstration, which no engine sampled: its own behaviour
            policy); :attr:`truncated` and :attr:`demonstrated` read it.
        response_length: ``[B]`` long, sampled tokens per response (observations not counted).
        sample_version: ``[B]`` long, policy version each response was sampled with.
        policy_version: Policy version of the freshest responses in the batch.
        group_size: Responses per group (``n``).
        sampling: The sampling settings the responses were drawn with: the module takes the
            temperature of its log-probs and the maximum response length from here, so the
            model and the data cannot disagree about them.
        stats: Metrics of the step by full name (``data/kept_groups``, ``reward/<extra>``...),
            logged as they are.
        batch_index: Which rollout batch of the run this is (0, 1, ...; the producer's count,
            :attr:`ScoredRollouts.batch_index` of the rounds that generated it).

    A batch may hold no rows (``B = 0``): a rank that kept no group still joins the update's
    collectives.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_log_probs: Tensor
    reward: Tensor
    score: Tensor
    acc: Tensor
    group_index: Tensor
    finish: Tensor
    response_length: Tensor
    sample_version: Tensor
    policy_version: int
    group_size: int
    sampling: SamplingConfig
    stats: dict[str, float] = field(default_factory=dict)
    batch_index: int = 0

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.group_size

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.response_width

    @property
    def truncated(self) -> Tensor:
        """``[B]`` bool, True where the response hit the maximum length."""
        return self.finish == FINISH_CODES["length"]

    @property
    def demonstrated(self) -> Tensor:
        """``[B]`` bool, True on an environment's demonstration (no engine sampled it)."""
        return self.finish == FINISH_CODES["demonstration"]

    def select(self, index: Tensor | list[int] | slice) -> RolloutBatch:
        """Rows ``index`` (group_size kept; the caller selects whole groups when it matters)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[index] if isinstance(value, Tensor) else value
        return RolloutBatch(**out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch with its tensors on ``device``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(
            **{k: v.to(device) if isinstance(v, Tensor) else v for k, v in out.items()}
        )

    def padding_row(self) -> RolloutBatch:
        """One fully masked row (a pad prompt token and a pad response token): what a rank
        with no rows feeds through the model to join the other ranks' collectives."""
        pad = torch.zeros((1, 2), dtype=torch.long)
        one = torch.zeros(1)
        return RolloutBatch(
            input_ids=pad,
            attention_mask=torch.ones_like(pad),
            response_mask=torch.zeros((1, 1)),
            rollout_log_probs=torch.zeros((1, 1)),
            reward=one,
            score=one,
            acc=one,
            group_index=torch.zeros(1, dtype=torch.long),
            finish=torch.zeros(1, dtype=torch.long),
            response_length=torch.ones(1, dtype=torch.long),
            sample_version=torch.zeros(1, dtype=torch.long),
            policy_version=self.policy_version,
            group_size=1,
            sampling=self.sampling,
            batch_index=self.batch_index,
        )

    def trim(self) -> RolloutBatch:
        """Drop all-padding columns at the left of the prompt and the right of the response."""
        if self.batch_size == 0:
            return self
        prompt_cols = self.attention_mask[:, : self.prompt_width].any(0).nonzero()
        start = int(prompt_cols[0]) if len(prompt_cols) else self.prompt_width
        resp_cols = self.attention_mask[:, self.prompt_width :].any(0).nonzero()
        width = int(resp_cols[-1]) + 1 if len(resp_cols) else 1
        end = self.prompt_width + width
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask"):
                value = value[:, start:end]
            elif f.name in ("response_mask", "rollout_log_probs"):
                value = value[:, :width]
            out[f.name] = value
        return RolloutBatch(**out)

    @classmethod
    def from_rollouts(
        cls,
        rollouts: ScoredRollouts,
        *,
        group_size: int,
        pad_token_id: int,
        sample_version: Tensor | None = None,
        stats: dict[str, float] | None = None,
    ) -> RolloutBatch:
        """Pad ``rollouts`` into tensors (prompts left-padded, responses right-padded)."""
        n = len(rollouts)
        if n % group_size:
            raise ValueError(
                f"RolloutBatch needs whole groups: got {n} responses for group_size={group_size}."
            )
        input_ids, attention_mask, response_mask = pad_sequences(
            rollouts.prompt_ids, rollouts.response_ids, rollouts.token_masks(), pad_token_id
        )
        response_mask *= rollouts.loss_mask.float().unsqueeze(1)  # a removed response: all 0
        logp = torch.zeros_like(response_mask)
        for i, lp in enumerate(rollouts.rollout_log_probs):
            logp[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
        if sample_version is None:
            sample_version = torch.full((n,), rollouts.policy_version, dtype=torch.long)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_log_probs=logp,
            reward=rollouts.reward.float(),
            score=rollouts.score.float(),
            acc=rollouts.acc.float(),
            group_index=rollouts.group_index.long(),
            finish=rollouts.finish_codes,
            response_length=rollouts.response_length,
            sample_version=sample_version.long(),
            policy_version=int(sample_version.max()) if n else rollouts.policy_version,
            group_size=group_size,
            sampling=rollouts.sampling,
            stats=dict(stats or {}),
            batch_index=rollouts.batch_index,
        )


def pad_sequences(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    token_masks: Sequence[Sequence[int]],
    pad_token_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, response_mask)`` of ``[left-padded prompt | right-padded
    response]`` rows. With ``P`` the longest prompt and ``T`` the longest response (each at
    least 1), row ``b`` is::

        input_ids[b]      = [pad] * (P - |x_b|) + x_b + y_b + [pad] * (T - |y_b|)
        attention_mask[b] = [0] * (P - |x_b|)   + [1] * (|x_b| + |y_b|) + [0] * (T - |y_b|)
        response_mask[b]  = m_b + [0] * (T - |y_b|)

    for prompt ``x_b``, response ``y_b`` and its token mask ``m_b`` (1 on sampled tokens)."""
    n = len(response_ids)
    P = max((len(p) for p in prompt_ids), default=1)
    T = max(1, max((len(r) for r in response_ids), default=1))
    input_ids = torch.full((n, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, P + T), dtype=torch.long)
    response_mask = torch.zeros((n, T), dtype=torch.float32)
    for i, (p, r, m) in enumerate(zip(prompt_ids, response_ids, token_masks)):
        input_ids[i, P - len(p) : P] = torch.as_tensor(p, dtype=torch.long)
        input_ids[i, P : P + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attention_mask[i, P - len(p) : P + len(r)] = 1
        response_mask[i, : len(r)] = torch.as_tensor(m, dtype=torch.float32)
    return input_ids, attention_mask, response_mask


@dataclass
class EndOfTraining:
    """What the data module hands the module instead of a batch when nothing is left to train
    on (every prompt solved, or dynamic sampling gave up with ``on_exhausted="stop"``): the
    module stops the run cleanly with ``reason``."""

    reason: str
