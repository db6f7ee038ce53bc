"""Metrics of one optimizer update, reduced explicitly over micro-batches and ranks.

Each metric has one reduce operation, named where it is added:

* ``mean``: weighted mean, ``sum_i w_i x_i / sum_i w_i`` over every micro-batch of every rank;
  the weight of a per-token metric is its micro-batch's token count, so a rank with 1000
  tokens at 0.0 and one with 10 tokens at 1.0 give ``10 / 1010 = 0.0099`` (not 0.5);
* ``sum``: ``sum_i x_i``;
* ``max`` / ``min``: over all micro-batches and ranks.

Reducing over ranks is three collectives whatever the number of metrics: a check that every
rank added the same names with the same ops in the same order (a fixed-size digest of them,
:func:`names_digest`), the sums, and the maxima with the negated minima. A rank that has nothing
to say adds the metric with weight 0; a metric added on some ranks only fails the reduce with
:class:`MetricNamesMismatch` naming it and the ranks that lack it, on every rank, instead of a
collective of mismatched sizes (a gloo abort, or a hang).

Where it is used, and why not ``torchmetrics``: the metrics of every update and of every rollout
step (about 45 a step, logged each step) are reduced here, because that measures cheaper: the
same 45 as ``torchmetrics`` objects are synced one state at a time (about 80 collectives), 401 ms
against 3.4 ms for this class's three, on two gloo ranks of a 2-core machine
(``benchmarks/metric_sync_cost.py``, median of 30, 119x). Validation, computed once per
validation, uses ``torchmetrics`` the Lightning way
(:class:`~dapo_lightning.data.sampling.metrics.ValidationMetrics`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from dapo_lightning.ranks import gather_objects

ReduceOp = Literal["mean", "sum", "max", "min"]
#: ``reduce(tensor, op)`` across ranks, op one of ``"sum"``, ``"max"``, ``"min"``.
RankReduce = Callable[[Tensor, str], Tensor]


class MetricNamesMismatch(RuntimeError):
    """The ranks added different metric names (or ops, or orders) before one reduce."""


def names_digest(entries: Sequence[str]) -> float:
    """A 48-bit digest of ``entries`` (``name:op`` in order) as an exactly representable
    float64: equal on two ranks iff (but for a 2^-48 chance) their lists are equal."""
    digest = hashlib.blake2b("\n".join(entries).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def describe_mismatch(per_rank: Sequence[Sequence[str]]) -> str:
    """The message of :class:`MetricNamesMismatch` for each rank's ``name:op`` list: the first
    entry some ranks lack (and which), or the first position where the orders differ."""
    union: list[str] = []
    for entries in per_rank:
        union += [e for e in entries if e not in union]
    for entry in union:
        lacking = [r for r, entries in enumerate(per_rank) if entry not in entries]
        if lacking:
            having = [r for r in range(len(per_rank)) if r not in lacking]
            more = sum(any(e not in x for x in per_rank) for e in union) - 1
            name, _, op = entry.rpartition(":")
            return (
                f"metric {name!r} (op {op}) was added on rank(s) {having} but not on rank(s) "
                f"{lacking}" + (f" ({more} more differ)" if more > 0 else "") + ": every rank "
                "must add the same metrics before a reduce; add it with weight 0 on a rank that "
                "has nothing to say (a metric added under a rank-local condition is the usual "
                "cause)."
            )
    return (
        "the ranks added the same metrics in different orders (rank 0: "
        f"{list(per_rank[0])[:5]}...): add them in one fixed order on every rank."
    )


class MetricAccumulator:
    """Accumulates named metrics with explicit reduce operations (see the module docstring).

    Example::

        acc = MetricAccumulator()
        acc.add("entropy", 0.7, weight=1000)    # a micro-batch of 1000 tokens
        acc.add("ratio_max", 1.3, op="max")
        acc.reduce()                             # {"entropy": 0.7, "ratio_max": 1.3}
    """

    def __init__(self) -> None:
        self._ops: dict[str, ReduceOp] = {}
        self._value: dict[str, float] = {}
        self._weight: dict[str, float] = {}

    def add(self, name: str, value: float, *, op: ReduceOp = "mean", weight: float = 1.0) -> None:
        """Add one observation of ``name`` (``weight`` only matters for ``mean``).

        Raises:
            ValueError: ``op`` is unknown or differs from the op ``name`` was first added with.
        """
        if op not in ("mean", "sum", "max", "min"):
            raise ValueError(f"unknown reduce op {op!r}: one of mean, sum, max, min.")
        known = self._ops.setdefault(name, op)
        if known != op:
            raise ValueError(f"metric {name!r} was added with op {known!r}, now {op!r}.")
        value = float(value)
        if name not in self._value:
            self._value[name] = value * weight if op == "mean" else value
            self._weight[name] = weight
            return
        if op == "mean":
            self._value[name] += value * weight
            self._weight[name] += weight
        elif op == "sum":
            self._value[name] += value
        else:
            self._value[name] = (max if op == "max" else min)(self._value[name], value)

    def add_all(
        self, values: Mapping[str, float | Tensor], ops: Mapping[str, ReduceOp], weight: float
    ) -> None:
        """Add every entry of ``values`` with its op from ``ops`` (default ``mean``)."""
        for name, value in values.items():
            self.add(name, float(value), op=ops.get(name, "mean"), weight=weight)

    def reduce(self, rank_reduce: RankReduce | None = None) -> dict[str, float]:
        """The reduced metrics; ``rank_reduce`` combines the ranks (None: this rank only)."""
        names = list(self._ops)
        by_op = {
            op: [n for n in names if self._ops[n] == op] for op in ("mean", "sum", "max", "min")
        }
        sums = torch.tensor(
            [self._value[n] for n in by_op["mean"]]
            + [self._weight[n] for n in by_op["mean"]]
            + [self._value[n] for n in by_op["sum"]],
            dtype=torch.float64,
        )
        extremes = torch.tensor(
            [self._value[n] for n in by_op["max"]] + [-self._value[n] for n in by_op["min"]],
            dtype=torch.float64,
        )
        if rank_reduce is not None:
            self.check_names(rank_reduce)
            sums, extremes = rank_reduce(sums, "sum"), rank_reduce(extremes, "max")
        highs, lows = extremes[: len(by_op["max"])], -extremes[len(by_op["max"]) :]
        k = len(by_op["mean"])
        out: dict[str, float] = {}
        for i, n in enumerate(by_op["mean"]):
            weight = float(sums[k + i])
            out[n] = float(sums[i]) / weight if weight > 0 else 0.0
        for i, n in enumerate(by_op["sum"]):
            out[n] = float(sums[2 * k + i])
        out.update(zip(by_op["max"], highs.tolist()))
        out.update(zip(by_op["min"], lows.tolist()))
        return {n: out[n] for n in names}

    def check_names(self, rank_reduce: RankReduce) -> None:
        """Raise :class:`MetricNamesMismatch` on every rank unless every rank added the same
        ``name:op`` entries in the same order (one fixed-size collective; on a mismatch the
        lists are gathered to name what differs)."""
        entries = [f"{n}:{op}" for n, op in self._ops.items()]
        count, digest = float(len(entries)), names_digest(entries)
        header = torch.tensor([count, digest, -count, -digest], dtype=torch.float64)
        high = rank_reduce(header, "max").tolist()
        if high[0] == count == -high[2] and high[1] == digest == -high[3]:
            return
        raise MetricNamesMismatch(describe_mismatch(gather_objects(entries)))
