"""Settings pickled by older releases, mapped onto today's settings groups when they load.

A checkpoint keeps the data module's hyper-parameters as pickled objects (``torch.load`` with
``weights_only`` and the allow-listed classes). Configs saved before prompt selection was its
own group hold the flat keys of :data:`LEGACY_SELECTION_KEYS`, and those saved before the
one-step-off settings were grouped a flat ``share_cores``; :func:`group_legacy_settings` moves
them under ``selection`` and ``one_step_off``. A one-step-off checkpoint's batch in flight
saved before ``RolloutBatch.finish`` holds a ``truncated`` mask instead:
:func:`legacy_ready_batch` maps it.
"""

from __future__ import annotations

from typing import Any

from dapo_lightning.data.difficulty import PromptSelectionConfig
from dapo_lightning.data.one_step_off import OneStepOffConfig

#: Flat ``dynamic_sampling`` keys of configs saved before prompt selection was its own group
#: -> their field of ``dynamic_sampling.selection`` (:class:`PromptSelectionConfig`).
LEGACY_SELECTION_KEYS: dict[str, str] = {
    "selection": "strategy",
    "max_skip": "max_skip",
    "revisit_within": "revisit_within",
    "retire_after": "retire_after",
    "park_after": "park_after",
    "revisit_every": "revisit_every",
}


#: Flat ``dynamic_sampling`` keys of configs saved before the one-step-off settings were
#: grouped -> their field of ``dynamic_sampling.one_step_off`` (:class:`OneStepOffConfig`).
LEGACY_ONE_STEP_OFF_KEYS = ("share_cores", "start_after_updates")


def group_legacy_settings(state: dict[str, Any]) -> dict[str, Any]:
    """An unpickled ``DynamicSamplingConfig`` state with its settings groups: a flat one
    (``selection`` a string, ``max_skip``, ...; ``share_cores``) gets a
    :class:`PromptSelectionConfig` and a :class:`OneStepOffConfig` of those keys; today's
    state is returned as it is (a copy)."""
    state = dict(state)
    if not isinstance(state.get("selection"), PromptSelectionConfig):
        legacy = LEGACY_SELECTION_KEYS.items()
        state["selection"] = PromptSelectionConfig(
            **{new: state.pop(old) for old, new in legacy if old in state}
        )
    if not isinstance(state.get("one_step_off"), OneStepOffConfig):
        flat = {key: state.pop(key) for key in LEGACY_ONE_STEP_OFF_KEYS if key in state}
        state["one_step_off"] = OneStepOffConfig(**flat)
    return state


def legacy_ready_batch(fields: dict[str, Any]) -> dict[str, Any]:
    """A saved ``RolloutBatch``'s fields with a legacy ``truncated`` ``[B]`` bool mask turned
    into ``finish`` codes (1 where truncated, else 0: "stop"; no demonstrations then); today's
    fields are returned as they are (a copy)."""
    fields = dict(fields)
    if "truncated" in fields:
        fields["finish"] = fields.pop("truncated").long()
    return fields
