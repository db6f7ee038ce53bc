"""SampleLog: what the model wrote, on disk: every rollout step's groups and every validation's
samples as JSONL, one row per sample (docs/samples.md; the columns:
:mod:`~dapo_lightning.callbacks.sample_rows`).

Where the rows come from. Each scored round reaches ``on_rollouts_scored`` (before the filter;
the callback keeps a reference, so it sees the final shaped reward and the filter decision the
producer stamps right after the hooks) under the batch it was generated for, as
:class:`~dapo_lightning.callbacks.round_counts.RoundCounts` keeps counts; the step that trains
batch ``k`` takes the rounds of batch ``k`` and earlier at its start and writes them at its end,
with the advantages the module returns (``outputs["advantages"]``). A kept group carried over
to the next step is written by the step that trains it. A stop that voids a step
(``on_rollouts_discarded``) drops its rounds before anything of it is written, and on resume the
files are cut back to the restored step (rows of later steps, left by a killed run, go), so a
stopped-and-resumed run's files hold each step once. Each rank writes files of its own
(``rollouts-rank<r>.jsonl``, ``validation-rank<r>.jsonl``).

Read them with one line of pandas::

    df = pd.read_json("runs/quickstart/samples/rollouts-rank0.jsonl", lines=True)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from dapo_lightning.callbacks.sample_files import Row, SampleFile
from dapo_lightning.callbacks.sample_rows import (
    DEFERRED,
    ROUND_GROUP,
    complete_rows,
    mark_trained,
    rollout_rows,
    row_fingerprints,
    step_rows,
    validation_rows,
)
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from dapo_lightning.batch import RolloutBatch, ScoredRollouts
from dapo_lightning.checks import ConfigError, as_group, check_count
from dapo_lightning.hooks import DAPOCallback
from dapo_lightning.policy_state import policy_state_of

#: How a bad setting is named (``SampleLog.settings.<field>``).
SAMPLE_LOG_PATH = "SampleLog.settings"


@dataclass(frozen=True)
class SampleLogConfig:
    """What :class:`SampleLog` writes, and where.

    Args:
        every_n_steps: Write rollout steps 1, 1 + N, 1 + 2N, ... (1: every step).
        max_groups: At most this many groups per written step (trained groups first, then
            dropped ones); None: every group. A step's file share is at most
            ``max_groups * n`` rows.
        dropped: Also write the groups the dynamic-sampling filter dropped.
        validation: Write every validation's samples (``validation-rank<r>.jsonl``).
        dir: The folder of the files; relative paths and None (``samples``) are under
            ``trainer.default_root_dir``, the run directory.
        logger_samples: Samples of each written step sent as a text table to the loggers that
            show text (TensorBoard: the Text tab); 0: none.
    """

    every_n_steps: int = 1
    max_groups: int | None = 16
    dropped: bool = True
    validation: bool = True
    dir: str | None = None
    logger_samples: int = 4

    def __post_init__(self) -> None:
        path = SAMPLE_LOG_PATH
        check_count(f"{path}.every_n_steps", self.every_n_steps, 1, "1: every rollout step")
        check_count(f"{path}.max_groups", self.max_groups, 1, "groups per step", none_ok=True)
        check_count(f"{path}.logger_samples", self.logger_samples, 0, "0: none")
        for name in ("dropped", "validation"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{path}.{name} must be true or false, got {getattr(self, name)!r}."
                )
        if self.dir is not None and not isinstance(self.dir, str):
            raise ConfigError(f"{path}.dir must be a folder path or null, got {self.dir!r}.")

    def writes_step(self, step: int) -> bool:
        """Whether rollout step ``step`` (1, 2, ...) is written."""
        return (step - 1) % self.every_n_steps == 0


class SampleLog(DAPOCallback):
    """Writes rollout and validation samples as JSONL (module docstring).

    Args:
        settings: :class:`SampleLogConfig` (a mapping of its fields is accepted).

    Example::

        trainer = Trainer(callbacks=[SampleLog(SampleLogConfig(every_n_steps=10))])
    """

    def __init__(self, settings: SampleLogConfig | dict[str, Any] | None = None) -> None:
        super().__init__()
        self.settings = as_group(
            settings if settings is not None else SampleLogConfig(),
            SampleLogConfig,
            SAMPLE_LOG_PATH,
            "settings: {every_n_steps: 1, max_groups: 16, ...}",
        )
        self._lock = threading.Lock()
        self._rounds: dict[int, list[ScoredRollouts | list[Row]]] = {}
        self._deferred: list[Row] = []  # kept rows not trained yet (carried to the next step)
        self._taken: tuple[list[ScoredRollouts | list[Row]], list[Row], int] | None = None
        self._round_ids = 0
        self._files: dict[str, SampleFile] = {}
        self._last_on_disk: dict[str, int] = {}  # the last step each file held when opened
        self._val_group = 0
        self._version = 0

    # ------------------------------------------------------------------ files
    def _file(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str) -> SampleFile:
        """The ``kind`` file of this rank; opened before the run's first step or validation,
        and then cut back to the rollout steps done (a resumed run's restored step)."""
        if kind not in self._files:
            root = Path(trainer.default_root_dir)
            folder = root / (self.settings.dir if self.settings.dir is not None else "samples")
            file = SampleFile(folder / f"{kind}-rank{trainer.global_rank}.jsonl")
            file.failed = any(f.failed for f in self._files.values())  # warned once: given up
            done = policy_state_of(pl_module, "SampleLog").rollout_step
            kept = file.keep_only(lambda r: int(r.get("step", 0)) <= done)
            self._last_on_disk[kind] = max((int(r.get("step", 0)) for r in kept), default=-1)
            self._files[kind] = file
        return self._files[kind]

    # ------------------------------------------------------------- DAPO hooks
    @override
    def on_rollouts_scored(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: ScoredRollouts
    ) -> None:
        """Keep the round (by reference: shaping and the filter decision are read later)."""
        with self._lock:
            self._rounds.setdefault(int(rollouts.batch_index), []).append(rollouts)

    @override
    def on_rollouts_discarded(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_index: int
    ) -> None:
        """Drop the rounds of ``batch_index`` and later; a taken step's earlier ones go back."""
        with self._lock:
            self._rounds = {b: r for b, r in self._rounds.items() if b < batch_index}
            if self._taken is not None:
                rounds, deferred, index = self._taken
                if index < batch_index:
                    self._rounds.setdefault(index, []).extend(rounds)
                self._deferred = deferred + self._deferred
                self._taken = None

    # -------------------------------------------------------- Lightning hooks
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        with self._lock:
            index = int(batch.batch_index)
            mine = sorted(b for b in self._rounds if b <= index)
            rounds = [r for b in mine for r in self._rounds.pop(b)]
            self._taken = (rounds, self._deferred, index)
            self._deferred = []
        self._version = policy_state_of(pl_module, "SampleLog").version
        self._file(trainer, pl_module, "rollouts")  # opened (cut back) before the step counts

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        with self._lock:
            taken, self._taken = self._taken, None
        if taken is None or not isinstance(batch, RolloutBatch):
            return
        step = policy_state_of(pl_module, "SampleLog").rollout_step
        if not self.settings.writes_step(step):
            return
        rounds, deferred, _ = taken
        out = self._step_rows(rounds, deferred, outputs, batch, step)
        self._file(trainer, pl_module, "rollouts").append(out)
        log_text(trainer, "samples/rollouts", out, self.settings.logger_samples, step)

    def _step_rows(
        self,
        rounds: list[ScoredRollouts | list[Row]],
        deferred: list[Row],
        outputs: Any,
        batch: RolloutBatch,
        step: int,
    ) -> list[Row]:
        """The rows step ``step`` writes: its kept rows (deferred ones first) matched to the
        trained batch, the kept ones not trained carried to the next step, then as many dropped
        groups as ``max_groups`` leaves room for (only those are built)."""
        fresh = [(self._next_round_id(), r) for r in rounds if isinstance(r, ScoredRollouts)]
        rows = [*deferred, *(row for r in rounds if isinstance(r, list) for row in r)]
        rows += [row for rid, r in fresh for row in rollout_rows(r, rid, dropped=False)]
        advantages = outputs.get("advantages") if isinstance(outputs, dict) else None
        if advantages is not None and len(advantages) == batch.batch_size:
            keys = row_fingerprints(batch.input_ids, batch.attention_mask, batch.response_width)
            mark_trained(rows, keys.tolist(), advantages.tolist(), self._version)
        carry = [
            r for r in rows if r["filter"] == "kept" and not r["trained"] and not r.get(DEFERRED)
        ]
        complete_rows(carry)  # plain rows: they wait in the state (a checkpoint holds them)
        with self._lock:
            self._deferred.extend({**r, DEFERRED: True} for r in carry)
        held = {id(r) for r in carry}
        rows = [r for r in rows if id(r) not in held]
        limit = self.settings.max_groups
        room = None if limit is None else limit - len({r[ROUND_GROUP] for r in rows})
        for rid, r in fresh if self.settings.dropped else []:
            if room is not None and room <= 0:
                break
            more = rollout_rows(r, rid, kept=False, max_groups=room)
            rows += more
            room = None if room is None else room - len({m[ROUND_GROUP] for m in more})
        return step_rows(rows, step, limit)

    def _next_round_id(self) -> int:
        self._round_ids += 1
        return self._round_ids

    def _round_rows(self, rnd: ScoredRollouts | list[Row]) -> list[Row]:
        """The rows of a round not trained yet (rows already, from a checkpoint, as they are)."""
        if isinstance(rnd, list):
            return rnd
        rows = rollout_rows(rnd, self._next_round_id(), self.settings.dropped)
        complete_rows(rows)
        return rows

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_group = 0

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking or not self.settings.validation:
            return
        if not isinstance(batch, ScoredRollouts) or not len(batch):
            return
        step = policy_state_of(pl_module, "SampleLog").rollout_step
        file = self._file(trainer, pl_module, "validation")
        if self._val_group == 0 and step <= self._last_on_disk["validation"]:
            # a validation at a step the file holds (a resumed run's): written anew
            file.keep_only(lambda r: int(r.get("step", 0)) != step)
        rows = validation_rows(batch, step, self._val_group)
        self._val_group += batch.num_groups
        file.append(rows)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The rounds not trained yet (one-step-off: the batch in flight) and the carried rows,
        as rows."""
        with self._lock:
            rounds = {b: [self._round_rows(r) for r in rs] for b, rs in self._rounds.items()}
            return {
                "rounds": rounds,
                "deferred": list(self._deferred),
                "round_ids": self._round_ids,
            }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self._lock:
            self._rounds = {int(b): list(rs) for b, rs in state_dict.get("rounds", {}).items()}
            self._deferred = list(state_dict.get("deferred", []))
            self._round_ids = int(state_dict.get("round_ids", 0))


def log_text(trainer: pl.Trainer, tag: str, rows: list[Row], count: int, step: int) -> None:
    """The first ``count`` of ``rows`` as a Markdown table to the trainer's TensorBoard loggers."""
    if count <= 0 or not rows:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, samples_markdown(rows[:count]), global_step=step)


def samples_markdown(rows: list[Row]) -> str:
    """``rows`` as a Markdown table: prompt, response, reward, acc, advantage, filter."""
    cells = ("prompt", "response", "reward", "acc", "advantage", "filter")

    def cell(value: Any) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cells) + " |" for r in rows]
    return "\n".join(lines)
