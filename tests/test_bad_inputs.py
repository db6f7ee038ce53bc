"""Bad-input catalogue (docs/design.md invariant 6): each bad setting or bad data gives a clear error that
names the field and the fix, raised up front where it can be checked before work is wasted.

Cases, in order: the CLI parser (unknown keys, wrong types, bad choices), DAPOModule arguments,
DAPODataModule arguments, checks that need both (group size, mini-batch, context length), prompt
data, rewards, tokenizer / model / engine availability, and dtypes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from math import inf, nan
from pathlib import Path
from typing import Any

import pytest
import torch
from dapo_lightning.callbacks import CollapseDetector, EntropyScheduler, OverlongRewardShaping
from dapo_lightning.callbacks.collapse import Detector

from dapo_lightning import DAPODataModule, DAPOModule
from dapo_lightning.checks import ConfigError
from dapo_lightning.cli import build_cli
from dapo_lightning.data.prompts.config import PromptConfig, ScoringConfig, ValidationConfig
from dapo_lightning.data.prompts.sources import PromptDataError
from dapo_lightning.data.sampling.producer import DynamicSamplingConfig, DynamicSamplingError  # noqa: F401
from dapo_lightning.data.selection.difficulty import PromptSelectionConfig
from dapo_lightning.rewards import (
    RewardFailureError,
    RewardOutputError,
    RewardResult,
    RewardRunner,
    get_reward,
)
from dapo_lightning.rollout.base import RolloutEngine, SamplingConfig
from dapo_lightning.testing import make_tiny_checkpoint
from tests._harness import ARITHMETIC_RUN, fit, write_run_config

REPO = Path(__file__).resolve().parents[1]
# ----------------------------------------------------------------------------- the CLI parser


@pytest.fixture(autouse=True)
def _clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["dapo-lightning"])  # the CLI reads only ``args``


def _cli(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Parse ``args`` with the real CLI (no fit); returns the error text it exits with."""
    with pytest.raises(SystemExit) as exc:
        build_cli(args, run=False)
    assert exc.value.code not in (0, None)
    return capsys.readouterr().err


BASE = [
    "--model=dapo_lightning.DAPOModule",
    "--model.model_name_or_path=/nonexistent",
    "--data=dapo_lightning.DAPODataModule",
    "--data.prompts.task=arithmetic",
    "--trainer.logger=false",
]


def test_cli_unknown_model_key(capsys):
    err = _cli([*BASE, "--model.loss.clip_ratio_hihg=0.3"], capsys)
    assert "clip_ratio_hihg" in err


@pytest.mark.parametrize(
    ("option", "refusal"),
    [
        # parsed by the module class's own parser (one line naming the key: issue 53)
        (
            "--model.init_args.loss.clip_ratio_hi=0.3",
            "error: model.init_args.loss.clip_ratio_hi is not an option of DAPOModule.",
        ),
        ("--model.loss.clip_ratio_hi=0.3", "model.init_args.loss.clip_ratio_hi is not an option"),
        ("--model.batching.micro_batch=8", "model.init_args.batching.micro_batch is not an"),
        ("--data.init_args.sampling.max_tok=3", "data.init_args.sampling.max_tok is not an"),
        ("--trainer.max_ste=3", "error: trainer.max_ste is not an option."),  # fit's parser
    ],
)
def test_cli_refuses_abbreviated_options(capfd, option, refusal):
    """Issue 26: argparse took a prefix of an option for the option (``clip_ratio_hi`` set
    ``clip_ratio_high`` without a word); ``dapo-lightning fit`` refuses it: one ``error:``
    line, the option named, exit 2."""
    quickstart = str(REPO / "configs" / "quickstart.yaml")
    # --print_config: an accepted option prints the config (exit 0), it never starts a fit
    code, err = fit_main(["--config", quickstart, option, "--print_config"], capfd)
    assert code == 2, err[-3000:]
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err[-3000:]
    assert refusal in err, err[-3000:]


def test_cli_unknown_top_level_key(capsys):
    err = _cli([*BASE, "--not_a_section.x=1"], capsys)
    assert "not_a_section" in err


def test_cli_unknown_key_in_config_file(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  init_args:\n    n_samples: 4\n")
    err = _cli([*BASE, f"--config={cfg}"], capsys)
    assert "n_samples" in err


def test_cli_wrong_type_float(capsys):
    err = _cli([*BASE, "--model.loss.clip_ratio_low=abc"], capsys)
    assert "clip_ratio_low" in err and "abc" in err


def test_cli_wrong_type_int(capsys):
    err = _cli([*BASE, "--data.dynamic_sampling.n=four"], capsys)
    assert "n" in err and "four" in err


def test_cli_bad_choice_loss_agg_mode(capsys):
    err = _cli([*BASE, "--model.loss.loss_agg_mode=token-sum"], capsys)
    assert "loss_agg_mode" in err and "token-mean" in err  # names the allowed values


def test_cli_bad_choice_torch_dtype(capsys):
    err = _cli([*BASE, "--model.torch_dtype=float64"], capsys)
    assert "torch_dtype" in err and "bfloat16" in err


def test_cli_eps_high_below_eps_low(capsys):
    with pytest.raises(
        ValueError, match=r"model\.loss\.clip_ratio_high .* < model\.loss\.clip_ratio_low"
    ):
        build_cli(
            [*BASE, "--model.loss.clip_ratio_low=0.3", "--model.loss.clip_ratio_high=0.2"],
            run=False,
        )


# ----------------------------------------------------------------------------- DAPOModule args


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"loss": {"clip_ratio_low": 0.3, "clip_ratio_high": 0.2}},
            r"^model\.loss\.clip_ratio_high .*0.28 and 0.2",
        ),
        ({"loss": {"clip_ratio_low": 1.5}}, r"^model\.loss\.clip_ratio_low \(eps_low\) must be"),
        ({"loss": {"clip_ratio_c": 0.5}}, r"^model\.loss\.clip_ratio_c \(dual clip\) must be > 1"),
        (
            {"loss": {"loss_agg_mode": "token-sum"}},
            r"^model\.loss\.loss_agg_mode='token-sum' is not known; valid modes",
        ),
        (
            {"loss": {"advantage_estimator": "ppo"}},
            r"^model\.loss\.advantage_estimator='ppo' is not a registered advantage estimator; "
            "valid: grpo",
        ),
        (
            {"loss": {"objective": "ppo"}},
            r"^model\.loss\.objective='ppo' is not a registered policy objective",
        ),
        (
            {"loss": {"objective_kwargs": {"cap": 2.0}}},
            r"^model\.loss\.objective_kwargs has cap, which objective 'dapo' does not take",
        ),
        ({"loss": {"clip_ratio_high": nan}}, r"^model\.loss\.clip_ratio_high=nan is not finite"),
        ({"loss": {"entropy_coef": inf}}, r"^model\.loss\.entropy_coef=inf is not finite"),
        (
            {"loss": {"importance_sampling_level": "batch"}},
            r"^model\.loss\.importance_sampling_level must be 'token' or 'sequence'",
        ),
        ({"loss": {"objective": ""}}, r"^model\.loss\.objective must be a non-empty name"),
        (
            {"batching": {"micro_batch_size": 0}},
            r"model\.batching\.micro_batch_size must be an integer >= 1 \(",
        ),
        (
            {"batching": {"mini_batch_size": 0}},
            r"model\.batching\.mini_batch_size must be an integer >= 1 or null \(",
        ),
        ({"batching": {"ppo_epochs": 1.5}}, r"model\.batching\.ppo_epochs must be an integer"),
        (
            {"loss": {"rollout_correction": {"mode": "token_truncate", "clip_max": 0.0}}},
            r"^model\.loss\.rollout_correction\.clip_max must be > 0",
        ),
        (
            {"loss": {"rollout_correction": {"stale_tis_cap": -1.0}}},
            r"^model\.loss\.rollout_correction\.stale_tis_cap must be > 0",
        ),
        (
            {"loss": {"rollout_correction": {"stale_tis_cap": nan}}},
            r"^model\.loss\.rollout_correction\.stale_tis_cap=nan is not finite",
        ),
        (
            {"optimizer_step": {"gradient_clip_val": -1.0}},
            "model.optimizer_step.gradient_clip_val must be >= 0.*flip the gradient",
        ),
        (
            {"optimizer_step": {"gradient_clip_val": nan}},
            "model.optimizer_step.gradient_clip_val=nan is not finite",
        ),
        (
            {"optimizer_step": {"gradient_clip_val": inf}},
            "model.optimizer_step.gradient_clip_val=inf is not finite",
        ),
        ({"loss": {"kl_coef": -0.1}}, r"^model\.loss\.kl_coef must be >= 0"),
        (
            {"optimizer_step": {"warmup_steps": -1}},
            r"model\.optimizer_step\.warmup_steps must be an integer >= 0 \(optimizer updates",
        ),
        ({"parity_check_every": -1}, r"model\.parity_check_every must be an integer >= 0"),
        (
            {"batching": {"max_tokens_per_micro_batch": 0}},
            r"model\.batching\.max_tokens_per_micro_batch must be an integer >= 1 or null",
        ),
    ],
)
def test_module_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DAPOModule("unused", **kwargs)


def test_module_has_no_sampling_settings():
    """Temperature and response length are the data's (``data.sampling``), carried by batches."""
    for key in ("temperature", "max_response_length"):
        with pytest.raises(TypeError, match=key):
            DAPOModule("unused", **{key: 1})


def test_module_without_policy():
    with pytest.raises(ValueError, match="model_name_or_path"):
        DAPOModule()


def test_module_missing_model_path(tmp_path):
    module = DAPOModule(str(tmp_path / "no_such_model"))
    with pytest.raises(FileNotFoundError, match="model.model_name_or_path=.*save_pretrained"):
        module.configure_model()


# ------------------------------------------------------------------------- DAPODataModule args


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of train_files"),
        (
            {"prompts": PromptConfig(task="algebra")},
            ValueError,
            "task='algebra' is not a built-in task",
        ),
        (
            {"prompts": PromptConfig(task="arithmetic"), "engine": "sglang"},
            ValueError,
            "engine='sglang'",
        ),
        (
            {"prompts": PromptConfig(task="arithmetic"), "steps_per_epoch": 0},
            ValueError,
            "steps_per_epoch must be",
        ),
    ],
)
def test_datamodule_bad_arguments(tiny_checkpoint, kwargs, error, match):
    with pytest.raises(error, match=match):
        DAPODataModule(str(tiny_checkpoint), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "data.sampling.max_tokens must be an integer >= 1"),
        ({"max_tokens": 4, "top_p": 0.0}, "data.sampling.top_p must be in"),
        ({"max_tokens": 4, "temperature": 0.0}, "data.sampling.temperature must be > 0"),
        ({"max_tokens": 4, "temperature": nan}, "data.sampling.temperature=nan is not finite"),
        ({"max_tokens": 4, "temperature": inf}, "data.sampling.temperature=inf is not finite"),
        ({"max_tokens": 4, "top_p": nan}, "top_p must be in"),
        ({"max_tokens": 4, "top_k": 0}, "top_k must be -1"),
    ],
)
def test_sampling_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 1}, "n >= 2 or filter_metric: null"),
        ({"train_batch_size": 0}, "data.dynamic_sampling.train_batch_size must be an integer >= 1"),
        (
            {"gen_batch_size": 0},
            "data.dynamic_sampling.gen_batch_size must be an integer >= 1 .prompts per round, or null",
        ),
        (
            {"max_num_gen_batches": -1},
            "data.dynamic_sampling.max_num_gen_batches must be an integer >= 0",
        ),
        ({"on_exhausted": "retry"}, "on_exhausted must be"),
        ({"filter_metric": "len"}, "filter_metric must be"),
        ({"max_staleness": -1}, "data.dynamic_sampling.max_staleness must be an integer >= 0"),
        ({"round_sizing": "auto"}, "round_sizing must be 'fixed' or 'kept_frac'"),
        (
            {"max_gen_batch_size": 0},
            "data.dynamic_sampling.max_gen_batch_size must be an integer >= 1",
        ),
        ({"selection": "uniform"}, r"write selection: \{strategy: uniform\}"),
        ({"selection": {"retire_after": -1}}, "selection.retire_after must be an integer >= 0"),
    ],
)
def test_dynamic_sampling_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicSamplingConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"retire_after": -1}, "selection.retire_after must be an integer >= 0"),
        ({"retire_after": 1.5}, "selection.retire_after must be an integer >= 0"),
        ({"park_after": -1}, "selection.park_after must be an integer >= 0"),
        ({"revisit_every": 0}, "selection.revisit_every must be an integer >= 1"),
        ({"strategy": "greedy"}, "selection.strategy must be 'uniform' or 'predictive'"),
        ({"max_skip": 1.0}, r"selection.max_skip must be in \[0, 1\)"),
        ({"max_skip": -0.1}, r"selection.max_skip must be in \[0, 1\)"),
        ({"max_skip": nan}, "selection.max_skip=nan is not finite"),
        ({"max_skip": inf}, "selection.max_skip=inf is not finite"),
        ({"max_skip": "0.5"}, "selection.max_skip must be a number"),
        ({"revisit_within": 0}, "selection.revisit_within must be an integer >= 1"),
        ({"skip_threshold": 1.0}, r"selection.skip_threshold must be in \[0, 1\)"),
        ({"skip_threshold": nan}, "selection.skip_threshold=nan is not finite"),
        ({"revisit_after": 0}, "selection.revisit_after must be an integer >= 1"),
        ({"revisit_after": 2.0}, "selection.revisit_after must be an integer >= 1"),
        ({"history_decay": 0.0}, r"selection.history_decay must be in \(0, 1\]"),
        ({"history_decay": 1.5}, r"selection.history_decay must be in \(0, 1\]"),
        ({"history_decay": nan}, "selection.history_decay=nan is not finite"),
        ({"history_decay": inf}, "selection.history_decay=inf is not finite"),
    ],
)
def test_prompt_selection_bad_settings(kwargs, match):
    """Each field is checked once, in PromptSelectionConfig, named by its YAML path."""
    with pytest.raises(ConfigError, match="data.dynamic_sampling." + match):
        PromptSelectionConfig(**kwargs)


#: PromptConfig fields a test may pass to _dm() as keywords.
PROMPT_FIELDS = {f.name for f in dataclasses.fields(PromptConfig)}


def _dm(path: Any, dynamic: dict[str, Any] | None = None, **kw: Any) -> DAPODataModule:
    args: dict[str, Any] = dict(
        prompts=PromptConfig(
            task="arithmetic",
            task_kwargs={"num_prompts": 8},
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        reward="arithmetic",
        scoring=ScoringConfig(in_process=True),
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(
            **{"n": 2, "train_batch_size": 2, **(dynamic or {})}
        ),
    )
    prompt_kw = {k: kw.pop(k) for k in list(kw) if k in PROMPT_FIELDS}
    if prompt_kw:
        args["prompts"] = dataclasses.replace(args["prompts"], **prompt_kw)
    args.update(kw)
    return DAPODataModule(str(path), **args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dynamic": {"train_batch_size": 16}}, "more than the 8 training prompts"),
        ({"reward": "exact_match"}, "reward='exact_match' is not a built-in reward"),
        ({"max_prompt_length": 2}, "max_prompt_length=2"),
    ],
)
def test_datamodule_bad_settings_fail_in_setup(tiny_checkpoint, kwargs, match):
    dm = _dm(tiny_checkpoint, **kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("group", "kwargs", "match"),
    [
        (ScoringConfig, {"timeout_s": 0.0}, "scoring.timeout_s must be > 0"),
        (ScoringConfig, {"timeout_s": nan}, "scoring.timeout_s=nan is not finite"),
        (ScoringConfig, {"timeout_s": inf}, "scoring.timeout_s=inf is not finite"),
        (ScoringConfig, {"workers": 0}, "scoring.workers must be an integer >= 1"),
        (ScoringConfig, {"max_failure_frac": 2.0}, r"scoring.max_failure_frac must be in \[0, 1\]"),
        (
            ScoringConfig,
            {"max_failure_frac": nan},
            "scoring.max_failure_frac=nan is not finite",
        ),
        (ValidationConfig, {"fraction": 1.0}, r"validation.fraction must be in \[0, 1\)"),
        (ValidationConfig, {"fraction": nan}, "validation.fraction=nan is not finite"),
        (ValidationConfig, {"n": 0}, "validation.n must be an integer >= 1"),
        (ValidationConfig, {"batch_size": 0}, "validation.batch_size must be an integer >= 1"),
        (ValidationConfig, {"temperature": 0.0}, "validation.temperature must be > 0"),
        (ValidationConfig, {"temperature": inf}, "validation.temperature=inf is not finite"),
        (ValidationConfig, {"temperature": nan}, "validation.temperature=nan is not finite"),
        (PromptConfig, {"max_prompt_length": 0}, "prompts.max_prompt_length must be >= 1"),
        (
            PromptConfig,
            {"overlong_prompts": "truncate"},
            "prompts.overlong_prompts must be 'error'",
        ),
        (PromptConfig, {"prompt_key": ""}, "prompts.prompt_key must name a field"),
    ],
)
def test_data_setting_groups_refuse_bad_values(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group(**kwargs)


def test_missing_tokenizer_path(tmp_path):
    dm = _dm(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="data.model_name_or_path=.*Fix"):
        dm.setup("fit")


def test_chat_template_needed_but_missing(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    dm = _dm(path, apply_chat_template=True)
    with pytest.raises(
        PromptDataError, match="no chat template. Fix: set prompts.apply_chat_template: false"
    ):
        dm.setup("fit")


def test_vllm_engine_not_installed(tiny_checkpoint, monkeypatch):
    # vLLM *is* installed here, so its absence is faked: a None entry in sys.modules makes both
    # importlib.util.find_spec and `import vllm` behave as if the package were missing.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="engine='vllm' but vllm is not installed.*pip install"):
        _dm(tiny_checkpoint, engine="vllm")


# ----------------------------------------------- checks across model and data, before generating


class _CountingEngine(RolloutEngine):
    """A rollout engine that records whether it was ever asked to generate."""

    calls = 0

    def generate(self, prompts, n, sampling):  # pragma: no cover - must never run
        _CountingEngine.calls += 1
        raise AssertionError("generation started before the configuration was checked")

    def load_weights(self, named_tensors):
        return None


def _fit(module: DAPOModule, dm: DAPODataModule, tmp_path: Path) -> None:
    fit(module, dm, max_steps=1, max_epochs=None, num_sanity_val_steps=0, default_root_dir=tmp_path)


@pytest.mark.parametrize(
    ("module_kw", "data_kw", "match"),
    [
        (
            {"loss": {"advantage_estimator": "grpo"}},
            {"dynamic": {"n": 1, "filter_metric": None}},
            "n=1 with",
        ),
        (
            {"loss": {"advantage_estimator": "rloo"}},
            {"dynamic": {"n": 1, "filter_metric": None}},
            "n=1 with",
        ),
        (
            {"batching": {"mini_batch_size": 3}},
            {"dynamic": {"train_batch_size": 4}},
            "mini_batch_size=3 does not",
        ),
        (
            {},
            {"max_prompt_length": 500, "sampling": SamplingConfig(max_tokens=100)},
            "max_position_embeddings",
        ),
    ],
)
def test_model_data_mismatch_fails_before_generation(
    tiny_checkpoint, tmp_path, module_kw, data_kw, match
):
    _CountingEngine.calls = 0
    module = DAPOModule(str(tiny_checkpoint), parity_check_every=0, **module_kw)
    dm = _dm(tiny_checkpoint, engine=_CountingEngine(), **data_kw)
    with pytest.raises(ValueError, match=match + ".*[Ff]ix"):
        _fit(module, dm, tmp_path)
    assert _CountingEngine.calls == 0


# ----------------------------------------------------------------------------------- prompt data


def _rows_file(tmp_path: Path, rows: list[Any] | str) -> Path:
    path = tmp_path / "prompts.jsonl"
    if isinstance(rows, str):
        path.write_text(rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "no prompts found"),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "line 2 is not valid JSON"),
        ([{"question": "1+1=", "answer": "2"}], "missing field 'prompt'.*set prompts.prompt_key"),
        ([{"prompt": "1+1="}], "missing field 'answer'.*set prompts.answer_key"),
        ([{"prompt": "   ", "answer": "2"}], "empty prompt"),
        ([{"prompt": "1+1=", "answer": None}], "field 'answer' is null"),
        ([{"prompt": "1+1=", "answer": ["2"]}], "must be a string or a number, got list"),
        ([{"prompt": "1+1=", "answer": True}], "is a bool"),
        ([{"prompt": [{"role": "user"}], "answer": "2"}], "message 0 must be a dict"),
        ([["1+1=", "2"]], "is a list, not a dict"),
    ],
)
def test_bad_prompt_rows(tiny_checkpoint, tmp_path, content, match):
    path = _rows_file(tmp_path, content)
    dm = DAPODataModule(
        str(tiny_checkpoint),
        prompts=PromptConfig(
            train_files=str(path),
            answer_key="answer",
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        reward="arithmetic",
        scoring=ScoringConfig(in_process=True),
        sampling=SamplingConfig(max_tokens=4),
        dynamic_sampling=DynamicSamplingConfig(n=2, train_batch_size=1),
    )
    with pytest.raises(PromptDataError, match=match):
        dm.setup("fit")


def test_missing_prompt_file(tiny_checkpoint, tmp_path):
    dm = DAPODataModule(
        str(tiny_checkpoint), prompts=PromptConfig(train_files=str(tmp_path / "nope.jsonl"))
    )
    with pytest.raises(FileNotFoundError, match="check the path in train_files"):
        dm.setup("fit")


def test_unknown_prompt_file_type(tiny_checkpoint, tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("prompt,answer\n1+1=,2\n")
    dm = DAPODataModule(str(tiny_checkpoint), prompts=PromptConfig(train_files=str(path)))
    with pytest.raises(PromptDataError, match="unknown prompt file type '.csv'"):
        dm.setup("fit")


# --------------------------------------------------------------------------------------- rewards


class RaisingReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        raise RuntimeError("reward bug")


class HangingReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        time.sleep(3600)


class NaNReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(score=float("nan"), acc=False) for _ in responses]


class ShortReward:
    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(score=1.0, acc=True)] * (len(responses) - 1)


def test_reward_that_raises():
    runner = RewardRunner(RaisingReward(), in_process=True)
    with pytest.raises(RewardFailureError, match="RuntimeError: reward bug.*Fix the reward"):
        runner.score(["a", "b"], ["1", "2"])


def test_reward_that_hangs_is_killed_by_the_timeout():
    runner = RewardRunner(HangingReward(), timeout_s=0.5, num_workers=1)
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardFailureError, match="timeout.*raise data.scoring.timeout_s"):
            runner.score(["a"], ["1"])
    finally:
        runner.close()
    assert time.monotonic() - t0 < 60


class LockedReward:
    """A reward holding a lock: it cannot be pickled into a worker process."""

    failure_score = -1.0

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(score=1.0, acc=True) for _ in responses]


def test_reward_that_cannot_be_pickled_names_the_fix():
    with pytest.raises(ValueError, match=r"reward LockedReward cannot be sent to a reward worker "
                       r"process .*_thread.lock.*data.scoring.in_process: true"):  # fmt: skip
        RewardRunner(LockedReward(), num_workers=1)
    RewardRunner(LockedReward(), in_process=True).close()  # the fix works


class HangsUnlessOk:
    """Scores "ok" at once; hangs for an hour on anything else."""

    failure_score = -1.0

    def __call__(self, responses, ground_truths, **kw):
        if any(r != "ok" for r in responses):
            time.sleep(3600)
        return [RewardResult(score=1.0, acc=True) for _ in responses]


def test_reward_that_hangs_on_every_sample_fails_the_round_within_its_budget():
    """20 samples, 2 workers, 1 s each: the round's wall budget is 1 s x ceil(20 / 2) + slack
    (+ twice a worker's start, for the respawns); every sample fails, the round raises."""
    from dapo_lightning.rewards.base import ROUND_SLACK_S

    # fork: a worker starts in milliseconds (spawn imports torch again: 5-100 s on busy cores)
    runner = RewardRunner(HangsUnlessOk(), timeout_s=1.0, num_workers=2, mp_context="fork")
    try:
        assert runner.score(["ok", "ok"], ["1", "1"])[0].acc  # both workers started
        start = runner.worker_start_s
        t0 = time.monotonic()
        with pytest.raises(RewardFailureError, match="20 of 20 responses"):
            runner.score(["x"] * 20, ["1"] * 20)
        scored = time.monotonic() - t0
    finally:
        runner.close()
    assert runner.last_round_budget_s == pytest.approx(1.0 * 10 + ROUND_SLACK_S + 2 * start)
    assert scored < runner.last_round_budget_s + 3.0, (scored, start)


def test_stop_request_while_a_reward_hangs_kills_the_workers_at_once():
    """A SIGTERM's stop request reaches the wait for a hanging worker within STOP_POLL_S: the
    workers are killed and StopRequested raised (the hang used to hold SIGTERM for minutes)."""
    import threading

    from dapo_lightning.interrupt import StopRequested, clear_stop_request, request_stop

    runner = RewardRunner(HangsUnlessOk(), timeout_s=300.0, num_workers=1, mp_context="fork")
    try:
        assert runner.score(["ok"], ["1"])[0].acc
        worker = runner._workers[0].proc
        timer = threading.Timer(1.0, request_stop, args=("SIGTERM",))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(StopRequested, match="SIGTERM"):
            runner.score(["x", "y"], ["1", "1"])
        assert time.monotonic() - t0 < 1.0 + 5.0
        worker.join(5)
        assert not worker.is_alive() and runner._workers == []
    finally:
        clear_stop_request()
        runner.close()


def test_reward_that_returns_nan():
    with pytest.raises(RewardOutputError, match="score=nan .* must be finite"):
        RewardRunner(NaNReward(), in_process=True).score(["a"], ["1"])


def test_reward_that_returns_the_wrong_length():
    with pytest.raises(RewardOutputError, match="returned 1 results for 2 responses"):
        RewardRunner(ShortReward(), in_process=True).score(["a", "b"], ["1", "2"])


def test_reward_that_is_not_callable():
    with pytest.raises(TypeError, match="reward must be a name in"):
        get_reward(42)


# ------------------------------------------------------------------------------------- dtypes


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="top_k must be -1"):
        SamplingConfig(4, top_k=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_run_on_this_cpu(tiny_checkpoint, dtype):
    """Measured, not guarded: float16 and bfloat16 forward and backward both run on this CPU
    (torch 2.13), so there is no dtype/device combination to reject here."""
    module = DAPOModule(str(tiny_checkpoint), torch_dtype=dtype)
    module.configure_model()
    out = module.policy(torch.tensor([[1, 2, 3]])).logits
    out.float().sum().backward()
    assert out.dtype == getattr(torch, dtype) and torch.isfinite(out).all()


# ---------------------------------------- prompt files: encodings, missing values, paths (UX)


def _files_dm(path: Any, train_files: str, **kw: Any) -> DAPODataModule:
    from dapo_lightning.data.sampling.producer import DynamicSamplingConfig

    args: dict[str, Any] = dict(
        prompts=PromptConfig(
            train_files=train_files,
            prompt_key="prompt",
            answer_key="answer",
            apply_chat_template=False,
            max_prompt_length=16,
        ),
        reward="arithmetic",
        scoring=ScoringConfig(in_process=True),
        dynamic_sampling=DynamicSamplingConfig(n=2, train_batch_size=2, gen_batch_size=2),
    )
    return DAPODataModule(str(path), **{**args, **kw})


def test_prompt_file_not_utf8(tiny_checkpoint, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\u00e9", "answer": "3"}\n'
                     .encode("latin-1"))  # fmt: skip
    dm = _files_dm(tiny_checkpoint, str(path))
    with pytest.raises(PromptDataError, match=rf"{path} is not UTF-8 text: byte 46 \(line 2\).*"
                       "Save the file as UTF-8"):  # fmt: skip
        dm.setup("fit")


def test_prompt_file_with_utf8_bom_is_accepted(tiny_checkpoint, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
    path.write_bytes(b"\xef\xbb\xbf" + rows.encode())
    dm = _files_dm(tiny_checkpoint, str(path))
    dm.setup("fit")
    assert sorted(r.answer for r in dm.train_records) == ["2", "4"]


@pytest.mark.parametrize(
    ("answer", "match"),
    [("NaN", r"row 2: field 'answer' is nan .*fill in the answer or drop the row"),
     ("null", r"row 2: field 'answer' is null"),
     ('"  "', r"row 2: field 'answer' is an empty answer")],
)  # fmt: skip
def test_prompt_answer_missing(tiny_checkpoint, tmp_path, answer, match):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        f'{{"prompt": "1+1=", "answer": 2}}\n{{"prompt": "2+2=", "answer": {answer}}}\n'
    )
    with pytest.raises(PromptDataError, match=match):
        _files_dm(tiny_checkpoint, str(path)).setup("fit")


def test_missing_relative_path_is_not_a_hub_lookup(tiny_checkpoint, tmp_path, monkeypatch):
    import datasets

    def no_hub(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - must never run
        raise AssertionError("a path was looked up on the Hugging Face Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.chdir(tmp_path)
    dm = _files_dm(tiny_checkpoint, "data/train.jsonl")
    with pytest.raises(FileNotFoundError, match=r"no such file: prompt file 'data/train\.jsonl'"):
        dm.setup("fit")


# --------------------------------------------------------- reward specs and results (UX)


def test_reward_class_path_that_does_not_import(tiny_checkpoint):
    cli = build_cli(
        ["--model=dapo_lightning.DAPOModule", f"--model.model_name_or_path={tiny_checkpoint}",
         "--data=dapo_lightning.DAPODataModule", "--data.prompts.task=arithmetic",
         "--data.prompts.apply_chat_template=false", "--data.scoring.in_process=true",
         '--data.reward={"class_path": "my_rewards.ExactMatch"}', "--trainer.logger=false"],
        run=False,
    )  # fmt: skip
    with pytest.raises(ImportError, match=r"reward class_path 'my_rewards\.ExactMatch' does not "
                       r"import \(ModuleNotFoundError: No module named 'my_rewards'\)"):  # fmt: skip
        cli.datamodule.setup("fit")


class BadScoreReward:
    failure_score = -1.0

    def __init__(self, score: Any) -> None:
        self.score = score

    def __call__(self, responses, ground_truths, **kw):
        return [RewardResult(score=self.score, acc=False) for _ in responses]


@pytest.mark.parametrize("score", ["bad", None])
def test_reward_result_score_not_a_number(score):
    runner = RewardRunner(BadScoreReward(score), in_process=True)
    with pytest.raises(RewardOutputError, match=rf"reward BadScoreReward returned RewardResult\("
                       rf"score={score!r}\) at position 0: the field score must be a number"):  # fmt: skip
        runner.score(["a"], ["1"])


# ----------------------------------------------------------------------------- run set-up
# (the CLI's model creation, the run directory, checkpoints; tests/test_run_guard.py and
# tests/test_checkpoint.py run the same cases end to end)


def test_cli_init_error_is_the_class_own_message(capsys):
    """A class's ``__init__`` error arrives as its own message, naming the class, without
    jsonargparse's union dump."""
    from dapo_lightning.cli import ConfigError

    with pytest.raises(ConfigError) as info:
        build_cli(
            [*BASE, "--model.loss.clip_ratio_low=0.3", "--model.loss.clip_ratio_high=0.2"],
            run=False,
        )
    message = str(info.value)
    assert message.startswith(
        "PolicyLossConfig: model.loss.clip_ratio_high (0.2) < model.loss.clip_ratio_low (0.3)"
    ), message
    assert "Union" not in message and "Given value" not in message


def test_cli_create_model_at_a_hub_id(tmp_path, monkeypatch):
    from dapo_lightning.cli import ConfigError

    monkeypatch.chdir(tmp_path)
    args = [*BASE[:1], "--model.model_name_or_path=Qwen/Qwen2.5-0.5B", *BASE[2:]]
    with pytest.raises(ConfigError, match=r"'Qwen/Qwen2\.5-0\.5B' looks like a Hugging Face hub "
                       r"id.*write './Qwen/Qwen2\.5-0\.5B'"):  # fmt: skip
        build_cli([*args, "--create_model_if_missing=tiny"], run=False)
    assert list(tmp_path.iterdir()) == []


def test_run_directory_held_by_another_fit(tmp_path):
    import subprocess

    from dapo_lightning.run_lock import RunDirLockedError, RunLock

    code = (
        "import time; from dapo_lightning.run_lock import RunLock; "
        f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLockedError, match=rf"in use by another fit: PID {holder.pid}.*"
                           r"give this run its own --trainer\.default_root_dir"):  # fmt: skip
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_checkpoint_on_a_full_disk(tmp_path):
    """A real ENOSPC (the temporary file links to /dev/full): the directory and its free space
    are named, and what to do."""
    from dapo_lightning.checkpoint import CheckpointDiskFullError, atomic_torch_save

    (tmp_path / ".last.ckpt.tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointDiskFullError, match=rf"{tmp_path} has .* free\. Free space "
                       r"there, or point the checkpoint directory"):  # fmt: skip
        atomic_torch_save({"w": torch.zeros(1000)}, tmp_path / "last.ckpt")


def test_cli_subcommand_that_does_not_exist(capsys):
    with pytest.raises(SystemExit) as exc:
        build_cli(["test", *BASE])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "test" in err and "fit" in err and "validate" in err


# ------------------------------------------------- the CLI's error contract (issue 29)
# Every configuration error found before training starts, wherever it is found (a constructor,
# the data's settings against the model's, the optimizer, the prompt files), is one
# ``dapo-lightning: error:`` line naming the field, exit status 2, no traceback.


def fit_config(tmp_path: Path, model_path: Path) -> Path:
    """A one-update fit of the tiny model on the arithmetic task (reward in process)."""
    return write_run_config(
        tmp_path / "fit.yaml", tmp_path / "run", model_path, base=ARITHMETIC_RUN
    )


def fit_main(args: list[str], capfd: pytest.CaptureFixture) -> tuple[int, str]:
    """``dapo-lightning fit ARGS`` through the console script's entry point, in this process:
    (exit status, stderr)."""
    from dapo_lightning.cli import main

    try:
        main(["fit", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capfd.readouterr().err


def assert_one_error_line(code: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("dapo-lightning: error: "), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--model.optimizer_step.gradient_clip_val=.nan"],
            ["OptimizerStepConfig: model.optimizer_step.gradient_clip_val=nan is not finite"],
        ),
        (
            ["--model.batching.micro_batch_size=0"],
            ["model.batching.micro_batch_size must be an integer >= 1"],
        ),
        (
            [
                '--trainer.callbacks=[{"class_path": "dapo_lightning.callbacks.CollapseDetector",'
                ' "init_args": {"max_rollbacks": -1}}]'
            ],
            ["error: CollapseDetector.max_rollbacks must be an integer >= 0"],
        ),  # fmt: skip
        (
            ["--model.optimizer_step.gradient_clip_val=.inf"],
            ["optimizer_step.gradient_clip_val=inf is not finite"],
        ),
        (
            ["--model.init_args.loss.clip_ratio_high=.nan"],
            ["error: PolicyLossConfig: model.loss.clip_ratio_high=nan is not finite"],
        ),
        (["--model.loss.clip_ratio_low=.nan"], ["model.loss.clip_ratio_low=nan is not finite"]),
        (
            ["--model.loss.clip_ratio_low=0.3", "--model.loss.clip_ratio_high=0.2"],
            ["model.loss.clip_ratio_high (0.2) < model.loss.clip_ratio_low (0.3)"],
        ),
        (
            ["--model.loss.objective=ppo"],
            ["error: DAPOModule: model.loss.objective='ppo' is not a registered policy objective"],
        ),
        (
            ["--model.loss.rollout_correction.stale_tis_cap=.nan"],
            ["model.loss.rollout_correction.stale_tis_cap=nan is not finite"],
        ),
        (["--data.sampling.temperature=.nan"], ["data.sampling.temperature=nan is not finite"]),
        (["--data.sampling.temperature=.inf"], ["data.sampling.temperature=inf is not finite"]),
        (["--data.sampling.top_p=.nan"], ["data.sampling.top_p must be in (0, 1], got nan"]),
        (["--data.validation.temperature=.nan"], ["validation.temperature=nan is not finite"]),
        (["--data.scoring.timeout_s=.nan"], ["data.scoring.timeout_s=nan is not finite"]),
        (["--data.validation.fraction=.nan"], ["data.validation.fraction=nan is not finite"]),
        (
            ["--model.optimizer=torch.optim.AdamW", "--model.optimizer.lr=.nan"],
            ["model.optimizer.init_args.lr: Invalid learning rate: nan"],
        ),
        (
            ["--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=.nan"],
            ["model.optimizer.init_args.lr=nan is not finite"],
        ),
        (
            ["--model.optimizer=torch.optim.AdamW", "--model.optimizer.weight_decay=.nan"],
            ["model.optimizer.init_args.weight_decay"],
        ),
        (
            ["--model.optimizer=torch.optim.AdamW", "--model.optimizer.eps=.nan"],
            ["model.optimizer.init_args.eps"],
        ),
        (["--data.dynamic_sampling.n=1"], ["data.dynamic_sampling.n=1", "Fix: n >= 2"]),
        (
            ["--data.dynamic_sampling.selection.max_skip=.nan"],
            ["data.dynamic_sampling.selection.max_skip=nan is not finite"],
        ),
        (
            ["--data.dynamic_sampling.train_batch_size=4", "--model.batching.mini_batch_size=3"],
            [
                "model.batching.mini_batch_size=3 does not divide",
                "Fix:",
                """--model.init_args.batching '{"mini_batch_size": null}'""",
            ],
        ),
        (
            ["--data.prompts.max_prompt_length=500", "--data.sampling.max_tokens=100"],
            ["exceeds the model's context", "Fix:"],
        ),
        (
            ["--data.prompts.max_prompt_length=2"],
            ["more than max_prompt_length=2", "raise prompts.max_prompt"],
        ),
        (
            [
                '--data.reward={"class_path": "_hanging_reward.LockedReward"}',
                "--data.scoring.in_process=false",
            ],
            ["reward LockedReward cannot be sent", "_thread.lock", "data.scoring.in_process: true"],
        ),
        (
            ['--trainer.callbacks=[{"class_path": "dapo_lightning.callbacks.DAPOProgressBar"}]'],
            [
                "trainer: Trainer was configured with `enable_progress_bar=False` but found",
                "DAPOProgressBar",
                "Fix: set trainer.enable_progress_bar: true",
            ],
        ),
        (
            # one JSON value: jsonargparse reads a dotted `=null` inside a nested dataclass as "None"
            ['--data.prompts={"train_files": ".", "task": null}'],
            ["train_files / validation.files:", "is a folder but not one written by datasets"],
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("--") else "",
)
def test_cli_config_error_is_one_line_exit_2(tiny_checkpoint, tmp_path, capfd, args, fragments):
    config = fit_config(tmp_path, tiny_checkpoint)
    code, err = fit_main([f"--config={config}", *args], capfd)
    assert_one_error_line(code, err, *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_interrupted_model_write_leaves_no_temp_folder(tiny_checkpoint, tmp_path, capfd):
    """A killed first-use model write leaves ``.model.tmp-PID-*``: the next fit removes it
    (its process is gone) and writes the model; a live process's folder is left alone."""
    import subprocess

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run / f".model.tmp-{dead.pid}-0123abcd"
    (stale / "sub").mkdir(parents=True)
    live = run / f".model.tmp-{dead.pid + 10**7}-live"  # no such pid either: removed too
    live.mkdir()
    mine_alive = run / f".model.tmp-{os.getppid()}-alive"  # a live process (pytest's parent)
    mine_alive.mkdir()
    config = fit_config(tmp_path, run / "model")
    code, err = fit_main(
        [f"--config={config}", "--create_model_if_missing=tiny", "--trainer.max_steps=0"], capfd
    )
    assert code == 0, err[-3000:]
    assert f"removed {stale}" in err
    assert not stale.exists() and not live.exists() and mine_alive.is_dir()
    assert (run / "model" / "config.json").exists()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Detector(signal="entropy", threshold=nan), "Detector.threshold=nan is not finite"),
        (
            lambda: Detector(signal="entropy", threshold=0.1, min_value=nan),
            "Detector.min_value=nan is not finite",
        ),
        (
            lambda: Detector(signal="repetition", threshold=0.5, max_repeat=inf),
            "Detector.max_repeat=inf is not finite",
        ),
        (
            lambda: Detector(signal="entropy", threshold=0.1, ema_decay=nan),
            "Detector.ema_decay=nan is not finite",
        ),
        (lambda: CollapseDetector(rollback_lr_scale=nan), "rollback_lr_scale must"),
        (lambda: EntropyScheduler(start=nan), "EntropyScheduler.start=nan is not finite"),
        (
            lambda: EntropyScheduler(schedule="adaptive", start=1e-3, target_high=nan),
            "EntropyScheduler.target_high=nan is not finite",
        ),
        (
            lambda: EntropyScheduler(schedule="adaptive", start=1e-3, coef_max=inf),
            "EntropyScheduler.coef_max=inf is not finite",
        ),
        (
            lambda: OverlongRewardShaping(buffer_length=2, penalty_factor=nan),
            "OverlongRewardShaping.penalty_factor=nan is not finite",
        ),
    ],
)
def test_callback_float_settings_must_be_finite(make, match):
    """Every float a callback takes is checked finite (NaN fails ``x < 0``-style checks)."""
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.slow  # two in-process fits (~20 s idle): pytest -m slow -k nonfinite_steps_through
def test_nonfinite_steps_through_the_cli_keep_the_last_good_checkpoint(
    tiny_checkpoint, tmp_path, capfd
):
    """Update 2 is saved; the resumed run's AdamW eps=0 makes every step's weights NaN (a 0/0
    where a gradient is exactly 0): each is undone, the fifth in a row stops the run with one
    error line, and last.ckpt is still update 2 with finite weights, named as the last good."""
    config = fit_config(tmp_path, tiny_checkpoint)
    keep = ["--trainer.enable_checkpointing=true", "--model.optimizer=torch.optim.AdamW"]
    code, err = fit_main([f"--config={config}", *keep, "--trainer.max_steps=2"], capfd)
    assert code == 0, err[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    resumed = [f"--config={config}", *keep, "--model.optimizer.eps=0", "--ckpt_path=auto"]
    code, err = fit_main([*resumed, "--trainer.max_steps=12"], capfd)
    assert code == 1, err[-3000:]
    assert "error: 5 updates in a row were not finite" in err, err[-3000:]
    assert f"the last good checkpoint is {last}" in err, err[-3000:]
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 2
    assert all(
        torch.isfinite(v).all() for v in saved["state_dict"].values() if v.is_floating_point()
    )


@pytest.mark.parametrize(
    ("reward", "fragments"),
    [
        (
            "_bad_rewards.NaNScore",
            ["error: data.reward: reward NaNScore returned score=nan at position 0", "finite"],
        ),
        (
            "_bad_rewards.StringScore",
            [
                "error: data.reward: reward StringScore returned RewardResult(score='high')",
                "the field score must be a number (a str is not)",
            ],
        ),
    ],
)
def test_cli_reward_returning_nan_or_a_string_is_one_line_exit_2(
    tiny_checkpoint, tmp_path, capfd, reward, fragments
):
    """Issue 38 item 7: a reward returning a NaN or a string score ended the fit with a
    traceback and exit 1; it is a bug of the reward: one ``error:`` line naming data.reward,
    the reward and the fix, exit 2."""
    config = fit_config(tmp_path, tiny_checkpoint)
    code, err = fit_main(
        [f"--config={config}", f'--data.reward={{"class_path": "{reward}"}}'], capfd
    )
    assert_one_error_line(code, err, *fragments)


# ------------------------------------------- issue 38: inputs that gave tracebacks (CLI parts)
def _truncated_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "cut.ckpt"
    torch.save({"global_step": 3, "w": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:900])
    return path


def _checkpoint_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 3}, folder / "last.ckpt")
    return folder


@pytest.mark.parametrize(
    ("make_args", "fragments"),
    [
        (
            lambda tmp: ["--ckpt_path", str(tmp / "missing.ckpt")],
            ["error: ckpt_path: ", "missing.ckpt does not exist. Fix: ", "--ckpt_path auto"],
        ),
        (
            lambda tmp: ["--ckpt_path", str(_checkpoint_folder(tmp))],
            ["checkpoints is a folder, not a checkpoint (it holds last.ckpt). Fix: "],
        ),
        (
            lambda tmp: ["--ckpt_path", str(_truncated_checkpoint(tmp))],
            ["cut.ckpt cannot be loaded (", "Fix: give a complete checkpoint"],
        ),
        (
            lambda tmp: ["--model.model_name_or_path", str(tmp / "modle")],
            ["error: model.model_name_or_path: ", "modle does not exist. Fix: give the folder"],
        ),
        (
            # no network here: the hub cannot be reached; with one: it has no such model
            lambda tmp: ["--model.model_name_or_path", "no-such-org-dapo/no-such-model-dapo"],
            [
                "error: model.model_name_or_path: 'no-such-org-dapo/no-such-model-dapo' is no "
                "local folder and ",
                "Fix: correct the path, or download the model",
            ],
        ),
    ],
    ids=["ckpt-missing", "ckpt-folder", "ckpt-truncated", "model-path-typo", "hub-id"],
)
def test_cli_bad_path_is_one_line_exit_2(tiny_checkpoint, tmp_path, capfd, make_args, fragments):
    """Issue 38 item 7: each of these exited 1 with one to three chained tracebacks."""
    config = fit_config(tmp_path, tiny_checkpoint)
    code, err = fit_main([f"--config={config}", *make_args(tmp_path)], capfd)
    assert_one_error_line(code, err, *fragments)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--model.gradient_clip_val=nan", "error: model.gradient_clip_val=nan is not finite."),
        ("--model.loss.clip_ratio_low=NaN", "error: model.loss.clip_ratio_low=NaN is not finite."),
        ("--data.sampling.temperature=inf", "error: data.sampling.temperature=inf is not finite."),
        (
            "--data.dynamic_sampling.selection.max_skip=-inf",
            "error: data.dynamic_sampling.selection.max_skip=-inf is not finite.",
        ),
        ("--trainer.gradient_clip_val=nan", "error: trainer.gradient_clip_val=nan is not finite."),
    ],
)
def test_cli_plain_nan_is_one_line(tiny_checkpoint, tmp_path, capfd, option, message):
    """Issue 38 item 7: a plain ``nan`` (YAML's string, where ``.nan`` is its float) gave a
    12-17-line union dump; now the parser's one error line names the field."""
    config = fit_config(tmp_path, tiny_checkpoint)
    code, err = fit_main([f"--config={config}", option, "--print_config"], capfd)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and lines == [f"{message} Give a finite number."], err[-3000:]
    assert len(err.strip().splitlines()) == 3, err  # usage, tip, error


def test_cli_batch_that_does_not_split_over_the_ranks_fails_before_they_start(
    tiny_checkpoint, tmp_path
):
    """Issue 38 item 7: ``--trainer.devices 3`` with a batch of 2 prompts raised in each of the
    three ranks (three tracebacks, exit 1). Checked before any rank starts: one line, exit 2.
    (The console script in a subprocess: the ranks are real processes.)"""
    import subprocess

    config = fit_config(tmp_path, tiny_checkpoint)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cli = str(Path(sys.executable).parent / "dapo-lightning")
    proc = subprocess.run(
        [cli, "fit", f"--config={config}", "--trainer.devices=3"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_one_error_line(
        proc.returncode,
        proc.stderr,
        "error: data.dynamic_sampling.train_batch_size=2 is global (over all ranks) and must be "
        "a positive multiple of world_size=3: use e.g. 3.",
        "trainer.devices x trainer.num_nodes, now 3",
    )
    assert "[rank" not in proc.stderr  # no rank was started
