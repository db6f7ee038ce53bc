"""A user's task, reward, environment and engine, registered from a module outside the library
(written to ``tmp_path``) and selected by name: through the registries in process, and in a
2-update ``dapo-lightning fit`` that finds the names through the module's entry point
(``dapo_lightning.extensions``, declared by a ``.dist-info`` folder beside it on PYTHONPATH, as a
pip-installed package declares it). Also the one importer's error for a dotted path that does
not import (issue 38: the CLI printed "No module named ..." without the PYTHONPATH hint)."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from dapo_lightning.checks import ConfigError
from dapo_lightning.data import DAPODataModule, PromptConfig
from dapo_lightning.envs import ENVIRONMENTS, EnvironmentConfig, environment_factory
from dapo_lightning.registry import ImportPathError, Registry, import_object
from dapo_lightning.rewards import REWARDS, get_reward
from dapo_lightning.rollout import (
    ENGINES,
    EngineCapabilities,
    HFRolloutEngine,
    RolloutEngine,
    engine_capabilities,
    register_engine,
)
from dapo_lightning.tasks import TASKS, get_task
from dapo_lightning.testing import make_tiny_tokenizer
from tests.test_cli import QUICKSTART, REPO, check, read_csv, run_cli, series


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """Each test's registrations are removed after it, so no other test (in this pytest
    worker) sees a user's names in the registries' lists of valid names."""
    registries = (ENGINES, ENVIRONMENTS, REWARDS, TASKS)
    before = [set(r.names()) for r in registries]
    yield
    for registry, names in zip(registries, before):
        for name in set(registry.names()) - names:
            registry.unregister(name)


#: The user's module: one of each kind, each writing what it did to a JSON-lines log.
USER_MODULE = '''
"""A user's extensions of dapo-lightning, outside the library."""

import json
import random

from dapo_lightning import (
    HFRolloutEngine,
    register_engine,
    register_environment,
    register_reward,
    register_task,
)
from dapo_lightning.envs import StepResult
from dapo_lightning.rewards import RewardResult


def log(path, **record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\\n")


@register_task("user_sums", reward="user_exact", description="'Sum: a+b=' by the user")
def make_user_sums(seed=0, level=1, num_prompts=8):
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"Sum: {a}+{b}=", "answer": str(a + b), "uid": f"user-{i}"})
    return rows


@register_reward("user_exact")
class UserExact:
    failure_score = -1.0

    def __init__(self, log_path):
        self.log_path = log_path

    def __call__(self, responses, ground_truths, **kw):
        log(self.log_path, kind="reward", responses=len(responses))
        return [RewardResult(score=1.0 if r.strip() == t else -1.0, acc=r.strip() == t)
                for r, t in zip(responses, ground_truths)]


@register_environment("user_one_turn")
class OneTurn:
    def __init__(self, log_path):
        self.log_path = log_path

    def reset(self, record):
        log(self.log_path, kind="reset", uid=record.uid)

    def step(self, text):
        log(self.log_path, kind="step")
        return StepResult(done=True)


@register_engine("user_hf")
class LoggingHF(HFRolloutEngine):
    def __init__(self, model, tokenizer=None, *, log_path, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.log_path = log_path

    def generate(self, prompts, n, sampling):
        log(self.log_path, kind="generate", prompts=[list(p) for p in prompts], n=n)
        return super().generate(prompts, n, sampling)


class PlainHF(HFRolloutEngine):
    """An engine class nobody registered: selectable by its dotted path only."""
'''


def write_user_package(folder: Path) -> Path:
    """``user_ext.py`` and the metadata that declares it an extension (what ``pip install`` of a
    package with ``[project.entry-points."dapo_lightning.extensions"] user_ext = "user_ext"``
    writes), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "user_ext.py").write_text(USER_MODULE)
    info = folder / "user_ext-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: user-ext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dapo_lightning.extensions]\nuser_ext = user_ext\n")
    return folder


# ----------------------------------------------------------------------------- in process
def test_user_extensions_are_found_by_name_through_their_entry_point(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "site")))
    monkeypatch.delitem(sys.modules, "user_ext", raising=False)
    log = tmp_path / "log.jsonl"
    task = get_task("user_sums")  # not imported yet: the entry point imports it
    import user_ext

    assert task.make_rows is user_ext.make_user_sums and task.reward == "user_exact"
    assert task.make_rows(seed=0, num_prompts=2)[0]["prompt"].startswith("Sum: ")
    reward = get_reward(task.reward, log_path=str(log))
    assert [r.score for r in reward(["7", "x"], ["7", "7"])] == [1.0, -1.0]
    make = environment_factory(EnvironmentConfig(name="user_one_turn", kwargs={"log_path": "x"}))
    assert (
        type(make()) is user_ext.OneTurn
        and ENVIRONMENTS.get("user_one_turn").fn is user_ext.OneTurn
    )
    assert ENGINES.get("user_hf").fn is user_ext.LoggingHF
    assert engine_capabilities("user_hf") == EngineCapabilities()  # the HF engine's: none
    # the same objects by their dotted paths
    assert get_task("user_ext.make_user_sums").name == "user_sums"
    assert ENGINES.get("user_ext.LoggingHF").name == "user_hf"


def test_an_extension_that_does_not_import_is_named(tmp_path, monkeypatch):
    info = tmp_path / "broken_ext-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-ext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dapo_lightning.extensions]\nbroken = no_such_ext\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportPathError, match=r"entry point 'broken' = 'no_such_ext' does not "):
        get_task("no_such_task")


def test_an_unregistered_class_by_dotted_path_where_the_kind_takes_one(tmp_path, monkeypatch):
    """Environments, rewards and engines take any class of their kind at a dotted path; a task
    must be registered (it declares its reward)."""
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "site")))
    assert ENVIRONMENTS.get("dapo_lightning.envs.calculator.CalculatorEnvironment").name == (
        "calculator"
    )
    assert ENGINES.get("dapo_lightning.rollout.hf.HFRolloutEngine").name == "hf"
    entry = ENGINES.get("user_ext.PlainHF")
    assert entry.name == "user_ext.PlainHF" and entry.fn.__name__ == "PlainHF"  # adopted
    with pytest.raises(ConfigError, match=r"no function 'quickstart_answer_distribution' regi"):
        get_task("dapo_lightning.tasks.arithmetic_warmup.quickstart_answer_distribution")
    with pytest.raises(ConfigError, match="no function 'evaluate' registered as an environment"):
        ENVIRONMENTS.get("dapo_lightning.envs.calculator.evaluate")
    with pytest.raises(ConfigError, match="registered as a rollout engine"):
        ENGINES.get("dapo_lightning.envs.calculator.CalculatorEnvironment")


class UnregisteredEngine(HFRolloutEngine):
    """An engine class nobody registered: selectable by its dotted path only."""


def test_the_importer_names_the_path_and_the_fix():
    with pytest.raises(ImportPathError) as err:
        import_object("no_such_pkg.sub.fn", "model.loss.objective")
    text = str(err.value)
    assert text.startswith("model.loss.objective 'no_such_pkg.sub.fn' does not import ")
    assert "No module named 'no_such_pkg'" in text and "PYTHONPATH" in text
    # raised from None: the root cause a caller reports is this message, not the ImportError
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ImportError)
    with pytest.raises(ImportPathError, match=r"has no attribute 'nope'"):
        import_object("dapo_lightning.registry.nope", "x")
    assert import_object("dapo_lightning.registry.nope", "x", missing=None) is None
    with pytest.raises(ImportPathError, match=r"'nodot' must be a dotted path"):
        import_object("nodot", "x")


def test_a_registry_refuses_a_second_object_under_a_taken_name():
    table: Registry = Registry("widget", "data.widget", "register_widget")
    table.register("a")(HFRolloutEngine)
    table.register("a")(HFRolloutEngine)  # the same one again (a re-import): fine
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        table.register("a")(UnregisteredEngine)
    with pytest.raises(ConfigError, match=r"^data.widget='b' is not a registered widget; valid: a"):
        table.get("b")
    assert list(table) == ["a"] and "a" in table


def test_capabilities_and_methods_go_together():
    with pytest.raises(TypeError, match="streaming capability and its methods"):

        class Undeclared(RolloutEngine):  # streams, but does not say so
            def generate(self, prompts, n, sampling): ...
            def load_weights(self, named_tensors): ...
            def stream_groups(self, prompts, n, sampling): ...

    with pytest.raises(TypeError, match="sleep capability and its methods"):

        class Sleepless(RolloutEngine):  # says it sleeps, has no sleep
            capabilities = EngineCapabilities(sleep=True)

    class Tensorparallel(RolloutEngine):  # a capability without methods of its own
        capabilities = EngineCapabilities(tensor_parallel=True)

    assert engine_capabilities("vllm") == EngineCapabilities(
        streaming=True, tensor_parallel=True, sleep=True, adapters=True
    )
    assert engine_capabilities("hf") == EngineCapabilities()


# ----------------------------------------------------------------------------- the command
def _override(path: Path, run_dir: Path, model_dir: Path, log: Path) -> Path:
    path.write_text(
        textwrap.dedent(
            f"""
            trainer:
              default_root_dir: {run_dir}
              callbacks: []
            model:
              init_args:
                model_name_or_path: {model_dir}
                batching: {{mini_batch_size: null}}  # one update per rollout step
            data:
              init_args:
                prompts: {{task: user_sums, task_kwargs: {{level: 1, num_prompts: 10}}}}
                reward: user_exact
                scoring: {{in_process: true, reward_kwargs: {{log_path: {log}}}}}
                engine: user_hf
                engine_kwargs: {{log_path: {log}}}
                environment:
                  name: user_one_turn
                  kwargs: {{log_path: {log}}}
                  max_turns: 2
                  max_episode_tokens: 64
                  add_instructions: false
                sampling: {{max_tokens: 4}}
                dynamic_sampling: {{n: 4, train_batch_size: 4, gen_batch_size: 4, filter_metric: null}}
                validation: {{n: 2}}
            """
        )
    )
    return path


def test_a_fit_with_a_user_task_reward_environment_and_engine_by_name(tiny_checkpoint, tmp_path):
    site = write_user_package(tmp_path / "site")
    run_dir, log = tmp_path / "run", tmp_path / "log.jsonl"
    override = _override(tmp_path / "o.yaml", run_dir, tiny_checkpoint, log)
    path = os.pathsep.join([str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--config", str(override),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "1",
        env={"PYTHONPATH": path}, timeout=400,
    )  # fmt: skip
    check(proc)
    rows = read_csv(run_dir)
    assert [v for _, v in series(rows, "rollout/step")] == [1.0, 2.0]
    assert len(series(rows, "update/loss")) == 2
    assert len(series(rows, "env/turns_mean")) == 2  # episodes ran (the environment's metrics)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    # the engine: every prompt it sampled for is one of the user task's
    tokenizer = make_tiny_tokenizer()
    prompts = [
        tokenizer.decode(p) for r in records if r["kind"] == "generate" for p in r["prompts"]
    ]
    assert prompts and all(re.fullmatch(r"Sum: \d\+\d=", p) for p in prompts), prompts[:4]
    # the environment: one reset per episode (4 groups of 4 per step, 2 steps, + validation)
    assert kinds.count("reset") >= 2 * 4 * 4
    # the reward: it scored every training response (and validation's)
    assert sum(r["responses"] for r in records if r["kind"] == "reward") >= 2 * 4 * 4
    saved = next(run_dir.rglob("config.yaml")).read_text()
    for line in ("task: user_sums", "reward: user_exact", "engine: user_hf", "name: user_one_turn"):
        assert line in saved


def test_an_objective_path_that_does_not_import_names_the_fix(tmp_path):
    """Issue 38: ``--model.init_args.loss.objective no_such_pkg.fn`` printed "No module named
    'no_such_pkg'" only; now one ``error:`` line names the setting and the PYTHONPATH fix."""
    proc = run_cli(
        "fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path / "run"),
        "--model.init_args.loss.objective", "no_such_pkg.fn", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "error: DAPOModule: model.loss.objective 'no_such_pkg.fn' does not import" in errors[0]
    assert "No module named 'no_such_pkg'" in errors[0] and "PYTHONPATH" in errors[0], errors


class TensorParallelEngine(HFRolloutEngine):
    """An HF-like engine that declares tensor parallelism (only its declaration is used here)."""

    capabilities = EngineCapabilities(tensor_parallel=True)


def test_the_data_module_shards_by_the_declared_capability_not_the_name():
    """Ranks per engine come from ``tensor_parallel_size`` only for an engine that declares
    tensor parallelism (it was the string "vllm")."""
    register_engine("tensor_parallel_test")(TensorParallelEngine)
    kwargs = {"tensor_parallel_size": 2}
    prompts = PromptConfig(task="arithmetic")
    declared = DAPODataModule(prompts=prompts, engine="tensor_parallel_test", engine_kwargs=kwargs)
    assert declared._tp_size == 2
    assert DAPODataModule(prompts=prompts, engine="hf", engine_kwargs=kwargs)._tp_size == 1
