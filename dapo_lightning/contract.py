"""The contract between the policy update and the rollout side, declared once (bottom floor:
imports nothing from the library).

The module and the data module never read each other's attributes. What passes between them:

* module -> data: a :class:`PolicyHandle`, the weights to sample with and their version, given
  by one call, :meth:`RolloutChannel.publish_policy`. ``DAPOModule`` makes it at the start of
  training and of each validation, after each optimizer update, and once after each rollout
  step's updates (its ``on_train_batch_end``, after every callback's, so a rollback there is
  included). The data side samples its next rollouts with the last handle it received; the
  weights reach the engine at the next generation (``EngineSession.generating``: woken first
  when it sleeps). With ``dynamic_sampling.pipeline: one_step_off`` the next batch is
  generated on a rollout thread while this one updates, with the handle published before the
  update, or after ``start_after_updates`` of its updates (:mod:`dapo_lightning.data.streams.one_step_off`);
  the contract is the same.
* data -> module: a :class:`RolloutSpec` (group size, batch size, prompt and response lengths:
  what every batch will be), read once before any rollout is generated,
  :meth:`RolloutChannel.rewind_rollout_batch`, called when a stop undoes the step under way,
  and :meth:`RolloutChannel.core_share`, the update's share of the cores while rollouts are
  generated beside it (a :class:`CoreShare`; None in ``sync`` mode), which the module hands
  to each step's update.

The trainer is the only object both sides know; :func:`rollout_channel` is the one place that
looks the channel up on it (the module does so in its ``setup``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class PolicyHandle:
    """The weights rollouts are sampled with, and their version.

    Args:
        policy: The policy module (possibly wrapped or sharded: the engine session gathers
            full tensors from it, a collective under sharding).
        version: Weight changes so far (updates applied, plus rollbacks); every rollout sampled
            with these weights is stamped with it.
    """

    policy: nn.Module
    version: int


@dataclass(frozen=True)
class RolloutSpec:
    """What every rollout batch of a run will be, declared by the data side.

    Args:
        group_size: Responses per prompt (``data.dynamic_sampling.n``).
        train_batch_size: Prompts of a full rollout step over all ranks
            (``data.dynamic_sampling.train_batch_size``).
        max_prompt_length: Most prompt tokens (``data.prompts.max_prompt_length``).
        max_response_tokens: Most response tokens (``data.sampling.max_tokens``).
    """

    group_size: int
    train_batch_size: int
    max_prompt_length: int
    max_response_tokens: int


class CoreShare(Protocol):
    """The update's share of the process's cores while a rollout thread may generate beside
    it (:class:`~dapo_lightning.shared_cores.SharedCores` implements it)."""

    def fit_update(self) -> int:
        """On the update's thread, before each micro-batch: set its intra-op threads to its
        share now (fewer while the rollout thread generates); returns the count."""
        ...


@runtime_checkable
class RolloutChannel(Protocol):
    """What the update asks of the rollout side (``DAPODataModule`` implements it)."""

    def rollout_spec(self) -> RolloutSpec:
        """The shape of the batches to come (before any rollout is generated)."""
        ...

    def publish_policy(self, handle: PolicyHandle) -> None:
        """Sample the rollouts from now on with ``handle``'s weights, stamped with its version."""
        ...

    def rewind_rollout_batch(self) -> None:
        """Undo the last batch's generation: the next one draws the same prompts and samples."""
        ...

    def core_share(self) -> CoreShare | None:
        """The update's share of the cores for the step to come (rollouts generated beside
        the update, one-step-off), or None: the update keeps its threads."""
        ...


def rollout_channel(trainer: Any) -> RolloutChannel | None:
    """The trainer's data module when it is a :class:`RolloutChannel`, else None (a data
    module of your own that yields ready ``RolloutBatch`` es: nothing to publish to)."""
    data = getattr(trainer, "datamodule", None) if trainer is not None else None
    return data if isinstance(data, RolloutChannel) else None
