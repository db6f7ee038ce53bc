"""What checkpoints written by older releases name that has moved, mapped when they load.

* **Moved modules.** A checkpoint keeps the data module's hyper-parameters as pickled objects,
  each class named by its module path. The data package was regrouped into sub-packages
  (``prompts``, ``selection``, ``sampling``, ``streams``); :data:`MOVED_MODULES` maps each
  former module to its home, and :func:`alias_moved_modules` (run when ``dapo_lightning.data``
  is imported) makes the former paths resolve, for ``torch.load`` with and without
  ``weights_only``.
* **Regrouped settings**: :func:`~dapo_lightning.data.sampling.settings.group_legacy_settings`.
* **A batch in flight** saved before ``RolloutBatch.finish`` holds a ``truncated`` mask instead:
  :func:`legacy_ready_batch` maps it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import torch

#: Former module -> its home since the data package's sub-packages (issue 55).
MOVED_MODULES: dict[str, str] = {
    "dapo_lightning.data.config": "dapo_lightning.data.prompts.config",
    "dapo_lightning.data.sources": "dapo_lightning.data.prompts.sources",
    "dapo_lightning.data.loading": "dapo_lightning.data.prompts.loading",
    "dapo_lightning.data.sampler": "dapo_lightning.data.selection.sampler",
    "dapo_lightning.data.difficulty": "dapo_lightning.data.selection.difficulty",
    "dapo_lightning.data.draw": "dapo_lightning.data.sampling.draw",
    "dapo_lightning.data.dynamic_sampling": "dapo_lightning.data.sampling.settings",
    "dapo_lightning.data.one_step_off": "dapo_lightning.data.sampling.settings",
    "dapo_lightning.data.producer": "dapo_lightning.data.sampling.producer",
    "dapo_lightning.data.rounds": "dapo_lightning.data.sampling.rounds",
    "dapo_lightning.data.scoring": "dapo_lightning.data.sampling.scoring",
    "dapo_lightning.data.rollout_groups": "dapo_lightning.data.sampling.groups",
    "dapo_lightning.data.carry_over": "dapo_lightning.data.sampling.carry_over",
    "dapo_lightning.data.end_game": "dapo_lightning.data.sampling.end_game",
    "dapo_lightning.data.round_report": "dapo_lightning.data.sampling.round_report",
    "dapo_lightning.data.step_stats": "dapo_lightning.data.sampling.step_stats",
    "dapo_lightning.data.metrics": "dapo_lightning.data.sampling.metrics",
    "dapo_lightning.data.rank_layout": "dapo_lightning.data.sampling.rank_layout",
    "dapo_lightning.data.stream": "dapo_lightning.data.streams.stream",
    "dapo_lightning.data.pipeline": "dapo_lightning.data.streams.one_step_off",
}


def alias_moved_modules() -> None:
    """Make every former module path of :data:`MOVED_MODULES` name its home module (pickles
    import it by that path), and allow each of the home's ``weights_only`` classes under its
    former name too (``torch.load(weights_only=True)`` matches the full name)."""
    allowed = {g for g in torch.serialization.get_safe_globals() if not isinstance(g, tuple)}
    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(new)
        sys.modules.setdefault(old, module)
        classes = inspect.getmembers(module, inspect.isclass)
        own = [(n, c) for n, c in classes if c.__module__ == new and c in allowed]
        torch.serialization.add_safe_globals([(cls, f"{old}.{name}") for name, cls in own])


def legacy_ready_batch(fields: dict[str, Any]) -> dict[str, Any]:
    """A saved ``RolloutBatch``'s fields with a legacy ``truncated`` ``[B]`` bool mask turned
    into ``finish`` codes (1 where truncated, else 0: "stop"; no demonstrations then); today's
    fields are returned as they are (a copy)."""
    fields = dict(fields)
    if "truncated" in fields:
        fields["finish"] = fields.pop("truncated").long()
    return fields
