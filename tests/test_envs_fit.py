"""Multi-turn fits through the ``dapo-lightning fit`` console script on the tiny quickstart
model: the real engine (HF, vLLM) and the real calculator environment, 2 updates.

The tiny model never writes a tool call, so the calculator is built with a ``nudge``: a first
turn without a call gets a user turn back, and every episode has an observation between two
sampled turns. The recorder callback (tests/_episode_envs.py) checks what reached the update:
observation tokens are in the sequences but not in the loss mask or the token count N.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from tests._harness import QUICKSTART, REPO, fit_cli, run_cli, write_run_config
from tests.test_cli import read_csv, series


def write_override(path: Path, run_dir: Path, model_dir: Path, environment: str) -> Path:
    """The harness's base run config with the episode recorder, 6-token turns, 2 validation
    samples and ``environment`` (YAML text)."""
    callbacks = [
        {
            "class_path": "dapo_lightning.callbacks.OverlongRewardShaping",
            "init_args": {"buffer_length": 2},
        },
        {"class_path": "_episode_envs.EpisodeRecorder"},
    ]
    data = {
        "sampling": {"max_tokens": 6},
        "validation": {"n": 2},
        "environment": yaml.safe_load(environment),
    }
    return write_run_config(
        path, run_dir, model_dir, trainer={"callbacks": callbacks}, data={"init_args": data}
    )


CALCULATOR = (
    "{name: calculator, kwargs: {nudge: Again.}, max_turns: 2, max_episode_tokens: 128, "
    "add_instructions: false}"
)


#: The HF engine's stop ids in the random-model fits: the EOS and a third of the byte tokens,
#: so the random tiny model ends its turns after a few tokens and every episode continues.
STOP_IDS = [1, *range(100, 190)]
HF_STOPS = ["--data.init_args.engine_kwargs", f"{{eos_token_id: {STOP_IDS}}}"]


@pytest.fixture(scope="module")
def stopping_model(tiny_checkpoint, tmp_path_factory):
    """The random tiny model whose generation config lists STOP_IDS as its EOS ids: vLLM stops
    on them (its engine takes no stop ids of its own), so its turns end early too."""
    path = tmp_path_factory.mktemp("stopping") / "model"
    shutil.copytree(tiny_checkpoint, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = STOP_IDS
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def fit(
    tmp_path: Path,
    model_dir: Path,
    environment: str,
    *extra: str,
    configs: tuple[str, ...] = (QUICKSTART,),
    timeout: int = 300,
):
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "o.yaml", run_dir, model_dir, environment)
    return run_dir, fit_cli(override, *extra, configs=configs, timeout=timeout)


def check_episodes(run_dir: Path) -> list[dict[str, str]]:
    record = json.loads((run_dir / "episodes.json").read_text())
    steps, updates = record["steps"], record["updates"]
    assert len(steps) == 2 and len(updates) == 2
    for step, tokens in zip(steps, updates):
        # observations are in the sequences (every episode has one), not in the loss
        assert step["response_tokens"] > step["loss_tokens"] + step["rows"] * 10
        # N = the loss tokens = the sampled tokens (no overlong filtering here)
        assert tokens == step["loss_tokens"] == step["sampled_tokens"]
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    # issue 28: one round per step, every group kept: the producer's token count is the
    # policy's own tokens; the observations it interleaved are counted on their own
    generated = [v for _, v in series(rows, "data/generated_tokens")]
    observed = [v for _, v in series(rows, "env/observation_tokens")]
    assert generated == [step["sampled_tokens"] for step in steps]
    assert observed == [step["response_tokens"] - step["sampled_tokens"] for step in steps]
    assert all(1.5 <= v <= 2.0 for _, v in series(rows, "env/turns_mean"))
    assert all(v == 0 for _, v in series(rows, "env/tool_calls_mean"))
    assert all(v == 0 for _, v in series(rows, "env/failures"))
    assert all(v > 20 for _, v in series(rows, "env/episode_tokens_mean"))
    # the engine's log-probs of the sampled tokens are the trainer's; a 0 log-prob on an
    # observation token compared with the trainer's would be a gap of several nats
    gaps = [v for _, v in series(rows, "parity/max_abs_diff")]
    assert gaps and max(gaps) < 1e-4, gaps
    return rows


def test_calculator_fit_hf(tmp_path, tiny_checkpoint):
    """The random tiny model with the HF engine (stop ids: see STOP_IDS)."""
    run_dir, _ = fit(tmp_path, tiny_checkpoint, CALCULATOR, *HF_STOPS)
    check_episodes(run_dir)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # vLLM's start is minutes on a loaded machine
def test_calculator_fit_vllm(tmp_path, stopping_model):
    """vLLM, on the random tiny model with STOP_IDS in its generation config."""
    pytest.importorskip("vllm")
    vllm_cfg = str(REPO / "configs" / "quickstart_vllm.yaml")
    more = ["--data.init_args.engine_kwargs.max_model_len", "128"]
    configs = (QUICKSTART, vllm_cfg)
    run_dir, _ = fit(tmp_path, stopping_model, CALCULATOR, *more, configs=configs, timeout=1500)
    check_episodes(run_dir)
    saved = next(run_dir.rglob("config.yaml")).read_text()
    assert "engine: vllm" in saved and "name: calculator" in saved


@pytest.mark.slow  # the same faults are counted by the runner in tests/test_envs.py (fast)
def test_faulty_environment_is_counted_not_fatal(tmp_path, tiny_checkpoint):
    """An environment of one's own by class path that raises, hangs or returns garbage in 3
    of 4 episodes: the run trains its 2 updates; every fault is counted."""
    env = (
        "{name: _episode_envs.FaultyEnv, kwargs: {hang_s: 3.0}, max_turns: 2, "
        "call_timeout_s: 0.5, max_failure_frac: 0.9, add_instructions: false}"
    )
    run_dir, _ = fit(tmp_path, tiny_checkpoint, env, *HF_STOPS)
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    failures = [v for _, v in series(rows, "env/failures")]
    timeouts = [v for _, v in series(rows, "env/timeouts")]
    assert failures and all(v >= 1 for v in failures) and all(v >= 1 for v in timeouts)


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def test_calculator_recipe_differs_from_the_single_turn_one_only_where_it_must(capsys):
    """configs/smollm2_calculator.yaml is configs/smollm2_135m.yaml plus the environment and
    the lengths and paths it needs: a change to one recipe must be made to the other."""
    from tests.test_configs import print_config

    single = _flatten(print_config(capsys, str(REPO / "configs" / "smollm2_135m.yaml")))
    multi = _flatten(print_config(capsys, str(REPO / "configs" / "smollm2_calculator.yaml")))
    differ = {k for k in single.keys() | multi.keys() if single.get(k) != multi.get(k)}
    assert {k for k in differ if not k.startswith("data.init_args.environment.")} == {
        "trainer.default_root_dir",
        "model.init_args.model_name_or_path",
        "data.init_args.prompts.max_prompt_length",
        "data.init_args.engine_kwargs.max_model_len",
    }
    assert single["data.init_args.environment"] is None
    assert multi["data.init_args.environment.name"] == "calculator"
    budget = multi["data.init_args.environment.max_episode_tokens"]
    assert budget == multi["data.init_args.engine_kwargs.max_model_len"]
    assert (
        budget
        >= multi["data.init_args.prompts.max_prompt_length"]
        + multi["data.init_args.sampling.max_tokens"]
    )


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_and_resume_mid_run_with_episodes_is_exact(tiny_checkpoint, tmp_path, monkeypatch):
    """tests/test_resume_kill.py's worker on calculator episodes: SIGKILLed at a random moment
    of a random rollout step and during a checkpoint write, resumed from last.ckpt, it ends with
    the uninterrupted run's weights and draws the same prompts at every step.

    The random kill is timed from the step records, not from the start: a delay from the start
    (a fraction of the reference fit's time) outlasted the whole fit when the reference ran on
    busier cores, and the next start then restored the final checkpoint and never trained."""
    import random
    import time

    from tests import test_resume_kill as kill

    monkeypatch.setenv("DAPO_WORKER_EPISODES", "1")  # the worker's subprocesses inherit it
    ref = tmp_path / "reference"
    proc = kill._start(tiny_checkpoint, ref)
    assert kill._wait_training(proc, ref, timeout=600), proc.communicate()[1].decode()[-4000:]
    t0 = time.monotonic()
    while proc.poll() is None and not (ref / "final.pt").exists():
        time.sleep(0.005)
    fit_s = time.monotonic() - t0
    kill._finish(proc, timeout=900)
    run, rng, events = tmp_path / "killed", random.Random(0), []
    for mode in ("random", "write"):  # a random moment of the fit, then a checkpoint write
        proc = kill._start(tiny_checkpoint, run)
        assert kill._wait_training(proc, run, timeout=900), proc.communicate()[1].decode()[-4000:]
        if mode == "random":  # steps 2..STEPS-2: the write kill and the finish still have steps
            # up to half the reference's mean step: mostly inside the step, at its record at most
            step, delay = rng.randint(2, kill.STEPS - 2), rng.uniform(0, 0.5 * fit_s / kill.STEPS)
            how = kill._kill_during_step(proc, run, step, delay, timeout=fit_s * 4 + 60)
        else:
            how = kill._kill_during_checkpoint_write(proc, run / "checkpoints", fit_s * 4 + 60)
        events.append(f"{mode}: {how}")
    print("kill events:", events, "steps recorded before the last start:", kill._steps_done(run))
    assert not any(e.endswith("None") for e in events), events
    assert 0 < kill._steps_done(run) < kill.STEPS  # both kills landed mid-run
    proc = kill._start(tiny_checkpoint, run)
    kill._finish(proc, timeout=1800)
    kill._check_equal(run, ref)


def test_calculator_fit_hf_one_step_off(tmp_path, tiny_checkpoint):
    """Multi-turn episodes generated on the one-step-off rollout thread: the second step trains
    on episodes sampled before the first step's update, with the observations masked as in
    sync mode."""
    pipeline = ["--data.init_args.dynamic_sampling.pipeline", "one_step_off"]
    run_dir, _ = fit(tmp_path, tiny_checkpoint, CALCULATOR, *HF_STOPS, *pipeline)
    record = json.loads((run_dir / "episodes.json").read_text())
    for step, tokens in zip(record["steps"], record["updates"]):
        assert step["response_tokens"] > step["loss_tokens"] + step["rows"] * 10
        assert tokens == step["loss_tokens"] == step["sampled_tokens"]
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    assert [v for _, v in series(rows, "data/staleness_max")] == [0.0, 1.0]  # one update a step
    assert all(1.5 <= v <= 2.0 for _, v in series(rows, "env/turns_mean"))


def test_an_environment_class_with_tool_methods_fits_by_name(tmp_path, tiny_checkpoint):
    """tests/_episode_envs.Shop (two typed tool methods, its own reward, ``answer_chars``)
    named by its dotted path: 2 updates; its metric reaches metrics.csv as env/answer_chars."""
    env = "{name: _episode_envs.Shop, max_turns: 2, add_instructions: false}"
    run_dir, _ = fit(tmp_path, tiny_checkpoint, env, *HF_STOPS)
    rows = read_csv(run_dir)
    chars = [v for _, v in series(rows, "env/answer_chars")]
    assert len(chars) == 2 and all(0 < v < 100 for v in chars), chars
    assert all(v == 0 for _, v in series(rows, "env/failures"))
    # held-out episodes report their tool use too (the random model calls nothing)
    assert [v for _, v in series(rows, "val/tool_use_frac")][:1] == [0.0]


def test_unsolved_groups_get_demonstrations_in_a_fit(tmp_path, tiny_checkpoint):
    """The arithmetic environment with ``demonstrate_unsolved`` on the quickstart's sums: the
    random tiny model solves nothing, so each generated group's first episode is the
    environment's demonstration (a call, its result, "The answer is N.", which the non-strict
    reward scores right), every group is kept, and the 2 updates are finite; demonstrations
    are left out of the engine/trainer log-prob parity (nothing sampled them)."""
    env = (
        "{name: arithmetic, max_turns: 3, max_episode_tokens: 256, demonstrate_unsolved: true, "
        "add_instructions: false}"
    )
    more = [
        "--data.init_args.sampling.max_tokens", "128",
        "--data.init_args.scoring.reward_kwargs", "{strict: false}",
    ]  # fmt: skip
    run_dir, _ = fit(tmp_path, tiny_checkpoint, env, *HF_STOPS, *more)
    rows = read_csv(run_dir)
    demos = [v for _, v in series(rows, "env/demonstrations")]
    generated = [v for _, v in series(rows, "data/generated_groups")]
    assert len(demos) == 2 and demos == generated and all(v > 0 for v in demos), (demos, generated)
    assert [v for _, v in series(rows, "data/kept_frac")] == [1.0, 1.0]
    losses = [v for _, v in series(rows, "update/loss")]
    assert len(losses) == 2 and all(math.isfinite(v) and v != 0 for v in losses), losses
    gaps = [v for _, v in series(rows, "parity/max_abs_diff")]
    assert gaps and max(gaps) < 1e-4, gaps
    # the demonstrations' observations are in the sequences, not in the loss nor in N
    record = json.loads((run_dir / "episodes.json").read_text())
    for step, tokens in zip(record["steps"], record["updates"]):
        assert step["response_tokens"] > step["loss_tokens"] == step["sampled_tokens"] == tokens


def test_demonstrations_of_an_environment_that_writes_none_are_a_config_error(
    tmp_path, tiny_checkpoint
):
    env = "{name: _episode_envs.Shop, max_turns: 2, add_instructions: false, demonstrate_unsolved: true}"
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "o.yaml", run_dir, tiny_checkpoint, env)
    proc = run_cli("fit", "--config", str(QUICKSTART), "--config", str(override), *HF_STOPS)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "environment.demonstrate_unsolved" in errors[0], errors
    assert "solution_turns(record)" in errors[0]
