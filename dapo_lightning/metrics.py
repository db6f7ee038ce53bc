"""Metrics of one optimizer update, reduced explicitly over micro-batches and ranks.

Each metric has one reduce operation, named where it is added:

* ``mean``: weighted mean, ``sum_i w_i x_i / sum_i w_i`` over every micro-batch of every rank;
  the weight of a per-token metric is its micro-batch's token count, so a rank with 1000
  tokens at 0.0 and one with 10 tokens at 1.0 give ``10 / 1010 = 0.0099`` (not 0.5);
* ``sum``: ``sum_i x_i``;
* ``max`` / ``min``: over all micro-batches and ranks.

Reducing over ranks is three collectives (sum, max, min) whatever the number of metrics. Every
rank must add the same names in the same order (add a metric with weight 0 on a rank that has
nothing to say).

Where it is used, and why not ``torchmetrics``: the metrics of every update and of every rollout
step (about 45 a step, logged each step) are reduced here, because that measures cheaper: the
same 45 as ``torchmetrics`` objects are synced one state at a time (about 80 collectives), 401 ms
against 3.4 ms for this class's three, on two gloo ranks of a 2-core machine
(``benchmarks/metric_sync_cost.py``, median of 30, 119x). Validation, computed once per
validation, uses ``torchmetrics`` the Lightning way
(:class:`~dapo_lightning.data.metrics.ValidationMetrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from torch import Tensor

ReduceOp = Literal["mean", "sum", "max", "min"]
#: ``reduce(tensor, op)`` across ranks, op one of ``"sum"``, ``"max"``, ``"min"``.
RankReduce = Callable[[Tensor, str], Tensor]


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
        highs = torch.tensor([self._value[n] for n in by_op["max"]], dtype=torch.float64)
        lows = torch.tensor([self._value[n] for n in by_op["min"]], dtype=torch.float64)
        if rank_reduce is not None:
            sums, highs, lows = (
                rank_reduce(sums, "sum"),
                rank_reduce(highs, "max"),
                rank_reduce(lows, "min"),
            )
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
