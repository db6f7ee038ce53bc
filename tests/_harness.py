"""The shared test harness: one base run config, one CLI fit and one in-process fit.

A test fit is the tiny random model (``dapo_lightning.testing.make_tiny_checkpoint``) trained
for a couple of updates; what differs between tests is passed as overrides, so a renamed YAML
key, a new constructor argument or a Trainer setting is one edit here.

* :func:`run_config` / :func:`write_run_config`: the override every short CLI fit puts over
  ``configs/quickstart.yaml`` (:data:`TINY_RUN`: one update per rollout step of 4 groups x 4
  responses of <= 4 tokens, dynamic sampling off because the random model never answers right),
  or the complete one-update config :data:`ARITHMETIC_RUN`, with nested overrides merged in
  (lists such as ``trainer.callbacks`` are replaced whole, as LightningCLI does with a second
  ``--config``).
* :func:`run_cli` / :func:`fit_cli`: the ``dapo-lightning`` console script in a subprocess.
* :func:`make_trainer` / :func:`fit`: a quiet CPU ``Trainer`` (:data:`QUIET_TRAINER`) and a fit
  of a module in this process.

tests/conftest.py hands these out as fixtures too, with the module harness
(tests/_module_harness.py: fixed rollout batches and the parameter update of a short fit).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
#: The console script of this interpreter's environment.
CLI = str(Path(sys.executable).parent / "dapo-lightning")
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
#: Command-line flags of a short CLI fit: 2 rollout steps, validation after each.
TINY = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1"]

#: The tiny run over quickstart.yaml: 4 groups x 4 responses of <= 4 tokens, one update per
#: rollout step (train_batch_size 4, no mini-batches); the random model never answers right,
#: so the dynamic-sampling filter is off (it would give up).
TINY_RUN: dict[str, Any] = {
    "model": {"init_args": {"batching": {"mini_batch_size": None}}},
    "data": {
        "init_args": {
            "sampling": {"max_tokens": 4},
            "dynamic_sampling": {
                "n": 4,
                "train_batch_size": 4,
                "gen_batch_size": 4,
                "filter_metric": None,
            },
        }
    },
}

#: A complete config on its own (no quickstart.yaml): the arithmetic task at level 1, rewards
#: scored in process, 2 groups of 2 responses of <= 4 tokens, one update, nothing logged or saved.
ARITHMETIC_RUN: dict[str, Any] = {
    "model": {
        "class_path": "dapo_lightning.DAPOModule",
        "init_args": {"batching": {"micro_batch_size": 8}, "parity_check_every": 0},
    },
    "data": {
        "class_path": "dapo_lightning.DAPODataModule",
        "init_args": {
            "scoring": {"in_process": True},
            "prompts": {
                "task": "arithmetic",
                "task_kwargs": {"level": 1, "num_prompts": 16},
                "apply_chat_template": False,
                "max_prompt_length": 16,
            },
            "sampling": {"max_tokens": 4},
            "dynamic_sampling": {"n": 2, "train_batch_size": 2, "filter_metric": None},
        },
    },
    "trainer": {
        "max_steps": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
    },
}

#: Trainer settings of an in-process test fit: CPU, one epoch, nothing logged, saved or drawn.
QUIET_TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "max_epochs": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: nested mappings key by key, anything else (lists
    included) replaced whole. Neither argument is modified."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_config(
    run_dir: Path | str | None = None,
    model_dir: Path | str | None = None,
    base: Mapping[str, Any] = TINY_RUN,
    **overrides: Any,
) -> dict[str, Any]:
    """The base run config (``base``: :data:`TINY_RUN` over quickstart.yaml, or the complete
    :data:`ARITHMETIC_RUN`) in ``run_dir`` (``trainer.default_root_dir``; relative paths follow
    it) on ``model_dir`` (``model_name_or_path``), with ``overrides`` (top-level sections, e.g.
    ``trainer={"callbacks": [...]}``) merged in."""
    config = copy.deepcopy(dict(base))
    if run_dir is not None:
        config = merged(config, {"trainer": {"default_root_dir": str(run_dir)}})
    if model_dir is not None:
        config = merged(config, {"model": {"init_args": {"model_name_or_path": str(model_dir)}}})
    return merged(config, overrides)


def write_run_config(
    path: Path,
    run_dir: Path | str | None = None,
    model_dir: Path | str | None = None,
    base: Mapping[str, Any] = TINY_RUN,
    **overrides: Any,
) -> Path:
    """:func:`run_config` written as YAML to ``path`` (a ``--config``); returns ``path``."""
    config = run_config(run_dir, model_dir, base, **overrides)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def cli_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The console script's environment: this one, ``tests/`` importable (test callbacks,
    rewards and environments by dotted path), tokenizers single-threaded, then ``env``."""
    path = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path, **(env or {})}


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: int = 240, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``dapo-lightning ARGS`` in a subprocess (environment: :func:`cli_env`)."""
    return subprocess.run(
        [CLI, *args], cwd=cwd, env=cli_env(env), capture_output=True, text=True, timeout=timeout
    )


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``proc``, asserting it exited 0 (the message holds the ends of stdout and stderr)."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def fit_cli(
    override: Path,
    *args: str,
    configs: Iterable[str] = (QUICKSTART,),
    env: Mapping[str, str] | None = None,
    timeout: int = 300,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """A short fit through the console script: ``fit --config C ... --config override ARGS
    TINY`` (``configs`` first, default quickstart.yaml; :data:`TINY` last), checked."""
    config_args = [a for c in configs for a in ("--config", str(c))]
    return check(
        run_cli("fit", *config_args, "--config", str(override), *args, *TINY,
                env=env, timeout=timeout, cwd=cwd)
    )  # fmt: skip


#: Marks a test that runs the real bubblewrap sandbox: skipped where bwrap is missing, failed
#: instead in CI (``.ci/run`` sets ``DAPO_REQUIRE_BWRAP=1``; scripts/setup.sh installs it).
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("DAPO_REQUIRE_BWRAP") != "1",
    reason="bwrap missing: bash scripts/setup.sh installs it (CI sets DAPO_REQUIRE_BWRAP=1)",
)


def make_trainer(callbacks: Iterable[Callback] = (), **trainer_kwargs: Any) -> Trainer:
    """A ``Trainer`` with :data:`QUIET_TRAINER`'s settings, ``trainer_kwargs`` over them."""
    return Trainer(**{**QUIET_TRAINER, "callbacks": list(callbacks), **trainer_kwargs})


def fit(
    module: LightningModule,
    datamodule: LightningDataModule | None = None,
    callbacks: Iterable[Callback] = (),
    *,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> Trainer:
    """Fit ``module`` in this process with :func:`make_trainer` (``trainer_kwargs`` over the
    quiet defaults); returns the trainer."""
    trainer = make_trainer(callbacks, **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer
