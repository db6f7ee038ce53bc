"""The global RNG states (Python ``random``, NumPy, torch CPU and CUDA): collected into a
checkpoint's ``"dapo"`` entry and a rollout step's start copy, and put back from them (the
rollout engine's own generator is the data module's)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["GLOBAL_RNGS", "GlobalRngs", "collect_rng_states", "restore_rng_states"]


def collect_rng_states() -> dict[str, Any]:
    """The global RNG states (Python ``random``, NumPy, torch CPU and CUDA) as plain objects
    (tensors, lists, tuples, numbers, strings), so a checkpoint holding them still loads with
    ``torch.load(..., weights_only=True)``."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_states(state: dict[str, Any]) -> None:
    """Restore what :func:`collect_rng_states` returned (missing entries are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


class GlobalRngs:
    """The global RNGs as a stateful object (``state_dict``: :func:`collect_rng_states`,
    ``load_state_dict``: :func:`restore_rng_states`), for a rollout step's start copy
    (:class:`~dapo_lightning.step_guard.StepStart`)."""

    def state_dict(self) -> dict[str, Any]:
        """The global RNG states now."""
        return collect_rng_states()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back the global RNG states of :meth:`state_dict`."""
        restore_rng_states(state)


#: The one :class:`GlobalRngs` (it holds no state of its own).
GLOBAL_RNGS = GlobalRngs()
