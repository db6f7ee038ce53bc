"""Test-only rewards of tests/test_bad_inputs_catalogue.py, loaded by class path in CLI fits."""

from __future__ import annotations

from typing import Any


class Unreachable:
    """Raises on every call (a reward whose backend is down)."""

    def __call__(self, responses: list[str], ground_truths: list[str], **kw: Any) -> list[float]:
        raise ValueError("reward backend unreachable")
