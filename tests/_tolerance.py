"""Tolerances derived from what a float32 computation can differ by, not tuned to one machine.

Two evaluations of the same float32 sum that add its ``n`` terms in another order (another
GEMM blocking, another vector width, another split over micro-batches or ranks) each carry a
rounding error of at most ``(n - 1) * u * sum |term|`` with ``u = eps / 2`` (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), so they lie within ``n * eps`` of
each other relative to the sum of magnitudes. A tolerance of ``n * eps`` holds on every CPU;
the bugs these tests exist to catch (a per-micro-batch or per-rank mean, a lost token) move
the result by orders of magnitude more, and each test pins that margin against its negative
control.
"""

from __future__ import annotations

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23 = 1.19e-07


def float32_reorder_bound(terms: int) -> float:
    """The relative difference two float32 evaluations of one sum of ``terms`` terms can show
    when they add them in another order: ``terms * eps`` (module docstring).

    Example: a parameter gradient sums one term per token of the batch, so a batch of 330
    tokens gives ``330 * 1.19e-07 = 3.9e-05``.
    """
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    return terms * FLOAT32_EPS
