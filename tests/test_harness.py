"""The shared test harness itself (tests/_harness.py): the base run config and its overrides."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests._harness import QUIET_TRAINER, TINY_RUN, merged, run_config


def test_merged_merges_mappings_and_replaces_the_rest():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    out = merged(base, {"a": {"c": [3], "e": None}, "f": 2})
    assert out == {"a": {"b": 1, "c": [3], "e": None}, "d": 1, "f": 2}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}  # untouched


def test_run_config_is_the_tiny_run_with_paths_and_overrides(tmp_path: Path):
    config = run_config(
        tmp_path / "run", tmp_path / "model", data={"init_args": {"sampling": {"max_tokens": 6}}}
    )
    assert config["trainer"] == {"default_root_dir": str(tmp_path / "run")}
    assert config["model"]["init_args"] == {
        "batching": {"mini_batch_size": None},
        "model_name_or_path": str(tmp_path / "model"),
    }
    data = config["data"]["init_args"]
    assert data["sampling"] == {"max_tokens": 6}
    assert data["dynamic_sampling"] == {
        "n": 4, "train_batch_size": 4, "gen_batch_size": 4, "filter_metric": None,
    }  # fmt: skip
    assert TINY_RUN["data"]["init_args"]["sampling"] == {"max_tokens": 4}  # not modified


def test_run_yaml_fixture_writes_what_run_config_returns(run_yaml, tmp_path: Path):
    path = run_yaml(tmp_path / "run", None, trainer={"max_steps": 3})
    assert yaml.safe_load(path.read_text()) == run_config(
        tmp_path / "run", trainer={"max_steps": 3}
    )


def test_fit_module_fixture_is_quiet(fit_module, fixed_batches, tiny_checkpoint, module_harness):
    from dapo_lightning.module import DAPOModule
    from dapo_lightning.update import BatchingConfig

    module = DAPOModule(
        str(tiny_checkpoint),
        optimizer=module_harness.sgd,
        batching=BatchingConfig(micro_batch_size=8),
        parity_check_every=0,
    )
    trainer = fit_module(module, fixed_batches(steps=2))
    assert trainer.global_step == 2 and trainer.logger is None
    assert not trainer.checkpoint_callbacks and QUIET_TRAINER["accelerator"] == "cpu"
