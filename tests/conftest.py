"""Shared pytest fixtures: the tiny checkpoint, the quickstart's warmed-up model, and the harness
(tests/_harness.py: the base run config, the CLI fit, the in-process fit;
tests/_module_harness.py: fixed rollout batches) as fixtures.

The quickstart's warm-up (a deterministic fit of 1-3 minutes on 2 cores) runs at most once per
test run and settings: the run shares one warm-up cache folder
(:mod:`dapo_lightning.tasks.warmup_cache`) among its pytest-xdist workers and every command line
they start, and the summary says how many warm-ups it built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from lightning.pytorch import LightningDataModule, Trainer

from dapo_lightning.sandbox import close_shared_sandboxes
from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
from dapo_lightning.tasks.warmup_cache import CACHE_ENV
from dapo_lightning.testing import make_tiny_checkpoint, tiny_num_parameters
from dapo_lightning.threads import apply_threads, choose_threads
from tests import _harness, _module_harness

# The library's default for what the tests train in process (tiny models: dapo_lightning/
# threads.py), as the CLI chooses it; OMP_NUM_THREADS / MKL_NUM_THREADS win when set.
apply_threads(choose_threads(tiny_num_parameters()), export=False)


def pytest_configure(config: pytest.Config) -> None:
    """The run's warm-up cache, made by the main process before it starts its xdist workers
    (they and their subprocesses inherit the variable); one the caller set is kept."""
    if not hasattr(config, "workerinput") and not os.environ.get(CACHE_ENV):
        folder = tempfile.mkdtemp(prefix="dapo-warmup-cache-")
        os.environ[CACHE_ENV] = config._dapo_warmup_cache = folder  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line: the warm-ups this run built (each a new setting; the quickstart's is one)."""
    log = Path(os.environ.get(CACHE_ENV, "/nonexistent")) / "builds.log"
    if not hasattr(config, "workerinput") and log.is_file():
        builds = log.read_text().splitlines()
        terminalreporter.write_line(f"warm-ups built in this run: {len(builds)} ({CACHE_ENV})")
        for line in builds:
            terminalreporter.write_line(f"  {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_dapo_warmup_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[CACHE_ENV]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (tokenizer + float32 model, tied embeddings) written once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def quickstart_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's warmed-up model (what ``create_model_if_missing`` writes for seed 0),
    from the run's warm-up cache. A test that uses it sets ``timeout(..., func_only=True)``:
    the first warm-up of a run takes minutes on a slow CPU and is not the test's time."""
    return make_quickstart_checkpoint(tmp_path_factory.mktemp("quickstart") / "model")


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
