"""tests/test_resume_kill.py's SIGKILL trials with ``dynamic_sampling.pipeline: one_step_off``:
killed at random moments and during checkpoint writes, restarted until it finishes, the run
ends bit-identical to an uninterrupted one-step-off run (the batch in flight at each save is in
the checkpoint). ``DAPO_KILL_TRIALS`` sets the trials (default 3; the slow test runs 10)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_resume_kill import _result, _trials, uninterrupted_run


@pytest.fixture(scope="module", autouse=True)
def one_step_off() -> Iterator[None]:
    """Every worker this module starts runs the one-step-off pipeline."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAPO_WORKER_PIPELINE", "one_step_off")
        yield


@pytest.fixture(scope="module")
def reference(one_step_off, model_dir: Path, tmp_path_factory) -> tuple[Path, float]:
    """An uninterrupted one-step-off run, and how long its fit took."""
    return uninterrupted_run(model_dir, tmp_path_factory.mktemp("reference_pipeline"))


def test_the_reference_trains_one_step_off(reference):
    saved = torch.load(reference[0] / "checkpoints" / "last.ckpt", weights_only=True)
    ready = saved["DAPODataModule"]["ranks"][0]["ready"]
    assert ready is not None  # the batch in flight at the last save
    assert _result(reference[0])["rollout_step"] == 10


def test_kill_resume_equals_uninterrupted(model_dir, reference, tmp_path):
    _trials(model_dir, reference, tmp_path, int(os.environ.get("DAPO_KILL_TRIALS", "3")))


@pytest.mark.slow
def test_kill_resume_equals_uninterrupted_10_trials(model_dir, reference, tmp_path):
    _trials(model_dir, reference, tmp_path, max(10, int(os.environ.get("DAPO_KILL_TRIALS", "10"))))
