"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_lightning.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (tokenizer + float32 model, tied embeddings) written once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
