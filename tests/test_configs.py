"""Every YAML under configs/ parses and validates against the CLI (GPU ones included, without
building anything GPU-bound), the override files stay in step with quickstart.yaml, and the
SLURM script has what a requeue-safe multi-node launch needs."""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.strategies import Strategy

from dapo_lightning import DAPODataModule, DAPOModule
from dapo_lightning.cli import main, run_path
from dapo_lightning.rollout.vllm import VLLMRolloutEngine

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
QUICKSTART = REPO / "configs" / "quickstart.yaml"
GPU_CONFIGS = ("dapo_qwen2.5_32b.yaml", "single_gpu_1.5b.yaml")
SBATCH = REPO / "slurm" / "dapo.sbatch"


def is_override(path: Path) -> bool:
    """An override file has no model class of its own: it is used after quickstart.yaml."""
    raw = yaml.safe_load(path.read_text()) or {}
    return "class_path" not in (raw.get("model") or {})


def config_files(path: Path) -> list[str]:
    files = [str(path)]
    return [str(QUICKSTART), *files] if is_override(path) else files


def print_config(capsys: pytest.CaptureFixture, *files: str, extra: tuple[str, ...] = ()) -> dict:
    """The resolved ``fit`` config (``--print_config`` parses and type-checks every key)."""
    args = ["fit"]
    for f in files:
        args += ["--config", f]
    capsys.readouterr()
    with mock.patch.object(sys, "argv", ["dapo-lightning"]), pytest.raises(SystemExit) as exc:
        main([*args, *extra, "--print_config"])
    out, err = capsys.readouterr()
    assert exc.value.code in (0, None), err[-3000:]
    return yaml.safe_load(out)


def instantiate(cls: type, section: dict) -> object:
    """Build ``section`` ({class_path, init_args}) as a subclass of ``cls`` the way the CLI does
    (only for classes whose constructor touches no GPU and loads no weights)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--obj", type=cls)
    return parser.instantiate(parser.parse_object({"obj": section})).obj


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_builds_module_and_data(path, capsys):
    cfg = print_config(capsys, *config_files(path))
    assert cfg["model"]["class_path"] and cfg["data"]["class_path"]
    # DAPOModule / DAPODataModule constructors only validate and store: no weights, no GPU.
    # The printed config leaves out link targets; apply the CLI's links as it would.
    model_section, data_section = copy.deepcopy(cfg["model"]), copy.deepcopy(cfg["data"])
    m_args, d_args = model_section["init_args"], data_section["init_args"]
    d_args["model_name_or_path"] = m_args["model_name_or_path"]
    module = instantiate(DAPOModule, model_section)
    data = instantiate(DAPODataModule, data_section)
    # one temperature and one response length: the data's, carried by every batch
    assert "temperature" not in m_args and "max_response_length" not in m_args
    assert isinstance(module, DAPOModule) and isinstance(data, DAPODataModule)
    m = cfg["model"]["init_args"]
    ds = cfg["data"]["init_args"]["dynamic_sampling"]
    world = cfg["trainer"]["devices"] * cfg["trainer"]["num_nodes"]
    assert ds["train_batch_size"] % world == 0, "train_batch_size must divide by the world size"
    mini = m["batching"]["mini_batch_size"]
    if mini is not None:
        assert ds["train_batch_size"] % mini == 0
        assert mini % world == 0
    # Paths of a run live together, so `--ckpt_path auto` finds last.ckpt after a restart.
    root = cfg["trainer"]["default_root_dir"]
    checkpoints = [
        cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("ModelCheckpoint")
    ]
    assert len(checkpoints) == 1 and checkpoints[0]["init_args"]["save_last"] is True
    assert run_path(root, checkpoints[0]["init_args"]["dirpath"]).startswith(root)
    assert run_path(root, cfg["trainer"]["logger"]["init_args"]["save_dir"]).startswith(root)


def unknown_engine_kwargs(engine_kwargs: dict) -> list[str]:
    """Keys that are neither VLLMRolloutEngine arguments nor (when vLLM is installed) vllm.LLM
    engine arguments."""
    ours = set(inspect.signature(VLLMRolloutEngine.__init__).parameters) - {"self", "engine_kwargs"}
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        theirs = {f.name for f in dataclasses.fields(EngineArgs)}
    except ImportError:  # without vLLM only our own arguments can be checked
        return []
    return [k for k in engine_kwargs if k not in ours and k not in theirs]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_engine_kwargs_are_engine_arguments(path, capsys):
    """engine_kwargs is a free dict: check each key is an engine argument, so a typo fails here
    and not on the cluster."""
    d = print_config(capsys, *config_files(path))["data"]["init_args"]
    if d["engine"] != "vllm":
        assert not d.get("engine_kwargs")
        return
    assert unknown_engine_kwargs(d["engine_kwargs"]) == []
    max_model_len = d["engine_kwargs"].get("max_model_len")
    if max_model_len is not None:
        assert max_model_len >= d["prompts"]["max_prompt_length"] + d["sampling"]["max_tokens"]


def test_engine_kwargs_check_catches_a_typo():
    pytest.importorskip("vllm")
    assert unknown_engine_kwargs({"gpu_memory_utilisation": 0.4, "dtype": "bfloat16"}) == [
        "gpu_memory_utilisation"
    ]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs(name, capsys):
    cfg = print_config(capsys, str(REPO / "configs" / name))
    t, m, d = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    assert t["accelerator"] == "gpu"
    assert m["torch_dtype"] == "float32"  # fp32 master weights: lr 1e-6 needs them
    # bf16 compute: autocast (one GPU) or FSDP2's mixed precision over fp32 shards (32B)
    assert t["precision"] == "bf16-mixed" or m["sharding"]["param_dtype"] == "bfloat16"
    assert m["gradient_checkpointing"] is True
    assert d["engine"] == "vllm" and d["engine_kwargs"]["dtype"] == "bfloat16"
    # paper settings
    loss = m["loss"]
    assert (loss["clip_ratio_low"], loss["clip_ratio_high"]) == (0.2, 0.28)
    assert loss["loss_agg_mode"] == "token-mean" and loss["kl_coef"] == 0.0
    assert m["optimizer"]["init_args"]["lr"] == 1e-6
    ds = d["dynamic_sampling"]
    assert ds["n"] == 16 and d["sampling"]["temperature"] == 1.0 and ds["filter_metric"] == "acc"
    assert d["reward"] == "dapo" and d["prompts"]["train_files"] and d["validation"]["files"]
    updates = ds["train_batch_size"] // m["batching"]["mini_batch_size"]
    assert t["max_steps"] % updates == 0, "max_steps should be a whole number of rollout steps"
    if name == "single_gpu_1.5b.yaml":
        assert t["devices"] == 1 and t["num_nodes"] == 1
        assert d["engine_kwargs"]["gpu_memory_utilization"] == pytest.approx(0.4)
        assert d["engine_kwargs"]["enable_sleep_mode"] is True


def test_paper_config_numbers(capsys):
    cfg = print_config(capsys, str(REPO / "configs" / "dapo_qwen2.5_32b.yaml"))
    t, m, d = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    ds = d["dynamic_sampling"]
    mini = m["batching"]["mini_batch_size"]
    assert (ds["train_batch_size"], ds["n"], mini) == (512, 16, 32)
    assert ds["train_batch_size"] // mini == 16  # updates per rollout step
    assert m["optimizer_step"]["warmup_steps"] == 20 * 16  # 20 rollout steps of warm-up
    assert d["sampling"]["max_tokens"] == 20480
    overlong = [c for c in t["callbacks"] if c["class_path"].endswith("OverlongRewardShaping")]
    assert overlong[0]["init_args"]["buffer_length"] == 4096
    assert t["num_nodes"] > 1 and t["devices"] == 8
    # The strategy is CPU-constructible: FSDP2 over every rank, tensor parallelism in vLLM only.
    strategy = instantiate(Strategy, t["strategy"])
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert t["strategy"]["init_args"]["data_parallel_size"] == t["num_nodes"] * t["devices"]
    tp = d["engine_kwargs"]["tensor_parallel_size"]
    assert t["devices"] % tp == 0 and d["engine_kwargs"]["enable_sleep_mode"] is True
    # 30 AIME problems over the engine groups, one validation chunk each
    groups = t["num_nodes"] * t["devices"] // tp
    assert d["validation"]["batch_size"] >= -(-30 // groups)


def _without(cfg: dict, *keys: str) -> dict:
    cfg = copy.deepcopy(cfg)
    for key in keys:
        *parents, last = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node.pop(last)
    return cfg


def _callbacks_without_paths(cfg: dict) -> list[dict]:
    out = copy.deepcopy(cfg["trainer"]["callbacks"])
    for cb in out:
        cb.get("init_args", {}).pop("dirpath", None)
    return out


def test_grpo_baseline_differs_from_quickstart_only_in_the_dapo_techniques(capsys):
    dapo = print_config(capsys, str(QUICKSTART))
    grpo = print_config(capsys, str(QUICKSTART), str(REPO / "configs" / "grpo_baseline.yaml"))
    gm, gd = grpo["model"]["init_args"], grpo["data"]["init_args"]
    assert (gm["loss"]["clip_ratio_low"], gm["loss"]["clip_ratio_high"]) == (0.2, 0.2)
    assert gm["loss"]["loss_agg_mode"] == "seq-mean-token-mean"
    gds = gd["dynamic_sampling"]
    assert gds["filter_metric"] is None and gds["selection"]["retire_after"] == 0
    assert gds["gen_batch_size"] == gds["train_batch_size"]
    assert _callbacks_without_paths(grpo) == [
        cb
        for cb in _callbacks_without_paths(dapo)
        if not cb["class_path"].endswith("OverlongRewardShaping")
    ]
    differ = (
        "model.init_args.loss.clip_ratio_high",
        "model.init_args.loss.loss_agg_mode",
        "data.init_args.dynamic_sampling.filter_metric",
        "data.init_args.dynamic_sampling.gen_batch_size",
        "data.init_args.dynamic_sampling.selection.retire_after",
        "trainer.callbacks",
        "trainer.default_root_dir",
        "trainer.logger",
    )
    assert _without(grpo, *differ) == _without(dapo, *differ)
    assert grpo["trainer"]["default_root_dir"] != dapo["trainer"]["default_root_dir"]


def test_quickstart_vllm_only_changes_the_engine(capsys):
    hf = print_config(capsys, str(QUICKSTART))
    vllm = print_config(capsys, str(QUICKSTART), str(REPO / "configs" / "quickstart_vllm.yaml"))
    assert vllm["data"]["init_args"]["engine"] == "vllm"
    assert vllm["data"]["init_args"]["engine_kwargs"]["dtype"] == "float32"
    assert _callbacks_without_paths(vllm) == _callbacks_without_paths(hf)
    differ = (
        "data.init_args.engine",
        "data.init_args.engine_kwargs",
        "trainer.callbacks",
        "trainer.default_root_dir",
        "trainer.logger",
    )
    assert _without(vllm, *differ) == _without(hf, *differ)


# ---------------------------------------------------------------------------------- SLURM
def test_sbatch_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_sbatch_has_the_essentials():
    text = SBATCH.read_text()
    directives = {
        line.split()[1].split("=")[0]: line.split()[1]
        for line in text.splitlines()
        if line.startswith("#SBATCH")
    }
    assert directives["--signal"] == "--signal=SIGUSR1@90"
    assert (
        directives["--ntasks-per-node"].split("=")[1] == directives["--gpus-per-node"].split("=")[1]
    )
    for key in ("--nodes", "--requeue", "--time", "--open-mode"):
        assert key in directives, key
    assert "srun" in text and "--ckpt_path auto" in text


def test_sbatch_launch_line_follows_the_allocation(tmp_path):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "123",
        "SLURM_RESTART_COUNT": "1",
        "PROJECT_DIR": str(REPO),
    }
    proc = subprocess.run(
        ["bash", str(SBATCH), "configs/dapo_qwen2.5_32b.yaml", "--trainer.max_steps", "32"],
        env=env, capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    line = proc.stdout.strip()
    assert "job 123 restart 1" in line
    assert line.endswith(
        "srun --kill-on-bad-exit=1 --ntasks-per-node=4 .venv/bin/dapo-lightning fit "
        "--config configs/dapo_qwen2.5_32b.yaml "
        "--trainer.num_nodes 2 --trainer.devices 4 --ckpt_path auto --trainer.max_steps 32"
    )
    missing = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert (
        missing.returncode != 0 and "usage: sbatch slurm/dapo.sbatch CONFIG.yaml" in missing.stderr
    )
