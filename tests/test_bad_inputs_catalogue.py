"""Issue 63 part C, the next bad-input catalogue: a prompt file left with one prompt under a
validation fraction, a binary / empty / tab-indented config file or one with a key given twice,
a value of the wrong type in YAML, ``sft --model``, ``validate --ckpt_path auto`` with no
checkpoint, a reward failure said more than once, a slow reward missing from the step line, and
a huge prompt file that loads in silence. Each is driven through the real CLI (in this process
through its entry point, as tests/test_bad_inputs.py does) and ends with exactly one ``error:``
line naming the field and the fix, exit status 2, no traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._harness import ARITHMETIC_RUN, QUICKSTART, write_run_config
from tests.test_bad_inputs import assert_one_error_line, fit_config, fit_main
from tests.test_envs import tiny  # noqa: F401, F811 - the fixture


@pytest.fixture(autouse=True)
def _clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["dapo-lightning"])  # the CLI reads only ``args``


def main_code(argv: list[str], capfd: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``dapo-lightning ARGV`` through the console script's entry point, in this process:
    (exit status, stdout, stderr)."""
    from dapo_lightning.cli import main

    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capfd.readouterr()
    return code, out, err


def assert_parser_error(code: int, err: str, *fragments: str) -> None:
    """The parser's own refusal: exit 2, its usage and tip lines and one ``error:`` line (no
    union dump, no traceback) holding every fragment."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 3, err[-3000:]  # usage, tip, the error
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --------------------------------------------- item 12 and the minor config-file faults
@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (bytes(range(256)) * 8, ["not a YAML text file", "byte 128", "Fix: give a YAML"]),
        (b"", ["is empty", "Fix:"]),
        (b"# only a comment\n\n   # and another\n", ["is empty", "Fix:"]),
        (b"trainer:\n\tmax_steps: 3\n", ["line 2 is indented with a tab", "Fix: replace the tab"]),
        (
            b"trainer:\n  max_steps: 3\n  accelerator: cpu\n  max_steps: 5\n",
            ["line 4: the key trainer.max_steps is given twice (first on line 2)", "Fix: delete"],
        ),
        (b"- trainer\n- model\n", ["the top level is a list", "Fix:"]),
    ],
    ids=["binary", "empty", "comments-only", "tab", "duplicate-key", "list"],
)
def test_config_file_fault_is_one_error_line(tmp_path, capfd, content, fragments):
    """A binary config was a 71-line UnicodeDecodeError traceback (exit 1); an empty or
    comment-only one said "Unexpected config"; a tab-indented one never said "tab"; a key
    given twice won silently (exit 0). Each is one line naming the file and the fix, exit 2."""
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    code, err = fit_main(["--config", QUICKSTART, "--config", str(config), "--print_config"], capfd)
    assert_one_error_line(code, err, str(config), *fragments)


def test_sft_config_with_a_duplicate_key_is_one_error_line(tmp_path, capfd):
    config = tmp_path / "sft.yaml"
    config.write_text("model_name_or_path: a\nmodel_name_or_path: b\n")
    code, _, err = main_code(["sft", "--config", str(config)], capfd)
    assert_one_error_line(code, err, "the key model_name_or_path is given twice")


# -------------------------------------------------------- item 14: a wrong type in YAML
@pytest.mark.parametrize(
    ("yaml_text", "fragments"),
    [
        (
            "model:\n  init_args:\n    optimizer:\n      class_path: torch.optim.AdamW\n"
            "      init_args:\n        lr: fast\n",
            ["model.init_args.optimizer.init_args.lr: expected a number", "got fast", "Fix:"],
        ),
        (
            "data:\n  - a\n  - b\n",
            ["data: expected a DAPODataModule", "got ['a', 'b'] (a list)", "Fix:"],
        ),
        (
            "data:\n  init_args:\n    sampling:\n      max_tokens: lots\n",
            ["data.init_args.sampling.max_tokens: expected a whole number", "got lots", "Fix:"],
        ),
        ("trainer:\n  max_steps: abc\n", ["trainer.max_steps: expected a whole number"]),
        (
            "model:\n  init_args:\n    loss:\n      loss_agg_mode: token-sum\n",
            ["model.init_args.loss.loss_agg_mode: expected one of 'token-mean'", "token-sum"],
        ),
    ],
    ids=["lr-fast", "data-list", "max-tokens", "max-steps", "choice"],
)
def test_wrong_type_in_yaml_is_one_error_line(tmp_path, capfd, yaml_text, fragments):
    """The parser's union dump (13-19 lines) is one line: the field as the config spells it,
    what it expects, what it got and the fix; exit 2."""
    config = tmp_path / "wrong.yaml"
    config.write_text(yaml_text)
    code, err = fit_main(["--config", QUICKSTART, "--config", str(config), "--print_config"], capfd)
    assert_parser_error(code, err, *fragments)


def test_wrong_type_on_the_command_line_is_one_error_line(capfd):
    code, err = fit_main(
        ["--config", QUICKSTART, "--model.optimizer.lr=fast", "--print_config"], capfd
    )
    assert_parser_error(code, err, "model.init_args.optimizer.init_args.lr: expected a number")


# ------------------------------------------ item 11: one prompt left under a validation share
def _prompt_file(tmp_path: Path, rows: int, distinct: bool) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": f"{i if distinct else 1}+1=", "reward_model": {"ground_truth": "2"}}
        for i in range(rows)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    return path


@pytest.mark.parametrize(("rows", "distinct"), [(1, True), (100, False)], ids=["one", "dups"])
def test_one_prompt_under_a_validation_fraction_is_one_error_line(
    tiny_checkpoint, tmp_path, capfd, rows, distinct
):
    """A 48-line traceback naming ``val_fraction``; now one line naming
    data.validation.fraction and the fix, exit 2."""
    config = fit_config(tmp_path, tiny_checkpoint)
    prompts = {
        "train_files": str(_prompt_file(tmp_path, rows, distinct)),
        "task": None,
        "apply_chat_template": False,
        "max_prompt_length": 16,
    }
    code, err = fit_main(
        [
            f"--config={config}",
            f"--data.prompts={json.dumps(prompts)}",
            "--data.validation.fraction=0.2",
        ],
        capfd,
    )
    assert_one_error_line(
        code, err, "data.validation.fraction=0.2", "of the 1 training prompt", "Fix:"
    )


# ----------------------------------------------------------------- minor: sft --model
def test_sft_abbreviated_option_suggests_the_option(capfd):
    code, _, err = main_code(["sft", "--model", "x"], capfd)
    assert_one_error_line(code, err, "model is not an option", "Did you mean model_name_or_path?")


# ------------------------------------------- minor: validate --ckpt_path auto, no checkpoint
def test_validate_auto_without_a_checkpoint_is_one_error_line(tiny_checkpoint, tmp_path, capfd):
    """It validated the base model and exited 0, as if the run's checkpoint had been scored."""
    config = fit_config(tmp_path, tiny_checkpoint)
    code, _, err = main_code(["validate", f"--config={config}", "--ckpt_path", "auto"], capfd)
    assert_one_error_line(code, err, "no checkpoint found", "Fix:")


# ---------------------------------------- minor: a slow reward's time on the per-step line
def test_step_line_shows_the_scoring_time():
    from dapo_lightning.callbacks.progress import step_fields

    assert step_fields({"data/score_seconds": 1.234})["score"] == "1.23s"


# ------------------------------------------ minor: a reward failure is said once, not three times
def test_reward_failure_message_is_printed_once(tiny_checkpoint, tmp_path, capfd):
    """The RunGuard's line, the error line and the summary's "stopped:" each repeated the
    reward's message; the error line says it, the others name the error only."""
    config = write_run_config(
        tmp_path / "fit.yaml",
        tmp_path / "run",
        tiny_checkpoint,
        base=ARITHMETIC_RUN,
        trainer={
            "enable_progress_bar": True,
            "enable_checkpointing": True,
            "callbacks": [
                {"class_path": "dapo_lightning.callbacks.DAPOProgressBar"},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True},
                },
            ],
        },
    )
    reward = {"class_path": "_catalogue_rewards.Unreachable"}
    code, out, err = main_code(
        ["fit", f"--config={config}", f"--data.reward={json.dumps(reward)}"], capfd
    )
    assert_one_error_line(
        code, err, "failed to score with Unreachable", "reward backend unreachable"
    )
    assert (out + err).count("failed to score with Unreachable") == 1, out + err


# ------------------------------------------- item 15: a large prompt file loads in silence
def test_large_prompt_file_says_its_progress_and_warns_of_a_huge_validation(
    tiny_checkpoint, tmp_path, capfd, monkeypatch
):
    """A 200 MB file loaded for minutes without a line, then validated 390k held-out prompts
    without one. Here the thresholds are lowered (a 40k-row file): the reading and the
    tokenizing say how far they are, and the held-out set's size is one warning naming the
    setting that caps it (trainer.limit_val_batches)."""
    from dapo_lightning.data.prompts import loading, progress

    monkeypatch.setattr(progress, "FIRST_LINE_S", 0.0, raising=False)
    monkeypatch.setattr(progress, "EVERY_S", 0.0, raising=False)
    monkeypatch.setattr(loading, "HUGE_VALIDATION_RESPONSES", 1000, raising=False)
    path = tmp_path / "big.jsonl"
    rows = (
        {"prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}} for i in range(40_000)
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = fit_config(tmp_path, tiny_checkpoint)
    prompts = {
        "train_files": str(path),
        "task": None,
        "apply_chat_template": False,
        "max_prompt_length": 16,
    }
    code, err = fit_main(
        [
            f"--config={config}",
            f"--data.prompts={json.dumps(prompts)}",
            "--data.validation.fraction=0.05",
            "--trainer.max_steps=0",
            "--trainer.num_sanity_val_steps=0",
        ],
        capfd,
    )
    assert code == 0, err[-3000:]
    assert f"prompts: reading {path}: " in err and " MB, " in err, err[-3000:]
    assert "prompts: removing duplicates: " in err, err[-3000:]
    assert "prompts: tokenizing: " in err and "of 38,000 prompts" in err, err[-3000:]
    assert "warning: 2,000 held-out prompts (data.validation.fraction=0.05 of 40,000" in err, err[
        -3000:
    ]
    assert "trainer.limit_val_batches" in err, err[-3000:]


# ------------------------------------- minor: a 100k-character observation tokenised in full
def test_huge_observation_is_cut_before_it_is_tokenized(tiny, capfd, monkeypatch):  # noqa: F811
    """An observation of 100k characters was tokenised whole (41.6 s with a real tokenizer, and
    transformers' "Token indices sequence length" warning leaked) before the episode was cut
    for having no room for it. Now its characters show it cannot fit: it is never tokenised,
    the episode ends as "length" and is counted in env/observations_cut."""
    from dapo_lightning.rollout.base import SamplingConfig
    from tests.test_envs import ScriptedEnv, make_runner

    _, _, records = tiny
    runner = make_runner(tiny, lambda: ScriptedEnv(observation="x" * 100_000, turns=5))
    runner.max_episode_tokens = 80
    formatted: list[int] = []
    text = runner.formatter.text
    monkeypatch.setattr(
        runner.formatter, "text", lambda obs: formatted.append(len(obs)) or text(obs)
    )
    groups = runner.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=8))
    assert all(e.finish_reason == "length" for g in groups for e in g)
    assert runner.take_stats()["env/observations_cut"] == 4
    assert formatted == [], formatted
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_batched_tokenizing_gives_each_prompt_its_own_ids(tiny_checkpoint):
    """tokenize_records encodes in batch calls (the 200 MB file's 1.16M prompts); the ids are
    those of encode_prompt, one prompt at a time, with and without the chat template."""
    from transformers import AutoTokenizer

    from dapo_lightning.data.prompts.sources import records_from_rows, tokenize_records
    from dapo_lightning.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    rows = [
        {"prompt": f"{i} + {i * 7} =", "reward_model": {"ground_truth": "0"}} for i in range(2500)
    ]
    for template in (False, True) if tokenizer.chat_template else (False,):
        records, _ = tokenize_records(
            records_from_rows(rows), tokenizer, apply_chat_template=template
        )
        assert [r.prompt_ids for r in records] == [
            encode_prompt(tokenizer, r.prompt, template) for r in records
        ]
