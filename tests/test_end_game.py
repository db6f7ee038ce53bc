"""Dynamic sampling's end game in a real fit: a training set that becomes solved ends the run
cleanly (exit 0, a stop message, a final checkpoint), by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dapo_lightning.callbacks import RunGuard
from lightning.pytorch.callbacks import ModelCheckpoint
from test_producer import ScriptedEngine

from dapo_lightning import DAPODataModule, DAPOModule, DynamicSamplingConfig, SamplingConfig
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig
from dapo_lightning.data.selection.difficulty import PromptSelectionConfig
from tests._harness import fit

REPO = Path(__file__).resolve().parents[1]


def test_a_solved_training_set_stops_the_fit_with_a_final_checkpoint(tiny_checkpoint, tmp_path):
    """Every answer right: with the default retire_after=3 each prompt is retired after its third
    all-correct visit; when none is left the module stops the run and the guard saves (reviews
    off, so the count of steps is exact: a review would take a slot of a step)."""
    data = DAPODataModule(
        str(tiny_checkpoint),
        reward="arithmetic",
        scoring=ScoringConfig(in_process=True),
        engine=ScriptedEngine(rate=lambda p: 1.0),
        prompts=PromptConfig(
            task="arithmetic", task_kwargs={"num_prompts": 8}, max_prompt_length=64
        ),
        sampling=SamplingConfig(max_tokens=8),
        # no filter: all-right groups are trained on (zero advantage) until they retire
        dynamic_sampling=DynamicSamplingConfig(
            n=2,
            train_batch_size=4,
            filter_metric=None,
            selection=PromptSelectionConfig(review_weight=0.0),
        ),
    )  # default round sizing (kept_frac): without a filter a round is what is missing
    assert data.dynamic_sampling.selection.retire_after == 3  # the default
    assert data.dynamic_sampling.round_sizing == "kept_frac"  # the default
    module = DAPOModule(str(tiny_checkpoint), parity_check_every=0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    trainer = fit(
        module, data, [checkpoint, RunGuard()], max_steps=1000, max_epochs=None,
        enable_checkpointing=True, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    assert module.stop_reason is not None and "8 of 8 are retired" in module.stop_reason
    # 8 prompts, 4 per rollout step, 3 visits each: 6 rollout steps of one update each
    assert trainer.global_step == 6 and module.rollout_step == 6
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 6  # the final state, not an older one


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quickstart_without_early_stopping_runs_until_solved(tmp_path):
    """The real command with EarlyStopping removed and the library's default selection
    (uniform, retire_after 3, reviews at 0.2): the model learns the training sums, they retire
    (a review that is not all-correct puts one back), and the run ends with exit 0, the stop
    message and last.ckpt."""
    override = tmp_path / "no_early_stop.yaml"
    override.write_text(
        """
trainer:
  max_steps: 5000
  callbacks:
    - class_path: dapo_lightning.callbacks.RunGuard
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 100, save_top_k: 0}
"""
    )
    cli = str(Path(sys.executable).parent / "dapo-lightning")
    args = [
        cli,
        "fit",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--config",
        str(override),
    ]
    args += ["--trainer.default_root_dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1750)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "The training set is solved" in out
    last = next((tmp_path / "run").rglob("last.ckpt"))
    assert torch.load(last, weights_only=True)["global_step"] > 0
