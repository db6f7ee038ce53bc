"""Overlong reward shaping (DAPO "soft overlong punishment") and overlong filtering.

DAPO (Yu et al. 2025, Section 3.4) treats responses that run past the expected length in
two ways:

* *Overlong filtering*: a response cut off by the length limit has no answer to judge, so
  its reward is noise; it is removed from the loss (and from the token count).
* *Soft overlong punishment* (Eq. 13): a length-dependent penalty added to the reward,
  zero up to ``L_max - L_cache`` and falling linearly to ``-1`` at ``L_max``.
"""

from __future__ import annotations

from typing import Any, overload

import lightning.pytorch as pl
import torch
from dapo_lightning.callbacks.round_counts import RoundCounts
from torch import Tensor
from typing_extensions import override

from dapo_lightning.batch import ScoredRollouts
from dapo_lightning.checks import ConfigError, check_count, check_finite
from dapo_lightning.hooks import DAPOCallback


def _field(where: str, name: str) -> str:
    """``where.name`` (``OverlongRewardShaping.buffer_length``), or ``name`` for a function's
    argument."""
    return f"{where}.{name}" if where else name


def _check_buffer(buffer_length: int, penalty_factor: float, where: str = "") -> None:
    check_count(_field(where, "buffer_length"), buffer_length, 0, "tokens punished, L_cache")
    name = _field(where, "penalty_factor")
    check_finite(name, penalty_factor, "Give a scale >= 0 (1.0: -1 at the maximum length).")
    if not penalty_factor >= 0:
        raise ConfigError(f"{name} must be >= 0, got {penalty_factor}.")


def _check_lengths(
    max_response_length: int, buffer_length: int, penalty_factor: float, where: str = ""
) -> None:
    _check_buffer(buffer_length, penalty_factor, where)
    check_count(_field(where, "max_response_length"), max_response_length, 1, "tokens, L_max")
    if buffer_length >= max_response_length:
        raise ConfigError(
            f"{_field(where, 'buffer_length')} must be in [0, max_response_length="
            f"{max_response_length}), got {buffer_length}. Set buffer_length (L_cache) below the "
            "maximum response length, e.g. 4096 for max_response_length 20480 as in the DAPO "
            "paper."
        )


@overload
def overlong_penalty(
    length: int | float, max_response_length: int, buffer_length: int, penalty_factor: float = ...
) -> float: ...
@overload
def overlong_penalty(
    length: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = ...
) -> Tensor: ...
def overlong_penalty(
    length: int | float | Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> float | Tensor:
    """Soft overlong punishment, DAPO paper Eq. 13 scaled by ``penalty_factor``.

    With ``L`` the response length, ``L_max = max_response_length``, ``L_cache = buffer_length``
    and ``f = penalty_factor``::

        R(L) = 0                                  if L <= L_max - L_cache
        R(L) = f * ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        R(L) = -f                                 if L > L_max

    The penalty is continuous: it is ``0`` at ``L_max - L_cache`` and ``-f`` at ``L_max``. With
    ``buffer_length = 0`` only the ``L > L_max`` case is penalised.

    Args:
        length: Response length(s) in tokens: a Python number or a tensor (elementwise).
        max_response_length: ``L_max``, the maximum response length (tokens).
        buffer_length: ``L_cache``, the punishment interval before ``L_max``; in
            ``[0, max_response_length)``.
        penalty_factor: ``f >= 0``, scales the penalty (1.0 in the paper).

    Returns:
        A float for a number, a float tensor of ``length``'s shape for a tensor.
    """
    _check_lengths(max_response_length, buffer_length, penalty_factor)
    expected = max_response_length - buffer_length
    if isinstance(length, Tensor):
        lengths = length.to(torch.float64)
        ramp = (expected - lengths) / max(buffer_length, 1)
        out = torch.where(lengths <= expected, torch.zeros_like(lengths), ramp)
        out = torch.where(lengths > max_response_length, torch.full_like(lengths, -1.0), out)
        dtype = length.dtype if length.is_floating_point() else torch.float32
        return (out * penalty_factor).to(dtype)
    if length <= expected:
        return 0.0
    if length <= max_response_length:
        return penalty_factor * (expected - length) / buffer_length
    return -1.0 * penalty_factor


class OverlongRewardShaping(DAPOCallback):
    """Adds the soft overlong punishment to rewards and optionally filters truncated responses.

    Runs in the custom ``on_rollouts_scored`` hook, which the dynamic-sampling buffer calls
    after scoring and *before* the zero-variance group filter, so the shaped reward is what
    dynamic sampling and the advantages see.

    * ``apply_penalty``: ``rollouts.reward += overlong_penalty(response_length, ...)``.
    * ``overlong_filtering``: responses the engine cut off (``finish_reason == "length"``,
      ``rollouts.truncated``) get ``loss_mask = False``: they leave the loss and its token
      count. Their reward still counts for their group's advantages.

    A round that is discarded (``on_rollouts_discarded``: a stop during its generation, or one
    that undid its step) is forgotten: it is scored again and counted once.

    Logged in ``on_train_batch_end`` (rank-local values over every response generated for the
    step, including groups the filter later drops):

    * ``overlong/truncation_rate``: share of truncated responses.
    * ``overlong/mean_penalty``: mean penalty added to the reward (0 with ``apply_penalty=False``).
    * ``overlong/filtered``: share of responses removed from the loss by overlong filtering.

    Args:
        buffer_length: ``L_cache`` in tokens, the punishment interval before the maximum length
            (4096 in the paper for 20480 tokens). Must be below the maximum response length.
        penalty_factor: Scale of the penalty (``-penalty_factor`` at the maximum length), >= 0.
        max_response_length: ``L_max`` in tokens. ``None`` (default) uses the length the
            responses were sampled with (``rollouts.max_response_length``, the run's config).
        overlong_filtering: Remove truncated responses from the loss.
        apply_penalty: Add the length penalty to the reward. Set False for filtering only.

    Example::

        from lightning.pytorch import Trainer
        from dapo_lightning.callbacks import OverlongRewardShaping

        # DAPO paper: 20480-token responses, last 4096 punished linearly down to -1
        shaping = OverlongRewardShaping(buffer_length=4096, overlong_filtering=False)
        trainer = Trainer(callbacks=[shaping])
    """

    def __init__(
        self,
        buffer_length: int,
        penalty_factor: float = 1.0,
        max_response_length: int | None = None,
        overlong_filtering: bool = False,
        apply_penalty: bool = True,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        if max_response_length is not None:
            _check_lengths(max_response_length, buffer_length, penalty_factor, where)
        else:  # the maximum comes with the rollouts; check the rest now
            _check_buffer(buffer_length, penalty_factor, where)
        self.buffer_length = buffer_length
        self.penalty_factor = float(penalty_factor)
        self.max_response_length = max_response_length
        self.overlong_filtering = overlong_filtering
        self.apply_penalty = apply_penalty
        # each round's counts, taken by the rollout step that trains its rollouts
        self._pending = RoundCounts(self._zero_counts)
        #: Running totals over the rounds of the steps trained so far (added when a step takes
        #: its rounds, so a discarded round is never in them).
        self.totals = self._zero_counts()

    @staticmethod
    def _zero_counts() -> dict[str, float]:
        return {"responses": 0.0, "truncated": 0.0, "penalty_sum": 0.0, "filtered": 0.0}

    @override
    def on_rollouts_scored(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: ScoredRollouts
    ) -> None:
        """DAPO hook: shape ``rollouts.reward`` and mask truncated responses, in place."""
        n = len(rollouts)
        if n == 0:
            return
        max_len = (
            self.max_response_length
            if self.max_response_length is not None
            else rollouts.max_response_length
        )
        if not 0 <= self.buffer_length < max_len:
            raise ConfigError(
                f"OverlongRewardShaping.buffer_length={self.buffer_length} must be below the "
                f"maximum response length {max_len} (from "
                f"{'max_response_length' if self.max_response_length is not None else 'the sampling config max_tokens'}). "
                "Lower buffer_length or raise the maximum response length."
            )
        truncated = rollouts.truncated
        if self.apply_penalty:
            penalty = overlong_penalty(
                rollouts.response_length, max_len, self.buffer_length, self.penalty_factor
            )
            rollouts.reward.add_(penalty.to(rollouts.reward.dtype))
            penalty_sum = float(penalty.sum())
        else:
            penalty_sum = 0.0
        filtered = 0.0
        if self.overlong_filtering:
            filtered = float((truncated & rollouts.loss_mask).sum())
            rollouts.loss_mask &= ~truncated
        counts = {
            "responses": float(n),
            "truncated": float(truncated.sum()),
            "penalty_sum": penalty_sum,
            "filtered": filtered,
        }
        self._pending.add(rollouts.batch_index, counts)

    @override
    def on_rollouts_discarded(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_index: int
    ) -> None:
        """Forget the counts of rounds that will be scored again."""
        self._pending.discard(batch_index)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        p = self._pending.take(batch)
        for key, value in p.items():
            self.totals[key] += value
        if p["responses"] > 0:
            n = p["responses"]
            values = {
                "overlong/truncation_rate": p["truncated"] / n,
                "overlong/mean_penalty": p["penalty_sum"] / n,
                "overlong/filtered": p["filtered"] / n,
            }
            for name, value in values.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals), "pending": self._pending.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals = {**self._zero_counts(), **state_dict.get("totals", {})}
        self._pending.load_state_dict(state_dict.get("pending", {}))
