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
)

Row = dict[str, Any]

#: Internal row fields (matching, grouping, carried to the next step), never written: every
#: field whose name starts with ``#``.
KEY, ROUND_GROUP, DEFERRED, SOURCE = "#key", "#group", "#deferred", "#source"
#: ``extra`` keys a row shows in columns of their own.
_OWN_EXTRAS = {RESPONSE_TEXT, PROMPT_TEXT, FILTER_DECISION, EPISODE_TEXT, "has_answer"}


_PROMPT_SALT, _RESPONSE_SALT = 0x14057B7EF767814F, 0x2545F4914F6CDD1D


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
    hp = (prompt * _weights(prompt.shape[1], _PROMPT_SALT)).sum(1)
    hr = (response * _weights(response.shape[1], _RESPONSE_SALT)).sum(1)
    return hp * 1000003 + hr


def _sequence_hashes(seqs: Sequence[Sequence[int]], salt: int, from_end: bool) -> Tensor:
    """``[len(seqs)]`` int64: ``sum_t (tok_t + 1) * w[pos_t]`` per sequence, ``pos`` counted from
    its start (or its end): one flat tensor, no padding."""
    lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    flat = torch.tensor([t for x in seqs for t in x], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    pos = torch.arange(len(flat)) - (torch.cumsum(lengths, 0) - lengths)[row]
    if from_end:
        pos = lengths[row] - 1 - pos
    w = _weights(int(lengths.max()) if len(seqs) else 0, salt)
    return torch.zeros(len(seqs), dtype=torch.long).index_add_(0, row, (flat + 1) * w[pos])


def scored_fingerprints(rollouts: ScoredRollouts, rows: Sequence[int]) -> list[int]:
    """:func:`row_fingerprints` of ``rollouts``' rows ``rows`` (the same values, computed on
    the unpadded token lists)."""
    if not rows:
        return []
    hp = _sequence_hashes([rollouts.prompt_ids[i] for i in rows], _PROMPT_SALT, True)
    hr = _sequence_hashes([rollouts.response_ids[i] for i in rows], _RESPONSE_SALT, False)
    return (hp * 1000003 + hr).tolist()


def _columns(rollouts: ScoredRollouts) -> dict[str, list[Any]]:
    """Every per-response value a row takes, as plain lists (one conversion per round)."""
    n, extra = len(rollouts), rollouts.extra
    none = [None] * n
    has_answer = extra.get("has_answer", none)
    return {
        "prompt_id": rollouts.prompt_uid,
        "prompt": extra.get(PROMPT_TEXT, none),
        "response": extra.get(RESPONSE_TEXT, none),
        "score": rollouts.score.float().tolist(),
        "acc": rollouts.acc.float().tolist(),
        "has_answer": [None if h is None else bool(h) for h in has_answer],
        "finish_reason": rollouts.finish_reason,
        "length": rollouts.response_length.tolist(),
        "tool_calls": rollouts.tool_calls if rollouts.tool_calls is not None else none,
        "episode": extra.get(EPISODE_TEXT, none),
        "reward": rollouts.reward.float().tolist(),
        "in_loss": rollouts.loss_mask.tolist(),
    }


def _scalar_extras(extra: dict[str, list[Any]], i: int) -> dict[str, Any]:
    """Row ``i``'s reward extras that are a number, a bool or a string (own columns apart)."""
    out = {}
    for key, values in extra.items():
        if key in _OWN_EXTRAS:
            continue
        v = values[i] if i < len(values) else None
        if isinstance(v, (int, float, bool, str)):
            out[key] = v
    return out


_SHARED = ("prompt_id", "prompt", "response", "score", "acc", "has_answer", "finish_reason")


def _common(cols: dict[str, list[Any]], extra: dict[str, list[Any]], i: int) -> Row:
    """The fields a rollout row and a validation row share."""
    row = {k: cols[k][i] for k in _SHARED}
    row["truncated"] = row["finish_reason"] == "length"
    row["length"] = cols["length"][i]
    row["tool_calls"] = cols["tool_calls"][i]
    row["episode"] = cols["episode"][i]
    row["extra"] = _scalar_extras(extra, i)
    return row


def rollout_rows(
    rollouts: ScoredRollouts,
    round_id: int,
    dropped: bool = True,
    *,
    kept: bool = True,
    max_groups: int | None = None,
) -> list[Row]:
    """One row per response of a scored round (its shaping and filter decision final), with its
    fingerprint: the kept groups (``kept``) and the dropped ones (``dropped``), at most
    ``max_groups`` groups (None: all). ``round_id`` makes the group ids distinct across
    rounds. The rest of each row is read from the round by :func:`complete_rows` (only for the
    rows written: a step's rows are matched first, then cut)."""
    n = len(rollouts)
    decisions = rollouts.extra.get(FILTER_DECISION) or ["kept"] * n
    groups = rollouts.group_index.tolist()
    index = [i for i in range(n) if (kept if decisions[i] == "kept" else dropped)]
    if max_groups is not None:
        chosen = set(list(dict.fromkeys(groups[i] for i in index))[:max_groups])
        index = [i for i in index if groups[i] in chosen]
    kept_index = [i for i in index if decisions[i] == "kept"]
    keys = dict(zip(kept_index, scored_fingerprints(rollouts, kept_index)))
    rows = []
    for i in index:
        rows.append(
            {
                "batch_index": int(rollouts.batch_index),
                "policy_version": int(rollouts.policy_version),
                "staleness": None,
                "advantage": None,
                "filter": decisions[i],
                "trained": False,
                KEY: keys.get(i),
                ROUND_GROUP: (round_id, groups[i]),
                SOURCE: (rollouts, i),
            }
        )
    return rows


def complete_rows(rows: Iterable[Row]) -> None:
    """Fill in, in place, the rows :func:`rollout_rows` left to be read from their round
    (``SOURCE``): text, rewards, flags; only the rows written or kept are ever completed."""
    cache: dict[int, dict[str, list[Any]]] = {}
    for row in rows:
        source = row.pop(SOURCE, None)
        if source is None:
            continue
        rollouts, i = source
        cols = cache.get(id(rollouts))
        if cols is None:
            cols = cache[id(rollouts)] = _columns(rollouts)
        reward = cols["reward"][i]
        row.update(_common(cols, rollouts.extra, i))
        row.update(
            reward=reward, shaping=reward - cols["score"][i], in_loss=bool(cols["in_loss"][i])
        )


def validation_rows(rollouts: ScoredRollouts, step: int, first_group: int) -> list[Row]:
    """One row per validation response; groups numbered from ``first_group``."""
    groups = rollouts.group_index.tolist()
    cols = _columns(rollouts)
    seen: dict[int, int] = defaultdict(int)
    rows = []
    for i in range(len(rollouts)):
        g = groups[i]
        rows.append({"step": step, "group": first_group + g, "sample": seen[g]})
        rows[-1].update(_common(cols, rollouts.extra, i))
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
    complete_rows(row for group in ordered for row in group)
    out = []
    for g, group in enumerate(ordered):
        for s, row in enumerate(group):
            clean = {k: v for k, v in row.items() if not k.startswith("#")}
            out.append({"step": step, "group": g, "sample": s, **clean})
    return out
