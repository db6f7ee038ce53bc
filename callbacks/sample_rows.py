"""The rows :class:`~dapo_lightning.callbacks.sample_log.SampleLog` writes: one JSON object per
sample (pure functions, no file and no trainer).

A rollout row (``rollouts-rank<r>.jsonl``) holds what one sampled response was, what it scored
and what the step did with it:

================  ============================================================================
``step``          the rollout step that wrote it (``rollout/step`` of metrics.csv)
``batch_index``   the rollout batch its round was generated for (the producer's count)
``group``         its group within the step's rows (0, 1, ...), ``sample`` its place in it
``policy_version`` the weight version it was sampled with
``staleness``     versions behind the policy that trained on it (null: not trained)
``prompt_id``     the prompt's uid; ``prompt`` its text (chat messages as ``role: content``)
``response``      the response text the reward scored
``reward``        the shaped reward the advantages use; ``score`` the task reward;
                  ``shaping`` = reward - score (the overlong penalty of
                  ``OverlongRewardShaping``); ``has_answer`` the reward's format flag (or null)
``acc``           1.0 where the answer is right
``advantage``     its advantage in the update (null where not trained)
``filter``        the dynamic-sampling filter's decision: ``kept`` or ``dropped: acc all 1``
``trained``       trained on in this step (a kept group may be carried to the next step)
``in_loss``       False where a callback removed it from the loss (overlong filtering)
``truncated``     it hit the maximum response length; ``finish_reason``; ``length`` (tokens
                  the policy sampled)
``tool_calls``    tool calls of its episode (multi-turn environments only; else null)
``episode``       its episode's whole exchange as text: assistant turns and the environment's
                  observations (multi-turn environments only; else null)
``extra``         the reward's other per-sample values (``pred``, ...)
================  ============================================================================

A validation row (``validation-rank<r>.jsonl``): ``step``, ``group``, ``sample``,
``prompt_id``, ``prompt``, ``response``, ``score``, ``acc`` (its correctness), ``has_answer``,
``truncated``, ``finish_reason``, ``length``, ``tool_calls``, ``episode``, ``extra``.

Which trained row is which scored row: the data side hands the module a padded
:class:`~dapo_lightning.batch.RolloutBatch` (carried groups first, a tensor-parallel rank's
share of rows), so rows are matched by a fingerprint of their prompt and response tokens
(:func:`row_fingerprints`), the same function over the batch tensors and over the scored rounds
padded the same way; identical samples share an advantage only where they share a group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from dapo_lightning.batch import (
    EPISODE_TEXT,
    FILTER_DECISION,
    PROMPT_TEXT,
    RESPONSE_TEXT,
    ScoredRollouts,
    pad_sequences,
)

Row = dict[str, Any]

#: Internal row fields (matching, grouping, carried to the next step), never written: every
#: field whose name starts with ``#``.
KEY, ROUND_GROUP, DEFERRED = "#key", "#group", "#deferred"
#: ``extra`` keys a row shows in columns of their own.
_OWN_EXTRAS = {RESPONSE_TEXT, PROMPT_TEXT, FILTER_DECISION, EPISODE_TEXT, "has_answer"}


def _weights(n: int, salt: int) -> Tensor:
    """``n`` pseudo-random int64 weights (fixed: the same on every call and process)."""
    w = torch.arange(1, n + 1, dtype=torch.int64) * 6364136223846793005 + salt
    return w ^ (w >> 29)


def row_fingerprints(input_ids: Tensor, attention_mask: Tensor, response_width: int) -> Tensor:
    """``[B]`` int64: a hash of each row's prompt and response tokens in the ``[left-padded
    prompt | right-padded response]`` layout (:func:`~dapo_lightning.batch.pad_sequences`),
    independent of the padding widths (int64 arithmetic wraps)."""
    ids = (input_ids.long() + 1) * attention_mask.long()
    split = ids.shape[1] - response_width
    prompt, response = ids[:, :split].flip(1), ids[:, split:]
    hp = (prompt * _weights(prompt.shape[1], 0x14057B7EF767814F)).sum(1)
    hr = (response * _weights(response.shape[1], 0x2545F4914F6CDD1D)).sum(1)
    return hp * 1000003 + hr


def scored_fingerprints(rollouts: ScoredRollouts, rows: Sequence[int]) -> list[int]:
    """:func:`row_fingerprints` of ``rollouts``' rows ``rows``."""
    if not rows:
        return []
    prompts = [rollouts.prompt_ids[i] for i in rows]
    responses = [rollouts.response_ids[i] for i in rows]
    ids, mask, _ = pad_sequences(prompts, responses, [[1] * len(r) for r in responses], 0)
    width = max(1, max(len(r) for r in responses))
    return row_fingerprints(ids, mask, width).tolist()


def _scalar_extras(extra: dict[str, list[Any]], i: int) -> dict[str, Any]:
    """Row ``i``'s reward extras that are a number, a bool or a string (own columns apart)."""
    out = {}
    for key, values in extra.items():
        v = values[i] if i < len(values) else None
        if key not in _OWN_EXTRAS and isinstance(v, (int, float, bool, str)):
            out[key] = v
    return out


def _common(rollouts: ScoredRollouts, i: int) -> Row:
    """The fields a rollout row and a validation row share."""
    extra = rollouts.extra
    has_answer = extra.get("has_answer", [None] * len(rollouts))[i]
    return {
        "prompt_id": rollouts.prompt_uid[i],
        "prompt": extra.get(PROMPT_TEXT, [None] * len(rollouts))[i],
        "response": extra.get(RESPONSE_TEXT, [None] * len(rollouts))[i],
        "score": float(rollouts.score[i]),
        "acc": float(rollouts.acc[i]),
        "has_answer": None if has_answer is None else bool(has_answer),
        "truncated": rollouts.finish_reason[i] == "length",
        "finish_reason": rollouts.finish_reason[i],
        "length": int(rollouts.response_length[i]),
        "tool_calls": None if rollouts.tool_calls is None else int(rollouts.tool_calls[i]),
        "episode": extra.get(EPISODE_TEXT, [None] * len(rollouts))[i],
        "extra": _scalar_extras(extra, i),
    }


def rollout_rows(rollouts: ScoredRollouts, round_id: int, dropped: bool = True) -> list[Row]:
    """One row per response of a scored round (its shaping and filter decision final), with its
    fingerprint; ``dropped=False`` leaves out the groups the filter dropped. ``round_id`` makes
    the group ids distinct across rounds."""
    n = len(rollouts)
    decisions = rollouts.extra.get(FILTER_DECISION, ["kept"] * n)
    index = [i for i in range(n) if dropped or decisions[i] == "kept"]
    kept_index = [i for i in index if decisions[i] == "kept"]
    keys = dict(zip(kept_index, scored_fingerprints(rollouts, kept_index)))
    groups = rollouts.group_index.tolist()
    rows = []
    for i in index:
        reward = float(rollouts.reward[i])
        row = {
            "batch_index": int(rollouts.batch_index),
            "policy_version": int(rollouts.policy_version),
            "staleness": None,
            **_common(rollouts, i),
            "reward": reward,
            "shaping": reward - float(rollouts.score[i]),
            "advantage": None,
            "filter": decisions[i],
            "trained": False,
            "in_loss": bool(rollouts.loss_mask[i]),
            KEY: keys.get(i),
            ROUND_GROUP: (round_id, groups[i]),
        }
        rows.append(row)
    return rows


def validation_rows(rollouts: ScoredRollouts, step: int, first_group: int) -> list[Row]:
    """One row per validation response; groups numbered from ``first_group``."""
    groups = rollouts.group_index.tolist()
    seen: dict[int, int] = defaultdict(int)
    rows = []
    for i in range(len(rollouts)):
        g = groups[i]
        rows.append({"step": step, "group": first_group + g, "sample": seen[g]})
        rows[-1].update(_common(rollouts, i))
        seen[g] += 1
    return rows


def mark_trained(
    rows: Iterable[Row], batch_keys: Sequence[int], advantages: Sequence[float], version: int
) -> None:
    """Set ``trained``, ``advantage`` and ``staleness`` (``version`` minus the row's sample
    version) of the rows the batch holds: its rows ``batch_keys`` (fingerprints) with
    ``advantages``, each batch row matched once, in order."""
    left: dict[int, list[float]] = defaultdict(list)
    for key, adv in zip(batch_keys, advantages):
        left[int(key)].append(float(adv))
    for row in rows:
        key = row.get(KEY)
        if key is not None and left.get(key):
            row["trained"] = True
            row["advantage"] = left[key].pop(0)
            row["staleness"] = version - row["policy_version"]


def step_rows(rows: Sequence[Row], step: int, max_groups: int | None) -> list[Row]:
    """The rows to write for rollout step ``step``: whole groups, trained ones first, then the
    other kept ones, then the dropped ones, at most ``max_groups`` (None: all); each row given
    its ``step``, ``group`` and ``sample`` and stripped of the internal fields."""
    by_group: dict[Any, list[Row]] = {}
    for row in rows:
        by_group.setdefault(row[ROUND_GROUP], []).append(row)

    def rank(group: list[Row]) -> int:
        if any(r["trained"] for r in group):
            return 0
        return 1 if group[0]["filter"] == "kept" else 2

    ordered = sorted(by_group.values(), key=rank)  # stable: scoring order within a rank
    if max_groups is not None:
        ordered = ordered[:max_groups]
    out = []
    for g, group in enumerate(ordered):
        for s, row in enumerate(group):
            clean = {k: v for k, v in row.items() if not k.startswith("#")}
            out.append({"step": step, "group": g, "sample": s, **clean})
    return out
