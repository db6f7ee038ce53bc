"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_lightning.testing import make_tiny_checkpoint, tiny_num_parameters
from dapo_lightning.threads import apply_threads, choose_threads

# The library's default for what the tests train in process (tiny models: dapo_lightning/
# threads.py), as the CLI chooses it; OMP_NUM_THREADS / MKL_NUM_THREADS win when set.
apply_threads(choose_threads(tiny_num_parameters()), export=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (tokenizer + float32 model, tied embeddings) written once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
