"""Issue 53 part 3, the hostile-input catalogue: inputs that still ended a run with a traceback,
exit 1, a silent wait or the wrong words. Each test drives the real CLI (in this process through
its entry point where it can, in a subprocess where the exit status of the process is the
point) on the tiny model, with real rewards, environments, signals and checkpoints."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dapo_lightning.testing import make_tiny_checkpoint
from tests._harness import ARITHMETIC_RUN, CLI, QUICKSTART, REPO, cli_env, run_cli, write_run_config
from tests.test_bad_inputs import assert_one_error_line, fit_config, fit_main


# ------------------------------------------- item 1: a reward that starts hanging mid-run
@pytest.mark.timeout(300)
def test_reward_hanging_mid_run_is_one_error_line_exit_2_with_a_line_while_it_waits(
    tiny_checkpoint, tmp_path, capfd
):
    """A reward that scored update 1, then hangs: the run said nothing for minutes, then exit
    1 with a traceback. Now one line says the timeout and the retry, and the round fails within
    3 x timeout_s + 30 s as one ``error:`` line naming the fix, exit 2."""
    config = fit_config(tmp_path, tiny_checkpoint)
    reward = {
        "class_path": "_hanging_reward.HangsAfterCalls",
        "init_args": {"marker": str(tmp_path / "marker.txt"), "ok_calls": 1},
    }
    t0 = time.monotonic()
    code, err = fit_main(
        [
            f"--config={config}",
            f"--data.reward={reward}",
            "--data.scoring.timeout_s=1",
            "--trainer.max_steps=3",
        ],
        capfd,
    )
    elapsed = time.monotonic() - t0
    assert_one_error_line(code, err, "failed to score with HangsAfterCalls", "timeout_s")
    assert "scoring: reward HangsAfterCalls timed out" in err, err[-3000:]
    assert elapsed < 3 * 1 + 30, elapsed


# ----------------------------------------- item 3: an environment that fails every episode
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ("_hostile.ResetRaises", "tool server down"),
        ("_hostile.StepReturnsStr", "str"),
        ("_hostile.StepSleeps", "timeout"),
    ],
    ids=["reset-raises", "step-returns-str", "step-sleeps"],
)
def test_environment_failing_every_episode_is_one_error_line_exit_2(
    tiny_checkpoint, tmp_path, capfd, env, fragment
):
    """Exit 1 with a traceback (the message itself was clear); now one line, exit 2."""
    config = fit_config(tmp_path, tiny_checkpoint)
    environment = (
        f'{{"name": "{env}", "kwargs": {{}}, "max_turns": 2, "call_timeout_s": 0.5, '
        '"add_instructions": false}'
    )
    # the random model ends its turns on a third of the byte tokens: the environment is called
    stops = f"{{eos_token_id: {[1, *range(100, 190)]}}}"
    code, err = fit_main(
        [
            f"--config={config}",
            f"--data.environment={environment}",
            f"--data.engine_kwargs={stops}",
            "--data.sampling.max_tokens=8",
        ],
        capfd,
    )
    assert_one_error_line(code, err, "episodes failed in the environment", fragment)


# ------------------------------------------------------------ item 4: Ctrl-C twice exits 130
@pytest.mark.timeout(300)
def test_ctrl_c_twice_inside_fit_exits_130(tiny_checkpoint, tmp_path):
    """Ctrl-C twice exited 1 once in 7 tries: when the second SIGINT arrived while ``fit`` ran,
    its ``KeyboardInterrupt`` met Lightning's handler, which exits 1. Here both arrive inside
    ``fit`` (a callback sends them): exit 130, the stop said, no traceback."""
    config = write_run_config(
        tmp_path / "fit.yaml",
        tmp_path / "run",
        tiny_checkpoint,
        base=ARITHMETIC_RUN,
        trainer={"max_steps": 3, "callbacks": [{"class_path": "_hostile.CtrlCTwice"}]},
    )
    proc = run_cli("fit", f"--config={config}", timeout=240)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "SIGINT received" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# ------------------------------------------- item 5: plot of a missing or empty folder
@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda tmp: tmp / "no-such-run", "no-such-run does not exist: give the run directory"),
        (lambda tmp: tmp, "No metrics.csv under"),
    ],
    ids=["missing", "empty"],
)
def test_plot_of_a_missing_or_empty_folder_is_one_error_line_exit_2(
    tmp_path, capfd, make, fragment
):
    """A FileNotFoundError traceback; now one ``error:`` line naming the folder, exit 2."""
    from dapo_lightning.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plot", str(make(tmp_path))])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("dapo-lightning plot: error: "), err
    assert fragment in lines[0], lines[0]


# ----------------------------------------- item 2: resume with a model of another shape
SAVING = {
    "enable_checkpointing": True,
    "callbacks": [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": "checkpoints", "save_last": True, "save_top_k": 0},
        }
    ],
}


@pytest.mark.timeout(300)
def test_resume_with_a_model_of_another_shape_is_one_error_line_exit_2(
    tiny_checkpoint, tmp_path, capfd
):
    """``--ckpt_path auto`` after the model's hidden size changed: exit 1, a traceback and ~30
    lines of ``size mismatch``. Now one line naming the checkpoint, the first parameter that
    differs, both shapes and the fix, exit 2."""
    run = tmp_path / "run"
    config = write_run_config(
        tmp_path / "fit.yaml", run, tiny_checkpoint, base=ARITHMETIC_RUN, trainer=SAVING
    )
    code, err = fit_main([f"--config={config}"], capfd)
    assert code == 0 and (run / "checkpoints" / "last.ckpt").is_file(), err[-3000:]
    wider = make_tiny_checkpoint(tmp_path / "wider", hidden_size=64, intermediate_size=128)
    code, err = fit_main(
        [
            f"--config={config}",
            f"--model.model_name_or_path={wider}",
            "--trainer.max_steps=2",
            "--ckpt_path=auto",
        ],
        capfd,
    )
    assert_one_error_line(
        code,
        err,
        f"ckpt_path: {run / 'checkpoints' / 'last.ckpt'} does not fit the model: ",
        "policy.model.embed_tokens.weight has shape [259, 128] in the checkpoint but [259, 64]"
        f" in model.model_name_or_path={wider} (and 20 more parameters)",
        "more parameters",
        "Fix: resume with the model the checkpoint was trained from",
    )
    assert "size mismatch" not in err


# --------------------------------------- item 6: a bad key or class path is one error line


@pytest.mark.parametrize(
    ("make_args", "line"),
    [
        (
            lambda tmp: ["--data.init_args.scoring.workerz", "2"],
            "data.init_args.scoring.workerz is not an option of DAPODataModule. Did you mean "
            "data.init_args.scoring.workers?",
        ),
        (
            lambda tmp: ["--model.init_args.loss.clip_ratio_hihg", "0.3"],
            "model.init_args.loss.clip_ratio_hihg is not an option of DAPOModule. Did you mean "
            "model.init_args.loss.clip_ratio_high?",
        ),
        (
            lambda tmp: ["--model.optimizer.init_args.lrr", "0.1"],
            "model.init_args.optimizer.init_args.lrr is not an option of AdamW. Did you mean "
            "model.init_args.optimizer.init_args.lr?",
        ),
        (
            lambda tmp: ["--model.lr_scheduler.init_args.end_factr", "0.1"],
            "model.init_args.lr_scheduler.init_args.end_factr is not an option of LinearLR. Did "
            "you mean model.init_args.lr_scheduler.init_args.end_factor?",
        ),
        (
            lambda tmp: ["--data.rewrd", "dapo"],
            "data.init_args.rewrd is not an option of DAPODataModule. Did you mean "
            "data.init_args.reward?",
        ),
        (
            lambda tmp: ["--config", str(_yaml(tmp, "data: {init_args: {scoring: {workerz: 2}}}"))],
            "data.init_args.scoring.workerz is not an option of DAPODataModule. Did you mean "
            "data.init_args.scoring.workers?",
        ),
        (
            lambda tmp: ["--config", str(_yaml(tmp, "trainer: {max_stepz: 3}"))],
            "trainer.max_stepz is not an option. Did you mean trainer.max_steps?",
        ),
        (
            lambda tmp: ["--trainer.callbacks+=dapo_lightning.callbacks.PhaseTrase"],
            "trainer.callbacks: class_path dapo_lightning.callbacks.PhaseTrase does not exist: "
            "dapo_lightning.callbacks has no PhaseTrase. Did you mean "
            "dapo_lightning.callbacks.PhaseTrace?",
        ),
        (
            lambda tmp: ["--trainer.callbacks+=dapo_lightnin.callbacks.PhaseTrace"],
            "trainer.callbacks: class_path dapo_lightnin.callbacks.PhaseTrace does not import: "
            "no module named dapo_lightnin.",
        ),
    ],
    ids=["cli-group-key", "model-key", "optimizer-key", "scheduler-key", "data-key",
         "yaml-group-key", "yaml-trainer-key", "callback-class", "callback-module"],
)  # fmt: skip
def test_bad_key_or_class_path_is_one_error_line_with_the_closest_name(
    tmp_path, capfd, make_args, line
):
    """A 9-13-line union dump (an unknown key under model / data init_args, a class_path typo);
    now one ``error:`` line naming the key and the closest valid one, and the fix, exit 2."""
    code, err = fit_main(["--config", QUICKSTART, *make_args(tmp_path), "--print_config"], capfd)
    errors = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"error: {line} Fix: correct the "), errors[0]
    assert len(err.strip().splitlines()) <= 3, err  # usage, tip, the error


def _yaml(tmp: Path, text: str) -> Path:
    path = tmp / "bad.yaml"
    path.write_text(text + "\n")
    return path


# ------------------------------------------------------------------ item 7: the wrong words
def test_max_steps_0_says_no_update_was_asked_for(tiny_checkpoint, tmp_path, capfd):
    """``--trainer.max_steps 0`` (a fit that only sets up: writes the first-use model) ended
    saying the training data ran out; it says what it was."""
    override = write_run_config(tmp_path / "o.yaml", tmp_path / "run", tiny_checkpoint)
    args = ["--config", QUICKSTART, "--config", str(override), "--trainer.max_steps=0"]
    from dapo_lightning.cli import main

    main(["fit", *args])  # exit 0: no SystemExit
    out = capfd.readouterr().out  # the summary
    assert "stopped:     trainer.max_steps=0: no update was asked for (give max_steps >= 1" in out
    assert "ran out" not in out, out[-3000:]


def test_export_of_a_plain_folder_says_what_it_is_and_what_export_expects(
    tiny_checkpoint, tmp_path, capfd
):
    """A plain folder was called "a sharded DeepSpeed/FSDP checkpoint"."""
    from dapo_lightning.cli import main

    run = tmp_path / "checkpoints"
    run.mkdir()
    (run / "last.ckpt").write_bytes(b"")
    for folder, what in ((run, "a folder"), (tiny_checkpoint, "a Hugging Face model folder")):
        with pytest.raises(SystemExit) as exc:
            main(["export", str(folder), str(tmp_path / "out")])
        err = capfd.readouterr().err
        assert exc.value.code == 2 and "sharded" not in err, err
        assert f"checkpoint {folder} is {what}, not a checkpoint" in err, err
        assert "export expects one Lightning .ckpt file" in err, err
        assert ("it holds last.ckpt" in err) == (folder == run), err


def test_environment_path_that_is_not_found_says_so(tiny_checkpoint, tmp_path, capfd):
    """A class name missing from its module suggested decorating it with
    ``@register_environment``; it is not found: the module, the name, the closest one."""
    config = fit_config(tmp_path, tiny_checkpoint)
    code, err = fit_main(
        [f"--config={config}", '--data.environment={"name": "_episode_envs.Shopp"}'], capfd
    )
    assert_one_error_line(
        code,
        err,
        "'_episode_envs.Shopp' was not found: module _episode_envs has no 'Shopp'. "
        "Did you mean _episode_envs.Shop?",
    )
    assert "register_environment" not in err


def test_unknown_subcommand_lists_every_subcommand(capfd):
    """``dapo-lightning fitt`` listed only fit and validate."""
    from dapo_lightning.cli import COMMANDS, main

    with pytest.raises(SystemExit) as exc:
        main(["fitt"])
    err = capfd.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("dapo-lightning: error: unknown subcommand 'fitt'. Did you mean fit?")
    assert {"fit", "validate", "sft", "plot", "export", "make-model"} <= set(COMMANDS)
    assert f"The subcommands: {', '.join(COMMANDS)} " in err, err


@pytest.mark.timeout(300)
def test_sigterm_before_the_first_update_says_so_and_exits_143(tiny_checkpoint, tmp_path):
    """A SIGTERM after the Trainer was built and before the fit is guarded (here in the data's
    ``setup``) ended the process silently (killed by the signal); now one line, exit 143."""
    config = write_run_config(
        tmp_path / "fit.yaml",
        tmp_path / "run",
        tiny_checkpoint,
        base=ARITHMETIC_RUN,
        data={"class_path": "_hostile.SigtermInSetup"},
    )
    proc = run_cli("fit", f"--config={config}", timeout=240)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    said = "SIGTERM received: stopped; nothing to save yet (no update was made)."
    assert said in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_ckpt_path_auto_says_which_file_it_took_and_names_a_later_lower_one(
    tiny_checkpoint, tmp_path, capfd
):
    """A stale run left ``last.ckpt`` at update 26; a fresh run in the same folder wrote
    ``last-v1.ckpt`` at update 22, after it. ``--ckpt_path auto`` takes the highest update
    (right for a resumed run whose files were copied: their times say nothing) and now says so,
    naming the later file and how to resume it instead (docs/running.md says the same)."""
    run = tmp_path / "run"
    config = write_run_config(
        tmp_path / "fit.yaml", run, tiny_checkpoint, base=ARITHMETIC_RUN, trainer=SAVING
    )
    code, err = fit_main([f"--config={config}"], capfd)
    assert code == 0, err[-3000:]
    saved = run / "checkpoints" / "last.ckpt"
    state = torch.load(saved, weights_only=False)
    stale, fresh = saved, run / "checkpoints" / "last-v1.ckpt"
    for path, update, mtime in ((stale, 26, 1_000_000), (fresh, 22, 2_000_000)):
        torch.save({**state, "global_step": update}, path)
        os.utime(path, (mtime, mtime))
    code, err = fit_main([f"--config={config}", "--trainer.max_steps=2", "--ckpt_path=auto"], capfd)
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("--ckpt_path auto: "))
    assert line == (
        f"--ckpt_path auto: resuming from {stale} (update 26, the highest of 2 loadable "
        f"checkpoints; read from each file); {fresh} was written after it, at update 22 (a "
        f"fresh run started in this folder?): to resume that run instead, give --ckpt_path "
        f"{fresh}"
    ), line


@pytest.mark.slow  # real spawned reward workers and their restart: ~1-2 min on 2 shared cores
@pytest.mark.timeout(600)
def test_worker_reward_hanging_mid_run_fails_the_cli_fit_within_3_timeouts_plus_30_s(
    tiny_checkpoint, tmp_path
):
    """The probe's case: 2 spawned worker processes, timeout_s 3, a reward that hangs after
    its first calls (updates already made). The fit waited for the round's budget (8.7 min)
    and ended with a traceback; now it ends within 3 x 3 s + 30 s of the hang, one line said
    while it waits, one ``error:`` line, exit 2."""
    marker = tmp_path / "marker.txt"
    override = write_run_config(
        tmp_path / "o.yaml",
        tmp_path / "run",
        tiny_checkpoint,
        data={
            "init_args": {
                "reward": {
                    "class_path": "_hanging_reward.HangsAfterCalls",
                    "init_args": {"marker": str(marker), "ok_calls": 6},
                },
                "scoring": {"in_process": False, "workers": 2, "timeout_s": 3},
            }
        },
    )
    proc = subprocess.Popen(
        [CLI, "fit", "--config", QUICKSTART, "--config", str(override), "--trainer.max_steps=50"],
        cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    hang = None
    while proc.poll() is None:
        if hang is None and marker.exists() and len(marker.read_text().splitlines()) > 6:
            hang = time.monotonic()
        time.sleep(0.1)
    ended = time.monotonic()
    err = proc.stderr.read()
    assert hang is not None, err[-3000:]
    assert_one_error_line(proc.returncode, err, "failed to score with HangsAfterCalls")
    assert "scoring: reward HangsAfterCalls timed out" in err, err[-3000:]
    assert ended - hang < 3 * 3 + 30, (ended - hang, err[-3000:])
