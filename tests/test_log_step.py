"""The rollout step's values reach the loggers and the monitors as ``self.log`` would put them."""

from __future__ import annotations

import csv

import pytest
from lightning.pytorch.loggers import CSVLogger

from dapo_lightning.module import DAPOModule
from dapo_lightning.update import BatchingConfig
from tests._harness import fit
from tests._module_harness import FixedBatches, fixed_batch


@pytest.mark.parametrize("every, logged_steps", [(1, [3, 7, 11]), (8, [7])])
def test_rollout_values_are_one_row_at_updates_done_minus_one(
    tiny_checkpoint, tmp_path, every, logged_steps
):
    """3 rollout steps of 4 updates: each step's values form one logger row at updates done - 1
    (3, 7, 11), thinned by ``log_every_n_steps`` as Lightning thins its own rows (every 8: only
    update 8 is a multiple), and the last step's values are in ``callback_metrics``. The same
    batch (sampled at version 0) every step: its staleness is the updates made before it."""
    module = DAPOModule(str(tiny_checkpoint), batching=BatchingConfig(1))
    logger = CSVLogger(tmp_path, name="logs")
    trainer = fit(module, FixedBatches(fixed_batch(), steps=3), logger=logger,
                  log_every_n_steps=every, max_steps=12)  # fmt: skip
    assert trainer.global_step == 12
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/step")]
    assert [int(r["step"]) for r in rows] == logged_steps
    assert [float(r["rollout/step"]) for r in rows] == [s // 4 + 1 for s in logged_steps]
    assert all(r["epoch"] == "0" for r in rows)
    last = trainer.callback_metrics
    assert float(last["rollout/step"]) == 3.0
    # the batch is stamped version 0; before the step of row s the policy made s + 1 - 4 updates
    assert [float(r["data/staleness_mean"]) for r in rows] == [s - 3 for s in logged_steps]
    assert float(last["data/staleness_mean"]) == 8.0
    assert float(trainer.callback_metrics["update/skipped_total"]) == 0.0
