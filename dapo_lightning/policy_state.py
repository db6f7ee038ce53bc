"""The run state of the trained policy, with one owner: :class:`PolicyState`.

The update loop (:class:`~dapo_lightning.update_loop.UpdateLoop`) owns it and advances it: the
policy version after each applied update, the skipped updates, the rollout steps. Callbacks
change it only through its declared calls, between updates: ``EntropyScheduler``
:meth:`PolicyState.set_entropy_coef`, ``CollapseDetector`` :meth:`PolicyState.bump_version`
after a rollback. A callback reaches it through ``pl_module`` (Lightning hands every hook the
module): :func:`policy_state_of` for a callback that needs it, ``isinstance(pl_module,
HoldsPolicyState)`` for one that only uses it where there is one.

It is saved in a checkpoint's ``"dapo"`` entry (beside the global RNGs) with the keys
``policy_version``, ``rollout_step``, ``skipped_updates``, ``entropy_coef``, and it is part of
a rollout step's start copy (:class:`~dapo_lightning.step_guard.StepStart`), so a stop inside a
step puts it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["HoldsPolicyState", "PolicyState", "policy_state_of"]


@dataclass
class PolicyState:
    """What a run has done to its policy, and the entropy weight its next update uses.

    Attributes:
        version: Weight changes so far (updates applied, plus rollbacks): the version stamped
            on rollouts sampled after them.
        skipped_updates: Updates skipped for a non-finite gradient norm or weights.
        entropy_coef: Weight of the entropy bonus of the next update.
        rollout_step: Rollout steps (training steps) done.
    """

    version: int = 0
    skipped_updates: int = 0
    entropy_coef: float = 0.0
    rollout_step: int = 0

    def bump_version(self) -> int:
        """Count a weight change that is no update (a rollback): rollouts sampled from now on
        carry the new version and the data side is handed the new weights. Returns it."""
        self.version += 1
        return self.version

    def set_entropy_coef(self, value: float) -> None:
        """Weight the entropy bonus of the next updates with ``value``."""
        self.entropy_coef = float(value)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint form (keys of a checkpoint's ``"dapo"`` entry)."""
        return {
            "policy_version": self.version,
            "rollout_step": self.rollout_step,
            "skipped_updates": self.skipped_updates,
            "entropy_coef": self.entropy_coef,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a key that is missing (an older checkpoint) leaves
        counts at 0 and the entropy weight as it is."""
        self.version = int(state.get("policy_version", 0))
        self.rollout_step = int(state.get("rollout_step", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.entropy_coef = float(state.get("entropy_coef", self.entropy_coef))


@runtime_checkable
class HoldsPolicyState(Protocol):
    """A LightningModule whose :class:`PolicyState` callbacks read and change
    (:class:`~dapo_lightning.module.DAPOModule`, or a user's module with a ``policy_state``)."""

    @property
    def policy_state(self) -> PolicyState:
        """The run state of the trained policy."""


def policy_state_of(module: object, needed_by: str) -> PolicyState:
    """``module.policy_state``; raise :class:`TypeError` naming ``needed_by`` (a callback)
    when ``module`` holds none (a LightningModule that is no DAPOModule)."""
    if not isinstance(module, HoldsPolicyState):
        raise TypeError(
            f"{needed_by} needs a LightningModule with a `policy_state` (a "
            f"dapo_lightning.policy_state.PolicyState, as DAPOModule has); "
            f"{type(module).__name__} has none."
        )
    return module.policy_state
