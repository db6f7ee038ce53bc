"""A small deterministic DAPO fit that ``tests/test_resume_kill.py`` SIGKILLs and restarts.

    python tests/_kill_worker.py MODEL_DIR RUN_DIR ROLLOUT_STEPS

Writes into RUN_DIR:

- ``checkpoints/last.ckpt``: after every rollout step (AtomicCheckpointIO, save_last); the run
  resumes from it when it exists, loading it with ``weights_only=True``.
- ``steps.jsonl``: one record per rollout step (step, drawn prompt uids, policy_version,
  global_step), flushed and fsynced. On resume, records beyond the checkpoint's rollout step
  (written by the killed process after its last checkpoint) are cut off first.
- ``final.pt``: the final policy weights and counters, written only when the fit finished.

Everything random is seeded and CPU kernels run deterministically on one thread, so an
interrupted-and-resumed run must end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

UPDATES_PER_STEP = 2  # train_batch_size 4 / mini_batch_size 2


class FirstTokenParity:
    """A reward with variance on a random model: correct when the first response token is even.

    Only its ``acc`` matters to the filter; failing never happens (``failure_score`` unused).
    """

    failure_score = -1.0

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, responses: list[str], ground_truths: list[str], **kw: Any) -> list[Any]:
        from dapo_lightning.rewards import RewardResult

        out = []
        for text in responses:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ok = bool(ids) and ids[0] % 2 == 0
            out.append(RewardResult(score=1.0 if ok else -1.0, acc=ok, extra={"has_answer": True}))
        return out


def _fsync_write(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(model_dir: str, run_dir: str, rollout_steps: int) -> None:
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from dapo_lightning.callbacks import CollapseDetector
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from transformers import AutoTokenizer

    from dapo_lightning import DAPODataModule, DAPOModule
    from dapo_lightning.checkpoint import AtomicCheckpointIO
    from dapo_lightning.schedules import WarmupConstantLR

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    records = run / "steps.jsonl"

    class StepRecorder(Callback):
        """Appends (step, drawn uids, policy_version, global_step) per rollout step, fsynced."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            done = pl_module.rollout_step  # restored from the checkpoint (0 on a fresh start)
            kept = []
            if records.exists():
                for line in records.read_text().splitlines(keepends=True):
                    if line.endswith("\n") and json.loads(line)["step"] <= done:
                        kept.append(line)
            _fsync_write(records, kept)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            dm = trainer.datamodule
            rec = {
                "step": pl_module.rollout_step,
                "uids": dm.buffer.drawn_uids,
                "policy_version": pl_module.policy_version,
                "sample_version": batch.policy_version,
                "global_step": trainer.global_step,
            }
            with open(records, "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())

    pl.seed_everything(0, workers=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    module = DAPOModule(
        model_dir,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
        lr_scheduler=lambda opt: WarmupConstantLR(opt, warmup_steps=3),
        mini_batch_size=2,
        micro_batch_size=4,
        parity_check_every=0,
    )
    dm = DAPODataModule(
        model_dir,
        task="arithmetic",
        task_kwargs={"num_prompts": 24},
        apply_chat_template=False,
        reward=FirstTokenParity(tokenizer),
        reward_in_process=True,
        engine="hf",
        n=4,
        train_batch_size=4,
        gen_batch_size=6,  # surplus groups are carried to the next step (carried state)
        carry_over=True,
        max_prompt_length=16,
        max_response_length=4,
        filter_metric="acc",
        max_num_gen_batches=50,
        retire_after=3,  # per-prompt statistics in the checkpoint
        park_after=3,
        seed=0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=rollout_steps * UPDATES_PER_STEP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        default_root_dir=run,
        plugins=[AtomicCheckpointIO()],
        callbacks=[
            StepRecorder(),
            CollapseDetector(),
            ModelCheckpoint(
                dirpath=ckpt_dir,
                save_last=True,
                save_top_k=0,
                every_n_train_steps=UPDATES_PER_STEP,  # global_step counts optimizer updates
            ),
        ],
    )
    # weights_only=True: the whole checkpoint (data module, callbacks, RNG) is plain data
    trainer.fit(
        module,
        datamodule=dm,
        ckpt_path=str(last) if last.exists() else None,
        weights_only=True,
    )
    out = {
        "policy": {k: v.detach().clone() for k, v in module.policy.state_dict().items()},
        "global_step": trainer.global_step,
        "policy_version": module.policy_version,
        "rollout_step": module.rollout_step,
    }
    tmp = run / "final.pt.tmp"
    torch.save(out, tmp)
    os.replace(tmp, run / "final.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
