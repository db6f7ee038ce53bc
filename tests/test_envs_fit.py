"""Multi-turn fits through the ``dapo-lightning fit`` console script on the tiny quickstart
model: the real engine (HF, vLLM) and the real calculator environment, 2 updates.

The tiny model never writes a tool call, so the calculator is built with a ``nudge``: a first
turn without a call gets a user turn back, and every episode has an observation between two
sampled turns. The recorder callback (tests/_episode_envs.py) checks what reached the update:
observation tokens are in the sequences but not in the loss mask or the token count N.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_cli import QUICKSTART, REPO, check, read_csv, run_cli, series

TINY = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1"]


def write_override(path: Path, run_dir: Path, model_dir: Path, environment: str) -> Path:
    path.write_text(
        f"""
trainer:
  default_root_dir: {run_dir}
  callbacks:
    - class_path: dapo_lightning.callbacks.OverlongRewardShaping
      init_args:
        buffer_length: 2
    - class_path: _episode_envs.EpisodeRecorder
model:
  init_args:
    model_name_or_path: {model_dir}
data:
  init_args:
    sampling: {{max_tokens: 6}}
    dynamic_sampling: {{n: 4, train_batch_size: 4, gen_batch_size: 4, filter_metric: null}}
    val_n: 2
    environment: {environment}
"""
    )
    return path


CALCULATOR = (
    "{name: calculator, kwargs: {nudge: Again.}, max_turns: 2, max_episode_tokens: 128, "
    "add_instructions: false}"
)


#: The HF engine's stop ids in the random-model fits: the EOS and a third of the byte tokens,
#: so the random tiny model ends its turns after a few tokens and every episode continues.
STOP_IDS = [1, *range(100, 190)]
HF_STOPS = ["--data.init_args.engine_kwargs", f"{{eos_token_id: {STOP_IDS}}}"]


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory):
    """The quickstart's warmed-up tiny model (it ends its answers with EOS), written as the
    quickstart's create_model_if_missing writes it (~25 s on 2 idle cores: slow tests only)."""
    from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint

    path = tmp_path_factory.mktemp("mtmodel") / "model"
    make_quickstart_checkpoint(path, seed=0, level=1, num_prompts=100, task_seed=0)
    return path


def fit(tmp_path: Path, model_dir: Path, environment: str, *extra: str, timeout: int = 300):
    run_dir = tmp_path / "run"
    override = write_override(tmp_path / "o.yaml", run_dir, model_dir, environment)
    proc = check(
        run_cli("fit", "--config", QUICKSTART, *extra, "--config", str(override), *TINY,
                timeout=timeout)
    )  # fmt: skip
    return run_dir, proc


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
@pytest.mark.timeout(1800)  # the warm-up and vLLM's start are minutes on a loaded machine
def test_calculator_fit_vllm(tmp_path, quickstart_model):
    """vLLM (no stop ids to set there): the quickstart's warmed-up model, which stops."""
    pytest.importorskip("vllm")
    vllm_cfg = str(REPO / "configs" / "quickstart_vllm.yaml")
    run_dir, _ = fit(tmp_path, quickstart_model, CALCULATOR, "--config", vllm_cfg, timeout=500)
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
        "data.init_args.max_prompt_length",
        "data.init_args.engine_kwargs.max_model_len",
    }
    assert single["data.init_args.environment"] is None
    assert multi["data.init_args.environment.name"] == "calculator"
    budget = multi["data.init_args.environment.max_episode_tokens"]
    assert budget == multi["data.init_args.engine_kwargs.max_model_len"]
    assert (
        budget
        >= multi["data.init_args.max_prompt_length"] + multi["data.init_args.sampling.max_tokens"]
    )
