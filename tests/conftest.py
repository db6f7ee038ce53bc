"""Shared pytest fixtures: the tiny checkpoint, and the harness (tests/_harness.py: the base run
config, the CLI fit, the in-process fit; tests/_module_harness.py: fixed rollout batches) as
fixtures."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from lightning.pytorch import LightningDataModule, Trainer

from dapo_lightning.sandbox import close_shared_sandboxes
from dapo_lightning.testing import make_tiny_checkpoint, tiny_num_parameters
from dapo_lightning.threads import apply_threads, choose_threads
from tests import _harness, _module_harness

# The library's default for what the tests train in process (tiny models: dapo_lightning/
# threads.py), as the CLI chooses it; OMP_NUM_THREADS / MKL_NUM_THREADS win when set.
apply_threads(choose_threads(tiny_num_parameters()), export=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (tokenizer + float32 model, tied embeddings) written once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint of this test module's own (its runs may write next to it)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture
def run_yaml(tmp_path: Path) -> Callable[..., Path]:
    """Write the base run config (tests/_harness.py ``write_run_config``) into ``tmp_path``:
    ``run_yaml(run_dir, model_dir, **overrides) -> path`` (``name=`` names the file, ``base=``
    picks ``ARITHMETIC_RUN`` instead of ``TINY_RUN``)."""

    def write(
        run_dir: Path | str | None = None,
        model_dir: Path | str | None = None,
        name: str = "override.yaml",
        base: dict[str, Any] = _harness.TINY_RUN,
        **overrides: Any,
    ) -> Path:
        return _harness.write_run_config(tmp_path / name, run_dir, model_dir, base, **overrides)

    return write


@pytest.fixture
def fit_cli() -> Callable[..., subprocess.CompletedProcess]:
    """A short, checked fit through the console script (tests/_harness.py ``fit_cli``)."""
    return _harness.fit_cli


@pytest.fixture
def fit_module() -> Callable[..., Trainer]:
    """Fit a module in this process on a quiet CPU Trainer (tests/_harness.py ``fit``)."""
    return _harness.fit


@pytest.fixture
def module_harness() -> ModuleType:
    """tests/_module_harness.py: fixed rollout batches (``fixed_batch``, ``FixedBatches``),
    ``fit_update`` (the parameter update of a short fit) and ``sgd``."""
    return _module_harness


@pytest.fixture
def fixed_batches() -> Callable[..., LightningDataModule]:
    """``fixed_batches(seed=0, steps=1)``: the module harness's data module serving the fixed
    rollout batch of ``seed`` for ``steps`` steps."""

    def make(seed: int = 0, steps: int = 1) -> LightningDataModule:
        return _module_harness.FixedBatches(_module_harness.fixed_batch(seed), steps=steps)

    return make


@pytest.fixture(autouse=True)
def _no_seed_from_an_earlier_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """``seed_everything`` (an in-process CLI run) leaves ``PL_GLOBAL_SEED`` in the environment,
    and a data module without ``seed`` takes it: no test sees another test's seed."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


@pytest.fixture(scope="module", autouse=True)
def _no_warm_sandboxes_left_to_the_next_file():
    """A test file's shared sandboxes (a python tool's or a code reward's warm pool) are closed
    when it ends: the sandbox catalogue counts the interpreters its worker process holds."""
    yield
    close_shared_sandboxes()
