"""The ``dapo-lightning`` console entry end to end: fit, resume, validate, --print_config,
subclasses by ``class_path``, help, bad keys and bad classes, model creation on first use, and
the SLURM script's launch line.

Every run goes through the real console script in a subprocess, on the tiny random model with
tiny settings (2 updates of 4 groups x 4 responses of <= 4 tokens). The random model never
answers right, so dynamic sampling is switched off (``filter_metric: null``) or it would give up.
(The run guard's saves, signals and resumes: tests/test_run_guard.py.)
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from dapo_lightning.cli import ConfigError, build_cli, main
from dapo_lightning.plot import find_metrics_csvs, read_run_metrics
from tests._harness import CLI, QUICKSTART, REPO, TINY, check, run_cli, write_run_config

# Metrics that do not depend on wall-clock time: equal in two runs with the same config and seed.
DETERMINISTIC = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "update/loss",
    "update/grad_norm",
    "update/entropy",
    "val/acc",
)


def write_override(path: Path, run_dir: Path, model_dir: Path) -> Path:
    """A second --config: quickstart.yaml's run in ``run_dir`` (its relative paths follow
    default_root_dir), a checkpoint every update, on the tiny model with tiny batches (lists
    such as trainer.callbacks are replaced whole): the harness's base run config."""
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": "checkpoints",
                "save_last": True,
                "every_n_train_steps": 1,
                "save_top_k": 0,
            },
        },
        {
            "class_path": "dapo_lightning.callbacks.OverlongRewardShaping",
            "init_args": {"buffer_length": 2},
        },
        {"class_path": "dapo_lightning.callbacks.ValidateAtStart"},
    ]
    return write_run_config(path, run_dir, model_dir, trainer={"callbacks": callbacks})


def read_csv(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {run_dir}, found {files}"
    with open(files[0], newline="") as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> list[tuple[str, float]]:
    return [(r["step"], float(r[key])) for r in rows if r.get(key) not in (None, "")]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory):
    """One 2-update fit through the console script; the model is written on first use."""
    root = tmp_path_factory.mktemp("base")
    run_dir, model_dir = root / "run", root / "model"
    override = write_override(root / "override.yaml", run_dir, model_dir)
    args = ["--config", QUICKSTART, "--config", str(override), *TINY]
    proc = check(run_cli("fit", *args, "--create_model_if_missing", "tiny", "--ckpt_path", "auto"))
    return {"run_dir": run_dir, "model_dir": model_dir, "args": args, "proc": proc}


def test_fit_end_to_end_hf(base_run):
    run_dir, model_dir = base_run["run_dir"], base_run["model_dir"]
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    assert "no checkpoint yet, starting fresh" in base_run["proc"].stderr
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    assert len(series(rows, "rollout/reward_mean")) == 2
    # the untrained validation (ValidateAtStart, step -1), then one after each rollout step
    val = series(rows, "val/acc")
    assert [step for step, _ in val] == ["-1", "0", "1"] and all(0 <= v <= 1 for _, v in val)
    assert all(v == v and v >= 0 for _, v in series(rows, "update/grad_norm"))
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    saved = list(run_dir.rglob("config.yaml"))
    assert saved and "max_steps: 2" in saved[0].read_text()


def test_fit_says_its_thread_choice_in_one_line(base_run):
    # The tiny model (written on first use) runs on one thread, idle OpenMP threads sleep
    # (dapo_lightning/threads.py); PYTHONPATH-only env, so no OMP_NUM_THREADS from the test.
    lines = [x for x in base_run["proc"].stderr.splitlines() if x.startswith("threads: ")]
    expected = ("threads: 1 (auto: 0.3M parameters" if "OMP_NUM_THREADS" not in os.environ
                else f"threads: {os.environ['OMP_NUM_THREADS']} (OMP_NUM_THREADS=")  # fmt: skip
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert lines[0].endswith("OMP_WAIT_POLICY=PASSIVE)") or "OMP_WAIT_POLICY" in os.environ


def test_print_config_round_trip(base_run, tmp_path):
    """Print the config, save it, print it again from the file (identical), then train from the
    file alone: the same metrics as the run it was printed from."""
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    args = ["--config", QUICKSTART, "--config", str(override), *TINY, "--ckpt_path", "auto"]
    printed = check(run_cli("fit", *args, "--print_config")).stdout
    assert "max_tokens: 4" in printed and str(run_dir) in printed
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    again = check(run_cli("fit", "--config", str(saved), "--print_config")).stdout
    assert again == printed

    check(run_cli("fit", "--config", str(saved)))
    ours, theirs = read_csv(run_dir), read_csv(base_run["run_dir"])
    for key in DETERMINISTIC:
        a, b = series(ours, key), series(theirs, key)
        assert a, f"{key} was not logged"
        assert [step for step, _ in a] == [step for step, _ in b], key
        assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-5, abs=1e-6), key


def test_resume_through_sbatch_script(base_run, tmp_path):
    """The SLURM script, launched without srun, resumes from last.ckpt via --ckpt_path auto and
    continues at update 3 (what a requeued job does)."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run["run_dir"] / "checkpoints", run_dir / "checkpoints")
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    proc = subprocess.run(
        ["bash", str(REPO / "slurm" / "dapo.sbatch"), QUICKSTART, "--config", str(override),
         *TINY, "--trainer.max_steps", "3"],
        cwd=REPO,
        env={**os.environ, "LAUNCH": "env", "DAPO_CLI": CLI, "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    check(proc)
    assert "--trainer.num_nodes 1 --trainer.devices 1 --ckpt_path auto" in proc.stdout
    assert f"resuming from {(run_dir / 'checkpoints' / 'last.ckpt').resolve()}" in proc.stderr
    assert [v for _, v in series(read_csv(run_dir), "rollout/step")] == [3.0]


def test_validate_only(base_run, tmp_path):
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    ckpt = base_run["run_dir"] / "checkpoints" / "last.ckpt"
    proc = check(
        run_cli(
            "validate", "--config", QUICKSTART, "--config", str(override), *TINY,
            "--ckpt_path", str(ckpt),
        )
    )  # fmt: skip
    assert "val/acc" in proc.stdout  # (the override has no progress bar: no "validation at" line)
    rows = read_csv(run_dir)
    assert [r["step"] for r in rows] == ["1"]  # where the fit logs the validation after update 2
    assert (run_dir / "logs-validate").is_dir() and not (run_dir / "logs").exists()
    assert len(series(rows, "val/acc")) == 1  # ValidateAtStart acts on fit only
    assert not any(k.startswith(("update/", "rollout/")) and r[k] for r in rows for k in r)
    assert not (run_dir / "checkpoints").exists()


def test_validate_then_plot_keeps_the_training_curves(base_run, tmp_path):
    """``validate --ckpt_path auto`` in the fit's own run directory logs into logs-validate/,
    so ``plot RUN_DIR`` still draws the fit's curves (it took the step-0 validation for a
    resume and dropped them)."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run["run_dir"], run_dir)
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    args = ["--config", QUICKSTART, "--config", str(override), *TINY]
    check(run_cli("validate", *args, "--ckpt_path", "auto"))
    fit_csv = next((run_dir / "logs").rglob("metrics.csv"))
    val_csv = next((run_dir / "logs-validate").rglob("metrics.csv"))
    assert len(list((run_dir / "logs").rglob("metrics.csv"))) == 1  # no version_1
    proc = check(run_cli("plot", str(run_dir)))
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert "validation accuracy" not in proc.stderr and "'entropy'" not in proc.stderr
    assert find_metrics_csvs(run_dir) == [fit_csv]
    assert find_metrics_csvs(run_dir / "logs-validate") == [val_csv]
    fit = read_run_metrics(run_dir)
    assert [s for s, _ in fit["update/loss"]] == [1.0, 2.0]  # both updates' curves are drawn
    assert [s for s, _ in fit["val/acc"]] == [-1.0, 0.0, 1.0]  # the fit's own validations


def test_subclass_by_class_path(base_run, tmp_path):
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    trace = tmp_path / "trace.txt"
    check(
        run_cli(
            "fit", "--config", QUICKSTART, "--config", str(override), *TINY,
            "--model.class_path", "_cli_subclass.TracingDAPOModule",
            "--model.init_args.trace_file", str(trace),
        )
    )  # fmt: skip
    assert trace.read_text().splitlines() == ["step 1 groups 4", "step 2 groups 4"]
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "trace/steps")] == [1.0, 2.0]
    saved = next(run_dir.rglob("config.yaml")).read_text()
    assert "class_path: _cli_subclass.TracingDAPOModule" in saved
    # the base class's own arguments still reach the subclass
    assert "clip_ratio_high: 0.28" in saved


def run_in_process(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``main(args)`` in this process (a parse error exits before anything is built)."""
    with mock.patch.object(sys, "argv", ["dapo-lightning"]), pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--model.init_args.loss.clip_ratio_hihg", "0.3"], "clip_ratio_hihg"),
        (["--data.init_args.n", "many"], "data.init_args.n"),  # n is dynamic_sampling's
        (["--trainer.max_stepz", "3"], "trainer.max_stepz"),
    ],
)
def test_bad_key_fails_with_jsonargparse_message(args, key, capsys):
    code, err = run_in_process(capsys, "fit", "--config", QUICKSTART, *args)
    assert code not in (0, None)
    assert "error:" in err and key in err


def test_bad_key_in_yaml_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  init_args:\n    max_respons_length: 8\n")
    code, err = run_in_process(capsys, "fit", "--config", QUICKSTART, "--config", str(bad))
    assert code not in (0, None)
    assert "max_respons_length" in err


def test_bad_key_console_script_exit_code():
    """The real console script exits non-zero and names the key (no traceback)."""
    proc = run_cli("fit", "--config", QUICKSTART, "--model.init_args.loss.clip_ratio_hihg", "0.3")
    assert proc.returncode != 0
    assert "clip_ratio_hihg" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.vllm
def test_fit_end_to_end_vllm(base_run, tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", run_dir, base_run["model_dir"])
    check(
        run_cli(
            "fit", "--config", QUICKSTART,
            "--config", str(REPO / "configs" / "quickstart_vllm.yaml"),
            "--config", str(override), *TINY,
            timeout=400,
        )
    )  # fmt: skip
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    assert len(series(rows, "val/acc")) == 3
    # the engine sampled from the trainer's weights: float32 engine parity (docs/design.md)
    gaps = [v for _, v in series(rows, "parity/max_abs_diff")]
    assert gaps and max(gaps) < 1e-4, gaps
    saved = next(run_dir.rglob("config.yaml")).read_text()
    assert "engine: vllm" in saved


def test_create_model_if_missing_uses_the_run_seed(tmp_path):
    """Regression: seed_everything 1 once wrote the seed-0 checkpoint (1 == True)."""
    import torch
    from safetensors.torch import load_file

    from dapo_lightning.testing import make_tiny_checkpoint

    model_dir = tmp_path / "model"
    args = [
        "--config", QUICKSTART,
        "--seed_everything", "1",
        "--create_model_if_missing", "tiny",
        "--model.init_args.model_name_or_path", str(model_dir),
        "--trainer.logger", "false",
        "--trainer.callbacks", "[]",
    ]  # fmt: skip
    with mock.patch.object(sys, "argv", ["dapo-lightning"]):
        build_cli(args, run=False)
    written = load_file(model_dir / "model.safetensors")
    seed1 = load_file(make_tiny_checkpoint(tmp_path / "s1", seed=1) / "model.safetensors")
    seed0 = load_file(make_tiny_checkpoint(tmp_path / "s0", seed=0) / "model.safetensors")
    name = "model.embed_tokens.weight"
    assert torch.equal(written[name], seed1[name])
    assert not torch.equal(written[name], seed0[name])


# ----------------------------------------------------------------------------- help
def test_top_level_help_lists_every_subcommand():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for name in ("fit", "validate", "plot", "export", "make-model"):
        assert f"  {name} " in proc.stdout, name
    assert "test" not in proc.stdout.split()


def test_fit_help_starts_with_the_dapo_options():
    proc = run_cli("fit", "--help")
    assert proc.returncode == 0
    head = "\n".join(proc.stdout.splitlines()[:20])
    assert "--model.help DAPOModule" in head and "--data.help DAPODataModule" in head
    assert "--ckpt_path auto" in head


def test_model_help_lists_the_dapo_options_not_torchs_module_zoo(capsys):
    # `policy` (a built nn.Module, for Python callers) is no CLI option: its help listed ~450
    # torch.nn.Module subclasses before clip_ratio_low (line 548 of 650).
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--model.help", "DAPOModule"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any("--model.policy" in line or "torch.nn.Linear" in line for line in lines)
    options = [line.split()[0] for line in lines if line.startswith("  --model.")]
    first = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("  --model.") and "clip_ratio_low" in line
    )
    # (after the flat options and their help text come the config groups: loss first)
    assert first < 200, f"clip_ratio_low at line {first}: {options}"
    assert len(lines) < 300


def test_lightning_test_subcommand_is_not_offered():
    proc = run_cli("test", "--config", QUICKSTART)
    assert proc.returncode == 2 and "test" in proc.stderr and "fit" in proc.stderr


# ----------------------------------------------------------------------------- bad classes
def test_init_error_reaches_the_user_unwrapped(tmp_path):
    """A DAPOModule argument error: one line with the class and its own message, no traceback,
    no jsonargparse union dump."""
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path),
        "--model.init_args.loss.clip_ratio_low", "0.3",
        "--model.init_args.loss.clip_ratio_high", "0.2",
    )  # fmt: skip
    assert proc.returncode == 2
    assert not (tmp_path / "model").exists()  # checked before the first-use model is written
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "dapo-lightning: error: PolicyLossConfig: model.loss.clip_ratio_high (0.2) < "
    ), last
    assert "Union" not in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- first-use model
def test_create_model_if_missing_refuses_a_hub_id(tmp_path):
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--create_model_if_missing", "tiny",
        "--model.init_args.model_name_or_path", "Qwen/Qwen2.5-0.5B",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "'Qwen/Qwen2.5-0.5B' looks like a Hugging Face hub id" in last
    assert "'./Qwen/Qwen2.5-0.5B'" in last  # how to ask for a local folder of that name
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_create_model_if_missing_writes_only_its_own_folder(tmp_path, capsys):
    """quickstart.yaml creates ``<run>/model``; a run pointed at another model writes nothing."""
    elsewhere = tmp_path / "elsewhere"
    args = [
        "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path / "run"),
        "--model.init_args.model_name_or_path", str(elsewhere), "--trainer.logger", "false",
    ]  # fmt: skip
    with mock.patch.object(sys, "argv", ["dapo-lightning"]):
        build_cli(args, run=False)
    err = capsys.readouterr().err
    assert "nothing written" in err and str(elsewhere) in err
    assert not elsewhere.exists() and not (tmp_path / "run" / "model").exists()


def test_create_model_if_missing_is_atomic_and_reports_each_stage(tmp_path, capsys):
    """The folder appears complete or not at all (written beside it, then renamed)."""
    run = tmp_path / "run"
    args = [
        "--config", QUICKSTART, "--trainer.default_root_dir", str(run),
        "--create_model_if_missing.kind", "tiny", "--trainer.logger", "false",
    ]  # fmt: skip
    with mock.patch.object(sys, "argv", ["dapo-lightning"]):
        cli = build_cli(args, run=False)
    assert cli.model.hparams.model_name_or_path == str(run / "model")
    assert sorted(p.name for p in run.iterdir()) == ["model"]  # no temporary folder left
    assert (run / "model" / "model.safetensors").is_file()
    lines = [line for line in capsys.readouterr().err.splitlines() if "create_model" in line]
    assert len(lines) == 2 and "does not exist: writing the 'tiny' model" in lines[0]
    assert lines[1].startswith("create_model_if_missing: done in ")


def test_unset_data_seed_is_the_run_seed(tiny_checkpoint):
    base = [
        "--config", QUICKSTART, "--model.init_args.model_name_or_path", str(tiny_checkpoint),
        "--create_model_if_missing", "null", "--trainer.logger", "false",
        "--seed_everything", "7",
    ]  # fmt: skip
    with mock.patch.object(sys, "argv", ["dapo-lightning"]):
        cli = build_cli(base, run=False)
        assert cli.datamodule.seed == 7
        assert cli.config.data.init_args.seed == 7  # what config.yaml records
        assert build_cli([*base, "--data.init_args.seed", "3"], run=False).datamodule.seed == 3
    with pytest.raises(ConfigError):  # a ValueError subclass: tests can match the message
        with mock.patch.object(sys, "argv", ["dapo-lightning"]):
            build_cli([*base, "--model.init_args.loss.clip_ratio_c", "0.5"], run=False)


def test_nested_nulls_become_one_init_args_dict():
    from dapo_lightning.cli.parser import nested_nulls

    argv = [
        "fit", "--model.init_args.loss.rollout_correction.stale_tis_cap", "null",
        "--data.dynamic_sampling.max_staleness=~", "--model.init_args.x", "null",
        "--trainer.max_steps", "null", "--data.init_args.sampling.top_k", "5",
    ]  # fmt: skip
    assert nested_nulls(argv) == [
        "fit",
        "--model", '{"init_args": {"loss": {"rollout_correction": {"stale_tis_cap": null}}}}',
        "--data", '{"init_args": {"dynamic_sampling": {"max_staleness": null}}}',
        "--model.init_args.x", "null",  # one level below init_args: jsonargparse takes it
        "--trainer.max_steps", "null",  # not a class_path root
        "--data.init_args.sampling.top_k", "5",  # not a null
    ]  # fmt: skip


def test_null_for_a_nested_optional_field_on_the_command_line(tmp_path):
    """jsonargparse refuses ``--model.init_args.loss.rollout_correction.stale_tis_cap null``
    (a union dump) though the YAML ``null`` is fine: the CLI gives it as an init_args dict,
    merged with the config's other values."""
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--print_config",
        "--model.init_args.loss.rollout_correction.stale_tis_cap", "null",
        "--data.init_args.dynamic_sampling.max_staleness=null",
    )  # fmt: skip
    check(proc)
    assert "stale_tis_cap: null" in proc.stdout and "max_staleness: null" in proc.stdout
    assert "clip_ratio_high: 0.28" in proc.stdout and "lr: 0.00025" in proc.stdout  # kept
    assert "strategy: uniform" in proc.stdout  # the quickstart's selection, beside the null
    assert "args parameter" not in proc.stderr  # LightningCLI reads sys.argv: no args warning
