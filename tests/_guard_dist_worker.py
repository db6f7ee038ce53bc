"""Worker of tests/test_run_guard.py's two-rank case: one gloo rank of a DDP fit with a
RunGuard, started by ``torch.distributed.run``; only rank 0 receives a real SIGINT.

    python -m torch.distributed.run --nproc_per_node 2 tests/_guard_dist_worker.py ROOT MODEL

Each rank writes ``ROOT/rank<r>.json`` at the end of training: its global step and the stop
reason it holds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any


def main(root: str, model: str) -> None:
    from _module_harness import FixedBatches, fixed_batch, sgd
    from dapo_lightning.callbacks import RunGuard
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dapo_lightning.interrupt import exit_on_stop, stop_requested
    from dapo_lightning.module import DAPOModule
    from dapo_lightning.update import BatchingConfig

    class SignalRankZero(Callback):
        """SIGINT to rank 0's own process at the start of the batch after update 2."""

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_rank == 0 and trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGINT)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            record = {"global_step": trainer.global_step, "stop": stop_requested()}
            Path(root, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    module = DAPOModule(
        model, optimizer=sgd, batching=BatchingConfig(micro_batch_size=16), parity_check_every=0
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=Path(root) / "ckpts", save_last=True, every_n_train_steps=10),
            RunGuard(),
            SignalRankZero(),
        ],
    )
    with exit_on_stop():
        trainer.fit(module, datamodule=FixedBatches(fixed_batch(), steps=8))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1], sys.argv[2])
