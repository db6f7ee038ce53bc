"""What a person sees during a fit: DAPOProgressBar's plain lines (stdout not a terminal) and
rich bar, the validation lines, the end-of-fit summary and its stop reasons, and the known
noise that :func:`quiet_known_warnings` hides.

Two real fits of the quickstart config on the tiny random model (3 updates of 4 groups x 4
responses of <= 4 tokens, validation after update 2; the random model never answers right, so
dynamic sampling is off):
one through the command line with stdout piped (plain lines), one in process with the rich bar
recording into its console, stopped by an exception at update 2.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import rich
import torch
import yaml
from dapo_lightning.callbacks import (
    CollapseDetector,
    DAPOModelSummary,
    DAPOProgressBar,
    run_summary,
    stop_reason,
)
from dapo_lightning.callbacks.progress import (
    STEP_FIELDS,
    cli_command,
    step_fields,
    validation_line,
)
from dapo_lightning.callbacks.summary import replace_default_summary
from lightning.pytorch.callbacks import EarlyStopping, ModelSummary
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from dapo_lightning import interrupt
from dapo_lightning.cli import build_cli
from dapo_lightning.logging_setup import (
    KNOWN_NOISE,
    PARTIAL_RELOAD_NOISE,
    WARNINGS,
    quiet_known_warnings,
    quiet_partial_reload,
)
from tests._harness import QUICKSTART, REPO, write_run_config

SHORT = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "2"]
LABELS = [label for label, _, _ in STEP_FIELDS]


def _override(path: Path, run_dir: Path, model: Path, bar_args: str = "{}") -> Path:
    """The harness's base run config with a CSV log flushed every step, a checkpoint every
    update and the progress bar built with ``bar_args`` (YAML text)."""
    trainer = {
        "default_root_dir": str(run_dir),
        "enable_progress_bar": True,
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "logs", "flush_logs_every_n_steps": 1},
        },
        "callbacks": [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": f"{run_dir}/checkpoints",
                    "save_last": True,
                    "every_n_train_steps": 1,
                    "save_top_k": 0,
                },
            },
            {
                "class_path": "dapo_lightning.callbacks.DAPOProgressBar",
                "init_args": yaml.safe_load(bar_args),
            },
        ],
    }
    return write_run_config(path, run_dir, model, create_model_if_missing=None, trainer=trainer)


# ------------------------------------------------------------ a real fit, stdout not a terminal


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    root = tmp_path_factory.mktemp("plain")
    run_dir = root / "run"
    override = _override(root / "override.yaml", run_dir, tiny_checkpoint)
    code = (
        "from dapo_lightning.logging_setup import quiet_known_warnings; quiet_known_warnings(); "
        "from dapo_lightning.cli import main; main()"
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", code, "fit", "--config", QUICKSTART, "--config", str(override),
         *SHORT],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return run_dir, proc


def test_plain_lines_one_per_rollout_step(plain_run):
    _, proc = plain_run
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("update ")]
    assert [s.split(" | ")[0] for s in steps] == ["update 1/3", "update 2/3", "update 3/3"]
    for line in steps:
        fields = dict(part.split(" ", 1) for part in line.split(" | ")[1:])
        expected = LABELS if line.startswith("update 3/") else LABELS[:-1]  # val/acc once known
        assert list(fields) == expected, line
        assert float(fields["gen"].removesuffix("s")) >= 0 and -2 <= float(fields["reward"]) <= 1
    assert "Epoch" not in proc.stdout and "v_num" not in proc.stdout


def test_a_line_per_validation(plain_run):
    _, proc = plain_run
    val = [line for line in proc.stdout.splitlines() if line.startswith("validation at update")]
    assert val, proc.stdout
    assert re.fullmatch(
        r"validation at update 2: val/acc \d\.\d{3} \| val/pass@16 \d\.\d{3}", val[-1]
    )
    # the validation comes after the rollout step it follows
    lines = proc.stdout.splitlines()
    assert (
        lines.index(val[-1]) == lines.index(next(s for s in lines if s.startswith("update 2/"))) + 1
    )


def test_summary_at_the_end_of_fit(plain_run, monkeypatch):
    run_dir, proc = plain_run
    summary = proc.stdout[proc.stdout.index("DAPO fit summary") :].splitlines()
    text = "\n".join(summary)
    assert "  stopped:     max_steps=3 reached" in summary
    assert re.search(r"  updates:     3/3 \(3 rollout steps\) in \d+ s", text)
    assert re.search(r"  val/acc:     best (\d\.\d{3}) \(update 2\), last \1 \(update 2\)", text)
    assert f"  checkpoints: {run_dir / 'checkpoints'} (last: last.ckpt)" in summary
    assert f"  logs:        {run_dir / 'logs' / 'version_0'}" in summary
    # the fit ran as `python -c` from the repository: the console script beside the interpreter
    monkeypatch.chdir(REPO)
    assert summary[-1] == f"  plot:        {cli_command('-c')} plot {run_dir / 'logs'}"
    assert (run_dir / "logs" / "version_0" / "metrics.csv").is_file()


def test_cli_command_is_the_one_this_process_was_run_by(tmp_path, monkeypatch):
    """Issue 30: the summary said `dapo-lightning plot` where that name is not on PATH."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "dapo-lightning"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli_command(str(script)) == os.path.join("venv", "bin", "dapo-lightning")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # an activated environment
    assert cli_command(str(script)) == "dapo-lightning"
    monkeypatch.chdir(REPO)  # not below the working directory: the absolute path
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli_command(str(script)) == str(script)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no script beside it
    assert cli_command("-c") == f"{tmp_path / 'python'} -m dapo_lightning"


def test_known_noise_is_gone_from_a_real_fit(plain_run):
    _, proc = plain_run
    out = proc.stdout + proc.stderr
    for noise in ("Using ModelCheckpoint with manual optimization", "💡 Tip", "LeafSpec",
                  "Setting accelerator to CPU", "IterableDataset` has `__len__`"):  # fmt: skip
        assert noise not in out, noise
    assert "max_steps=3" in out  # what Lightning says about the stop is kept


def test_model_summary_counts_parameters_without_flops(plain_run):
    """Issue 30: every fit printed a FLOPs column of zeros and "Total FLOPs: 0" (Lightning counts
    FLOPs only from an example_input_array); the CLI's summary keeps the table and the counts."""
    _, proc = plain_run
    out = proc.stdout + proc.stderr
    assert "Qwen2ForCausalLM" in out and "Total params" in out and "Trainable params" in out
    assert "flops" not in out.lower(), out[:3000]


def test_plain_model_summary_without_flops(caplog):
    """Without rich, the Trainer's ``ModelSummary`` is replaced by the plain DAPOModelSummary:
    Lightning's text table, less its FLOPs column and total."""
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[ModelSummary(max_depth=2)])  # fmt: skip
    replace_default_summary(trainer)
    (summary,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert isinstance(summary, DAPOModelSummary) and not summary.rich
    assert summary._max_depth == 2
    module = pl.LightningModule()
    module.layer = torch.nn.Linear(3, 2)
    with caplog.at_level(logging.INFO):
        summary.on_fit_start(trainer, module)
    text = caplog.text
    assert "layer | Linear" in text and "8         Total params" in text
    assert "flops" not in text.lower(), text


# ------------------------------------------------------- a real fit, rich bar, ended by an error


class _StopAtUpdate2(pl.Callback):
    """Records the bar's fields after every rollout step; raises after update 2."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        bar = trainer.progress_bar_callback
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.seen.append((trainer.global_step, bar.get_metrics(trainer, pl_module), metrics))
        if trainer.global_step == 2:
            raise RuntimeError("probe stop\nsecond line")


def test_rich_bar_fields_and_summary_after_an_error(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dapo-lightning"])
    bar_args = "{mode: rich, console_kwargs: {force_terminal: true, record: true, width: 200}}"
    override = _override(tmp_path / "o.yaml", tmp_path / "run", tiny_checkpoint, bar_args)
    cli = build_cli(["--config", QUICKSTART, "--config", str(override), *SHORT], run=False)
    probe = _StopAtUpdate2()
    cli.trainer.callbacks.append(probe)
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, DAPOProgressBar)
    try:
        with pytest.raises(RuntimeError, match="probe stop"):
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        recorded = bar._console.export_text()
    finally:
        rich.reconfigure()  # the bar reconfigured rich's global console
    assert not bar.plain
    assert [step for step, _, _ in probe.seen] == [1, 2]
    for _, shown, metrics in probe.seen:
        assert "v_num" not in shown
        assert list(shown)[:6] == LABELS[:6]  # val/acc once a validation ran
        for label, name, fmt in STEP_FIELDS:
            if label in shown:
                assert shown[label] == fmt.format(metrics[name])
    assert "DAPO update" in recorded and "2/3" in recorded and "reward: " in recorded
    assert "Epoch" not in recorded and "v_num" not in recorded
    out = capsys.readouterr().out
    assert "  stopped:     error: RuntimeError: probe stop\n" in out
    assert "  updates:     2/3" in out


# ------------------------------------------------------------------------- pieces, no fitting


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", **kwargs)  # fmt: skip


def test_stop_reasons():
    early = EarlyStopping(monitor="val/acc", mode="max", stopping_threshold=0.9)
    collapse = CollapseDetector()
    trainer = _trainer(max_steps=5, callbacks=[collapse, early])
    assert stop_reason(trainer) == "the training data ran out"
    trainer.should_stop = True
    assert stop_reason(trainer) == "trainer.should_stop was set"
    early.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
    early.stopping_reason_message = "Stopping threshold reached: val/acc = 0.91 >= 0.9."
    assert (
        stop_reason(trainer) == "EarlyStopping: Stopping threshold reached: val/acc = 0.91 >= 0.9."
    )
    collapse.stop_reason = "entropy collapsed below 0.01 for 3 updates."
    assert stop_reason(trainer) == "CollapseDetector: entropy collapsed below 0.01 for 3 updates."
    interrupt.request_stop("SIGTERM")
    try:
        assert stop_reason(trainer) == "stop requested (SIGTERM)"
        assert (
            stop_reason(trainer, interrupt.StopRequested("SIGTERM")) == "stop requested (SIGTERM)"
        )
    finally:
        interrupt.clear_stop_request()
    assert (
        stop_reason(trainer, KeyboardInterrupt()) == "interrupted (Ctrl-C twice: aborted at once)"
    )
    assert stop_reason(trainer, ValueError("bad value\ndetails")) == "error: ValueError: bad value"
    assert stop_reason(trainer, MemoryError()) == "error: MemoryError"


def test_the_stop_reason_of_the_module_when_the_data_side_ends_training():
    """Issue 64: every prompt retired (``EndOfTraining``) sets ``DAPOModule.stop_reason`` and
    ``trainer.should_stop``; the summary said "trainer.should_stop was set"."""

    class Module(pl.LightningModule):
        stop_reason = "every prompt is retired (solved): nothing left to train on"

    trainer = _trainer(max_steps=5)
    trainer.strategy.connect(Module())
    trainer.should_stop = True
    assert stop_reason(trainer) == f"Module: {Module.stop_reason}"


def test_summary_without_logger_or_validation():
    text = run_summary(_trainer(max_steps=7, enable_checkpointing=False), [])
    assert text.splitlines() == [
        "DAPO fit summary",
        "  stopped:     the training data ran out",
        "  updates:     0/7",
    ]
    best = run_summary(_trainer(max_steps=7), [(0, 0.1), (10, 0.8), (20, 0.8), (30, 0.5)], 61.2)
    assert "  val/acc:     best 0.800 (update 10), last 0.500 (update 30)" in best
    assert "  updates:     0/7 in 61 s" in best


def test_fields_and_validation_line():
    metrics = {"rollout/reward_mean": 0.25, "data/kept_frac": 0.5, "time/update_s": 1.234}
    assert step_fields(metrics) == {"reward": "+0.250", "kept": "0.50", "upd": "1.23s"}
    trainer = _trainer(max_steps=4)
    assert validation_line(trainer, {"val/pass@4": 1.0}) is None
    line = validation_line(trainer, {"val/pass@16": 0.9, "val/acc": 0.5, "val/pass@4": 0.7})
    assert line == "validation at update 0: val/acc 0.500 | val/pass@16 0.900 | val/pass@4 0.700"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "tqdm"}, "mode must be 'auto', 'rich' or 'plain', got 'tqdm'"),
     ({"plain_every_n_steps": 0},
      r"DAPOProgressBar.plain_every_n_steps must be an integer >= 1 \(.*\), got 0")],
)  # fmt: skip
def test_bar_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DAPOProgressBar(**kwargs)


# ----------------------------------------------------------------------------- known noise


def _logged(name: str, message: str) -> list[str]:
    """What reaches a handler of logger ``name`` when ``message`` is logged there."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


@pytest.mark.parametrize("noise", KNOWN_NOISE, ids=lambda n: n.pattern[:40])
def test_each_known_message_is_hidden_and_others_are_not(noise):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        quiet_known_warnings()  # twice: harmless
        if noise.source == WARNINGS:
            warnings.warn(noise.example, UserWarning, stacklevel=1)
            warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
            assert [str(w.message) for w in caught] == ["an unrelated warning"]
        else:
            assert _logged(noise.source, noise.example) == []
            assert _logged(noise.source, "an unrelated message") == ["an unrelated message"]
            assert len(logging.getLogger(noise.source).filters) == 1


@pytest.mark.parametrize("noise", PARTIAL_RELOAD_NOISE, ids=lambda n: n.source.split(".")[-1])
def test_partial_reload_lines_are_hidden_only_during_a_bucketed_push(noise):
    before = list(logging.getLogger(noise.source).filters)
    with quiet_partial_reload():
        assert _logged(noise.source, noise.example) == []
        assert _logged(noise.source, "an unrelated message") == ["an unrelated message"]
    assert logging.getLogger(noise.source).filters == before
    assert _logged(noise.source, noise.example) == [noise.example]  # a one-call push shows it


def test_user_metrics_keep_the_sync_dist_hint():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("It is recommended to use `self.log('my/metric', ..., sync_dist=True)`",
                      stacklevel=1)  # fmt: skip
    assert len(caught) == 1


def test_vllm_log_level_defaults_to_warning_unless_set(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    quiet_known_warnings()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet_known_warnings()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
