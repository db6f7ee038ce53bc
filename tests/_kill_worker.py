"""A small deterministic DAPO fit that ``tests/test_resume_kill.py`` kills, signals and restarts.

    python tests/_kill_worker.py MODEL_DIR RUN_DIR ROLLOUT_STEPS

Writes into RUN_DIR:

- ``checkpoints/last.ckpt``: after every rollout step (every ``DAPO_WORKER_EVERY`` steps when
  set; AtomicCheckpointIO, save_last; the one
  it replaces kept as ``last-previous.ckpt``); the run resumes from the newest loadable one
  (``find_resume_checkpoint``, what ``--ckpt_path auto`` uses), loading it with
  ``weights_only=True``.
- ``steps.jsonl``: one record per rollout step (step, drawn prompt uids, policy_version,
  global_step), flushed and fsynced. On resume, records beyond the checkpoint's rollout step
  (written by the killed process after its last checkpoint) are cut off first.
- ``final.pt``: the final policy weights and counters, written only when the fit finished.
- ``logs/version_<n>/metrics.csv``: every logged metric per update (a CSVLogger; each start
  adds a version).
- ``paused``: while a ``DAPO_WORKER_PAUSE`` pause is under way (see :class:`Pause`).

The fit runs with a :class:`~dapo_lightning.callbacks.RunGuard` and exits as the CLI does
(``exit_on_stop``): 128 + the signal after a stop signal (143 SIGTERM, 130 SIGINT, 129 SIGHUP),
having saved.

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


def pause_callback(run: Path) -> Any:
    """``DAPO_WORKER_PAUSE=update:K`` holds the optimizer step of update K + 1 for 3 s;
    ``generation:K`` holds the first scored generation round of rollout step K + 1 for 3 s;
    ``decode:K`` makes every decode step of rollout step K + 1's generation 1 s slower.
    ``RUN/paused`` exists during the pause, so a test can send a real signal exactly then (only
    the timing is arranged; the signal and its handling are real)."""
    import time

    from dapo_lightning.callbacks import DAPOCallback

    where, _, at = os.environ.get("DAPO_WORKER_PAUSE", "").partition(":")

    class Pause(DAPOCallback):
        done = False

        def _hold(self) -> None:
            self.done = True
            (run / "paused").write_text(where)
            time.sleep(3.0)
            (run / "paused").unlink()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if where == "update" and not self.done and trainer.global_step == int(at):
                self._hold()

        def on_rollouts_scored(self, trainer: Any, pl_module: Any, rollouts: Any) -> None:
            if where == "generation" and not self.done and pl_module.rollout_step == int(at):
                self._hold()

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
            """``DAPO_WORKER_SLOW_SAVE=1``: the save of a stop takes 2 s more, RUN/saving
            present meanwhile (a test sends more signals then; only the timing is arranged)."""
            from dapo_lightning.interrupt import stop_requested

            if os.environ.get("DAPO_WORKER_SLOW_SAVE") == "1" and stop_requested() is not None:
                (run / "saving").write_text("saving")
                time.sleep(2.0)
                (run / "saving").unlink()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if where == "decode":
                pl_module.policy.register_forward_pre_hook(
                    lambda m, args, kw: self._slow_decode(pl_module, kw), with_kwargs=True
                )

        def _slow_decode(self, pl_module: Any, kw: dict[str, Any]) -> None:
            """Each decode step of the HF engine (a cached forward) of rollout step K + 1 takes
            1 s more and is logged in RUN/decode.log; RUN/paused appears at the first."""
            if kw.get("use_cache") and pl_module.rollout_step == int(at):
                with open(run / "decode.log", "a") as f:
                    f.write("forward\n")
                (run / "paused").write_text(where)
                time.sleep(1.0)

    return Pause()


def _fsync_write(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _episode_settings() -> dict[str, Any]:
    """DAPO_WORKER_EPISODES=1: multi-turn episodes with the calculator (a nudge makes every
    episode two turns; stop ids make the random tiny model end its turns early)."""
    if os.environ.get("DAPO_WORKER_EPISODES") != "1":
        return {}
    from dapo_lightning.envs import EnvironmentConfig

    return {
        "engine_kwargs": {"eos_token_id": [1, *range(100, 190)]},
        "environment": EnvironmentConfig(
            kwargs={"nudge": "Again."}, max_turns=2, max_episode_tokens=96, add_instructions=False
        ),
    }


def main(model_dir: str, run_dir: str, rollout_steps: int) -> None:
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from dapo_lightning.callbacks import CollapseDetector, OverlongRewardShaping, RunGuard
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from transformers import AutoTokenizer

    from dapo_lightning import DAPODataModule, DAPOModule
    from dapo_lightning.checkpoint import AtomicCheckpointIO, find_resume_checkpoint
    from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig
    from dapo_lightning.data.sampling.producer import DynamicSamplingConfig
    from dapo_lightning.data.selection.difficulty import PromptSelectionConfig
    from dapo_lightning.interrupt import exit_on_stop
    from dapo_lightning.rollout.base import SamplingConfig
    from dapo_lightning.schedules import WarmupConstantLR
    from dapo_lightning.update import BatchingConfig

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run / "checkpoints"
    records = run / "steps.jsonl"

    # counts every scored round (no penalty: the rewards stay as they are); its totals per step
    # show a round counted twice or lost across a stop
    overlong = OverlongRewardShaping(buffer_length=1, apply_penalty=False)

    class StepRecorder(Callback):
        """Appends (step, drawn uids, policy_version, global_step, the responses scored for the
        steps trained so far) per rollout step, fsynced."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            done = pl_module.rollout_step  # restored from the checkpoint (0 on a fresh start)
            kept = []
            if records.exists():
                for line in records.read_text().splitlines(keepends=True):
                    if line.endswith("\n") and json.loads(line)["step"] <= done:
                        kept.append(line)
            _fsync_write(records, kept)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not hasattr(batch, "sample_version"):  # EndOfTraining: no step was trained
                return
            dm = trainer.datamodule
            rec = {
                "step": pl_module.rollout_step,
                "uids": dm.stream.producer.drawn_uids,
                "policy_version": pl_module.policy_version,
                "sample_version": batch.policy_version,
                "global_step": trainer.global_step,
                "responses": overlong.totals["responses"],
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
        batching=BatchingConfig(mini_batch_size=2, micro_batch_size=4),
        parity_check_every=0,
    )
    dm = DAPODataModule(
        model_dir,
        prompts=PromptConfig(
            task="arithmetic",
            task_kwargs={"num_prompts": 24},
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        reward=FirstTokenParity(tokenizer),
        scoring=ScoringConfig(in_process=True),
        engine="hf",
        **_episode_settings(),
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(
            n=4,
            train_batch_size=4,
            gen_batch_size=6,  # surplus groups are carried to the next step (carried state)
            carry_over=True,
            filter_metric="acc",
            max_num_gen_batches=50,
            # per-prompt statistics in the checkpoint (none retires in 10 steps)
            selection=PromptSelectionConfig(retire_after=8, park_after=8),
            pipeline=os.environ.get("DAPO_WORKER_PIPELINE", "sync"),
        ),
        seed=0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=rollout_steps * UPDATES_PER_STEP,
        # every logged metric, per update, in RUN/logs/version_<n>/metrics.csv (one per start)
        logger=CSVLogger(run, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        default_root_dir=run,
        plugins=[AtomicCheckpointIO()],
        callbacks=[
            overlong,  # before the recorder: its totals include the step just trained
            StepRecorder(),
            CollapseDetector(),
            ModelCheckpoint(
                dirpath=ckpt_dir,
                save_last=True,
                save_top_k=0,
                # global_step counts optimizer updates; DAPO_WORKER_EVERY: rollout steps per save
                every_n_train_steps=UPDATES_PER_STEP
                * int(os.environ.get("DAPO_WORKER_EVERY", "1")),
            ),
            pause_callback(run),
            RunGuard(),
        ],
    )
    # weights_only=True: the whole checkpoint (data module, callbacks, RNG) is plain data
    with exit_on_stop():
        trainer.fit(
            module, datamodule=dm, ckpt_path=find_resume_checkpoint(trainer), weights_only=True
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
