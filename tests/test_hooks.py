"""The DAPO hook protocol (dapo_lightning/hooks.py): the documented import line, dispatch by
the declared type, and the start-up warning for a plain Callback that defines a DAPO hook."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from dapo_lightning import DAPODataModule, hooks
from dapo_lightning.data.prompts.config import PromptConfig
from dapo_lightning.hooks import (
    DAPO_HOOKS,
    DAPOCallback,
    call_dapo_hook,
    undeclared_dapo_hooks,
    warn_undeclared_dapo_hooks,
)
from dapo_lightning.module import DAPOModule
from dapo_lightning.rollout import EngineSession, RolloutEngine
from tests._module_harness import FixedBatches, fixed_batch, sgd


def test_readme_import_line_runs_as_written():
    # The README's extension point, in a fresh interpreter (nothing imported before it).
    code = (
        "from dapo_lightning.callbacks import DAPOCallback\n"
        "import dapo_lightning.hooks as h\n"
        "assert DAPOCallback is h.DAPOCallback\n"
        "print(DAPOCallback.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "dapo_lightning.hooks"


class Declared(DAPOCallback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_rollouts_scored(self, trainer, pl_module, rollouts) -> None:
        self.calls.append(f"scored:{rollouts}")

    def on_dapo_update(self, trainer, pl_module, metrics) -> None:
        self.calls.append(f"update:{sorted(metrics)}")


class PlainScorer(Callback):
    """Defines the DAPO hooks without subclassing DAPOCallback."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_rollouts_scored(self, trainer, pl_module, rollouts) -> None:  # never called
        self.calls.append("scored")

    def on_dapo_update(self, trainer, pl_module, metrics) -> None:  # never called
        self.calls.append("update")


class Unrelated(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        pass


def test_dispatch_goes_by_the_declared_type():
    declared, plain = Declared(), PlainScorer()
    trainer = Trainer(callbacks=[declared, plain, Unrelated()], logger=False, accelerator="cpu")
    call_dapo_hook(trainer, "on_rollouts_scored", "R")
    call_dapo_hook(trainer, "on_dapo_update", {"loss": 1.0, "lr": 0.1})
    assert declared.calls == ["scored:R", "update:['loss', 'lr']"]
    assert plain.calls == []
    with pytest.raises(ValueError, match="unknown DAPO hook 'on_rollout_scored'"):
        call_dapo_hook(trainer, "on_rollout_scored", "R")
    call_dapo_hook(None, "on_dapo_update", {})  # no trainer: nothing to call


def test_undeclared_hooks_are_found_and_warned_once_per_trainer():
    assert DAPO_HOOKS == ("on_rollouts_scored", "on_rollouts_discarded", "on_dapo_update")
    callbacks = [Declared(), PlainScorer(), Unrelated()]
    assert undeclared_dapo_hooks(callbacks) == [
        ("PlainScorer", "on_rollouts_scored"),
        ("PlainScorer", "on_dapo_update"),
    ]
    trainer = Trainer(callbacks=callbacks, logger=False, accelerator="cpu")
    with pytest.warns(UserWarning) as record:
        warn_undeclared_dapo_hooks(trainer)
    texts = [str(w.message) for w in record if "DAPOCallback" in str(w.message)]
    assert len(texts) == 2
    assert "callback PlainScorer defines on_rollouts_scored()" in texts[0]
    assert "subclass dapo_lightning.callbacks.DAPOCallback" in texts[0]
    assert "on_dapo_update()" in texts[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_undeclared_dapo_hooks(trainer)  # checked already: silent
        warn_undeclared_dapo_hooks(Trainer(callbacks=[Declared()], logger=False))  # all declared


def test_fit_warns_about_a_plain_callback_and_still_calls_the_declared_one(tiny_checkpoint):
    torch.manual_seed(0)
    module = DAPOModule(str(tiny_checkpoint), optimizer=sgd, parity_check_every=0)
    declared, plain = Declared(), PlainScorer()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[declared, plain],
    )
    with pytest.warns(UserWarning, match="callback PlainScorer defines on_dapo_update"):
        trainer.fit(module, datamodule=FixedBatches(fixed_batch(0), steps=1))
    assert plain.calls == []
    assert len(declared.calls) == 1 and declared.calls[0].startswith("update:")
    assert "grad_norm" in declared.calls[0] and "loss" in declared.calls[0]
    assert trainer in hooks._CHECKED


def test_an_engine_object_must_subclass_the_protocol(tiny_checkpoint):
    class Duck:  # generate / load_weights, but not a RolloutEngine
        def generate(self, prompts, n, sampling):
            return []

        def load_weights(self, named_tensors):
            return None

    with pytest.raises(TypeError, match=r"data.engine \(Duck\) does not subclass .*RolloutEngine"):
        DAPODataModule(str(tiny_checkpoint), prompts=PromptConfig(task="arithmetic"), engine=Duck())

    class Minimal(RolloutEngine):
        def generate(self, prompts, n, sampling):
            return [[] for _ in prompts]

        def load_weights(self, named_tensors):
            self.loaded = [name for name, _ in named_tensors]

    engine = Minimal()  # every optional capability has its default
    assert engine.model is None and engine.sleep_mode is False and engine.lora_enabled is False
    assert engine.wake_up() is False and engine.sleep() is False
    assert engine.state_dict() == {} and engine.load_state_dict({"x": 1}) is None
    with pytest.raises(NotImplementedError, match="Minimal serves no LoRA adapters"):
        engine.load_adapter([], None)
    session = EngineSession(engine)
    with session.generating(version=0) as got:
        assert got is engine and got.generate([[1]], 2, None) == [[]]
    assert session.state_dict() == {}
