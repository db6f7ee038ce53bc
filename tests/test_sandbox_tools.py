"""The ``python`` tool environment and the ``code_tests`` reward (issue 56), both through the
real bwrap sandbox: what the policy sees of a call, the per-episode sandbox counts, an episode
played through the real runner, and unit tests scored in the sandbox, in reward worker
processes too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from dapo_lightning.checks import ConfigError
from dapo_lightning.data.prompts.config import ScoringConfig
from dapo_lightning.envs import (
    ENVIRONMENTS,
    EnvironmentConfig,
    ObservationFormatter,
    PythonToolEnvironment,
    environment_class,
    environment_factory,
    register_environment,
)
from dapo_lightning.envs.python_tool import NO_OUTPUT, observation_text
from dapo_lightning.envs.replay import play_demonstrations
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.rewards import CodeTestsReward, RewardRunner, get_reward
from dapo_lightning.rewards.code_tests import (
    count_passes,
    extract_code,
    harness_program,
    parse_tests,
)
from dapo_lightning.sandbox import SandboxResult
from tests._harness import needs_bwrap

pytestmark = needs_bwrap

FAST = {"timeout_s": 2.0, "pool_size": 1}


def call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


@pytest.fixture(scope="module")
def env() -> PythonToolEnvironment:
    environment = PythonToolEnvironment(sandbox=FAST)
    environment.reset(PromptRecord("q", "q", "0"))
    return environment


# ----------------------------------------------------------------------------- the python tool
def test_python_is_a_registered_environment_with_one_tool():
    assert "python" in ENVIRONMENTS.names()
    assert environment_class("python") is PythonToolEnvironment
    schemas = PythonToolEnvironment(sandbox=FAST).tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["python"]
    assert schemas[0]["function"]["parameters"]["required"] == ["code"]


def test_a_call_shows_what_the_code_printed(env):
    result = env.step(call("print(23 * 47 * 56)"))
    assert (result.observation, result.done, result.tool_calls, result.tool_errors) == (
        "60536", False, 1, 0,
    )  # fmt: skip
    assert result.metrics == {"sandbox_timeouts": 0.0, "sandbox_errors": 0.0}
    fenced = env.step(call("```python\nprint('fenced')\n```"))
    assert fenced.observation == "fenced"
    silent = env.step(call("x = 1"))
    assert silent.observation == NO_OUTPUT
    final = env.step("The answer is 60536.")
    assert final.done and final.metrics == {"sandbox_timeouts": 0.0, "sandbox_errors": 0.0}


def test_a_traceback_a_crash_and_a_timeout_are_observations_and_counted(env):
    raised = env.step(call("1 / 0"))
    assert raised.observation.endswith("ZeroDivisionError: division by zero")
    assert raised.metrics == {"sandbox_timeouts": 0.0, "sandbox_errors": 1.0}
    assert raised.tool_errors == 0  # the code failed, not the tool
    crashed = env.step(call("import ctypes\nctypes.string_at(0)"))
    assert crashed.observation == "[killed by SIGSEGV (a crash)]"
    looped = env.step(call("print('start', flush=True)\nwhile True: pass"))
    assert looped.observation == (
        "start\n[timeout: ran over its deadline of 2 s; the code was killed]"
    )
    assert looped.metrics == {"sandbox_timeouts": 1.0, "sandbox_errors": 0.0}
    both = env.step(call("1/0") + call("while True: pass"))
    assert both.metrics == {"sandbox_timeouts": 1.0, "sandbox_errors": 1.0}
    assert both.tool_calls == 2


def test_long_output_is_cut_with_a_note():
    # a deadline far above the flood's ~0.1 s: on loaded cores 2 s was once not enough
    slow_ok = {**FAST, "timeout_s": 15.0, "max_output_bytes": 300}
    env = PythonToolEnvironment(sandbox=slow_ok, max_observation_chars=50)
    env.reset(PromptRecord("q", "q", "0"))
    assert env.step(call("print('a' * 200)")).observation == "a" * 50 + "\n[output truncated]"
    flood = env.step(call("print('b' * 10**6)")).observation
    assert flood == "b" * 50 + "\n[output truncated]"


def test_observation_text_joins_stdout_stderr_and_notes():
    result = SandboxResult("error", 1, "out", "Traceback\nValueError: x\n", reason="exit status 1")
    assert observation_text(result, 100) == "out\nTraceback\nValueError: x"
    cut = SandboxResult("timeout", -9, "x" * 10, "", True, False, 1.0, "ran over 1 s")
    assert (
        observation_text(cut, 4)
        == "xxxx\n[output truncated]\n[timeout: ran over 1 s; the code was killed]"
    )
    assert observation_text(SandboxResult("ok", 0, "", ""), 10) == NO_OUTPUT


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="environment.kwargs.sandbox has no setting 'bogus'"):
        environment_factory(EnvironmentConfig(name="python", kwargs={"sandbox": {"bogus": 1}}))
    with pytest.raises(ConfigError, match="sandbox.timeout_s must be > 0"):
        PythonToolEnvironment(sandbox={"timeout_s": 0})
    with pytest.raises(ValueError, match="max_observation_chars must be an integer >= 1"):
        PythonToolEnvironment(max_observation_chars=0)


@register_environment("test_python_demo")
class _Demonstrated(PythonToolEnvironment):
    """The python environment with a scripted episode: the call in the prompt, then an answer."""

    def solution_turns(self, record: PromptRecord) -> list[str]:
        return [call(record.meta["code"]), "The answer is 60536."]


def test_an_episode_through_the_runner_shows_the_output_and_counts_per_episode(tiny_checkpoint):
    """Two scripted episodes played by the real runner: the observation tokens are the
    formatter's tokens of the code's output, and each episode's metrics are its own."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    records = []
    for i, code in enumerate(["print(23 * 47 * 56)", "while True: pass"]):
        r = PromptRecord(
            f"q{i}", [{"role": "user", "content": f"q{i}"}], "60536", meta={"code": code}
        )
        r.prompt_ids = encode_prompt(tokenizer, r.prompt, True)
        records.append(r)
    config = EnvironmentConfig(name="test_python_demo", kwargs={"sandbox": FAST})
    observe = ObservationFormatter(tokenizer, "tool", True)
    ok, slow = play_demonstrations(
        records, environment_factory(config), config, observe,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        max_tokens=400, max_episode_tokens=2000,
    )  # fmt: skip
    first = tokenizer(call("print(23 * 47 * 56)"), add_special_tokens=False)["input_ids"]
    start = len(first) + 1  # the call and its EOS
    assert ok.token_ids[start : start + len(observe("60536"))] == observe("60536")
    assert (ok.turns, ok.tool_calls, ok.failure) == (2, 1, None)
    assert ok.metrics == {"sandbox_timeouts": 0.0, "sandbox_errors": 0.0}
    assert slow.metrics == {"sandbox_timeouts": 1.0, "sandbox_errors": 0.0}
    assert slow.failure is None  # the code's timeout is an observation, not a failed episode


def question(text: str, answer: str = "0") -> PromptRecord:
    return PromptRecord(text, [{"role": "user", "content": text}], answer)


def test_solution_turns_print_the_questions_whole_number_expression_then_answer_it(env):
    product = question("Solve the following multiplication: 15 * 43 * 75.", "48375")
    assert env.solution_turns(product) == [
        '<tool_call>{"name": "python", "arguments": {"code": "print(15 * 43 * 75)"}}</tool_call>',
        "The answer is 48375.",
    ]
    assert env.solution_turns(question("Calculate 8 - 9.")) == [
        call("print(8 - 9)"), "The answer is -1.",
    ]  # fmt: skip
    assert env.solution_turns(question("What is (2 + 3) * 4?"))[-1] == "The answer is 20."
    # no expression; only a division (Python prints a float): no demonstration
    assert env.solution_turns(question("Name a prime.")) is None
    assert env.solution_turns(question("What is 7 / 2?")) is None


def test_a_demonstration_played_in_the_sandbox_prints_its_answer(tiny_checkpoint):
    """The solution turns played by the real runner on the real sandbox: the observation is
    the number the final turn answers."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    record = question("Solve the following multiplication: 15 * 43 * 75.", "48375")
    record.prompt_ids = encode_prompt(tokenizer, record.prompt, True)
    config = EnvironmentConfig(name="python", kwargs={"sandbox": FAST})
    (episode,) = play_demonstrations(
        [record], environment_factory(config), config, ObservationFormatter(tokenizer, "tool", True),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        max_tokens=400, max_episode_tokens=2000,
    )  # fmt: skip
    assert (episode.turns, episode.tool_calls, episode.tool_errors) == (2, 1, 0)
    text = tokenizer.decode(episode.token_ids, skip_special_tokens=True)
    assert text.index("48375") < text.index("The answer is 48375.")


def test_the_python_tool_recipes_cold_start_matches_its_fit_config():
    """configs/sft/smollm2_python_tool.yaml: its episodes are the fit recipe's (environment but
    the RL-only demonstrations of unsolved groups, assistant tokens), its model the fit's, on
    easier problems than the fit's (two one-digit terms against three 2-digit factors)."""
    import dataclasses

    from dapo_lightning.cli.sft_command import sft_main

    repo = Path(__file__).resolve().parent.parent
    seen = []
    sft_main(["--config", str(repo / "configs/sft/smollm2_python_tool.yaml")], run=seen.append)
    (config,) = seen
    fit = yaml.safe_load((repo / "configs/smollm2_python_tool.yaml").read_text())
    data = fit["data"]["init_args"]
    environment = EnvironmentConfig(**data["environment"])
    assert environment.name == "python" and environment.demonstrate_unsolved
    assert config.environment == dataclasses.replace(environment, demonstrate_unsolved=False)
    assert config.max_tokens == data["sampling"]["max_tokens"]
    assert config.output_dir == fit["model"]["init_args"]["model_name_or_path"]
    warm, task = config.prompts.task_kwargs, data["prompts"]["task_kwargs"]
    assert (warm["dataset"], warm["config"]["max_terms"], warm["config"]["max_digits"]) == (
        "basic_arithmetic", 2, 1,
    )  # fmt: skip
    assert (task["dataset"], task["config"]["min_terms"], task["config"]["min_digits"]) == (
        "products", 3, 2,
    )  # fmt: skip


# ----------------------------------------------------------------------------- code_tests
def test_extract_code_and_parse_tests():
    assert extract_code("Here:\n```python\ndef f(): pass\n```\nor\n```py\nx = 2\n```") == "x = 2"
    assert extract_code("```\nprint(1)\n```") == "print(1)"
    assert extract_code("  def f(x): return x\n") == "def f(x): return x"
    assert parse_tests('["assert f(1) == 1", "assert f(2) == 2"]') == [
        "assert f(1) == 1",
        "assert f(2) == 2",
    ]
    assert parse_tests("assert f(1) == 1\n\nassert f(2) == 2\n") == [
        "assert f(1) == 1",
        "assert f(2) == 2",
    ]
    for bad in ("", "[1, 2]", "[]"):
        with pytest.raises(ValueError, match="code_tests"):
            parse_tests(bad)


def test_count_passes_reads_only_marked_lines_up_to_the_total():
    token = "@@t@@"
    out = "@@t@@P\nnoise @@t@@P\n@@t@@F\n@@t@@P\n@@t@@P\n"
    assert count_passes(out, token, 3) == 2  # P, F, P: the fourth mark is past the total
    assert count_passes("@@x@@P\n", token, 1) == 0


TESTS = json.dumps(["assert f(2) == 4", "assert f(0) == 0", "assert f(-3) == -6"])


@pytest.fixture(scope="module")
def reward() -> CodeTestsReward:
    return get_reward("code_tests", sandbox={"timeout_s": 2.0, "pool_size": 2})


def test_code_tests_scores_all_pass_plus_one_else_minus_one_with_the_pass_fraction(reward):
    responses = [
        "```python\ndef f(x):\n    return 2 * x\n```",
        "def f(x):\n    return x * x",  # passes f(2) and f(0): 2 of 3
        "I do not know.",
        "",
    ]
    results = reward(responses, [TESTS] * 4)
    assert [r.score for r in results] == [1.0, -1.0, -1.0, -1.0]
    assert [r.acc for r in results] == [True, False, False, False]
    assert [r.extra["pass_frac"] for r in results] == [1.0, 2 / 3, 0.0, 0.0]
    assert [r.extra["has_answer"] for r in results] == [True, True, True, False]
    assert [r.extra["sandbox_timeout"] for r in results] == [0.0] * 4


def test_code_functions_rows_are_seeded_split_and_their_solutions_pass_their_tests(reward):
    """The code_functions task: the same rows for a seed, held-out problems never a training
    one, and in the sandbox every row's solution passes all its tests while a constant
    function fails them."""
    from dapo_lightning.tasks import get_task
    from dapo_lightning.tasks.code_functions import TEMPLATES, make_code_function_rows

    task = get_task("code_functions")
    assert task.reward == "code_tests"
    rows = task.make_rows(seed=1, size=40, val_size=20)
    assert rows == make_code_function_rows(40, 20, seed=1)
    train = {r["uid"] for r in rows if r["split"] == "train"}
    val = {r["uid"] for r in rows if r["split"] == "val"}
    assert (len(train), len(val), train & val) == (40, 20, set())
    linear = make_code_function_rows(1, 0, seed=0, templates=["linear"])[0]
    text = linear["prompt"][0]["content"]
    a, b = (int(v) for v in linear["uid"].split("-")[2:])
    assert text.startswith(f"Write a Python function f(x) that returns x times {a} plus {b}.")
    assert json.loads(linear["answer"]) == [
        f"assert f(0) == {b}", f"assert f(1) == {a + b}", f"assert f(-4) == {b - 4 * a}",
        f"assert f(7) == {7 * a + b}",
    ]  # fmt: skip
    one_each = [make_code_function_rows(1, 0, seed=2, templates=[t.name])[0] for t in TEMPLATES]
    every = rows + one_each
    results = reward([r["solution"] for r in every], [r["answer"] for r in every])
    assert [r.score for r in results] == [1.0] * len(every)
    wrong = reward(["def f(x):\n    return 0"] * len(one_each), [r["answer"] for r in one_each])
    assert all(r.score == -1.0 for r in wrong)
    with pytest.raises(ValueError, match="unknown templates"):
        make_code_function_rows(4, 0, templates=["sort"])


def test_code_tests_holds_against_hostile_solutions(reward):
    token_guess = "@@" + "0" * 16 + "@@"
    responses = [
        "import os\nos._exit(0)",  # leaves before the tests run
        "def f(x):\n    while True: pass",  # hangs on the first test
        "import sys\nprint('x' * 10**7)\nsys.stdout.flush()\ndef f(x):\n    return 2 * x",
        f"print('{token_guess}P\\n' * 3)\ndef f(x):\n    return 0",  # a guessed report
        "raise SystemExit(0)",
    ]
    results = reward(responses, [TESTS] * len(responses))
    assert [r.score for r in results] == [-1.0, -1.0, 1.0, -1.0, -1.0]
    assert [r.extra["pass_frac"] for r in results] == [0.0, 0.0, 1.0, 1 / 3, 0.0]
    assert [r.extra["sandbox_timeout"] for r in results] == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_the_harness_runs_each_test_in_the_solutions_namespace():
    program = harness_program("y = 5", ["assert y == 5", "assert y == 6"], "@@k@@")
    compile(program, "<program>", "exec")  # valid Python whatever the code holds
    assert "'y = 5'" in program and "'assert y == 6'" in program


def test_code_tests_scores_in_reward_worker_processes():
    """The reward travels to two spawned worker processes (pickled without a sandbox; each
    worker starts its own) and scores there."""
    reward = CodeTestsReward(sandbox={"timeout_s": 2.0, "pool_size": 1})
    runner = RewardRunner(reward, timeout_s=30.0, num_workers=2, chunk_size=2)
    try:
        good, bad = "def f(x):\n    return 2 * x", "def f(x):\n    return x"
        results = runner.score([good, bad, bad, good], [TESTS] * 4)
    finally:
        runner.close()
    assert [r.score for r in results] == [1.0, -1.0, -1.0, 1.0]
    assert [round(r.extra["pass_frac"], 3) for r in results] == [1.0, 0.333, 0.333, 1.0]
    assert runner.last_failures == 0


def test_code_tests_bad_settings_are_named():
    with pytest.raises(ConfigError, match="data.scoring.reward_kwargs.sandbox has no setting"):
        get_reward("code_tests", sandbox={"timeout": 1})
    with pytest.raises(ConfigError, match="data.scoring.reward_kwargs.wrong_score=nan is not"):
        get_reward("code_tests", wrong_score=float("nan"))


@pytest.mark.slow
def test_the_throughput_benchmark_runs_quick():
    """python -m benchmarks.sandbox_throughput --quick end to end: its table and its PNG (no timing
    asserted: these cores are shared)."""
    root = Path(__file__).resolve().parent.parent
    png = root / "benchmarks" / "out" / "sandbox_throughput_quick.png"
    png.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sandbox_throughput", "--quick"],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "python tool x2" in proc.stdout and "sandbox warm" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_cli_refuses_a_python_environment_without_bwrap(tmp_path):
    """A real ``dapo-lightning fit`` with ``environment.name: python`` and no bwrap on PATH
    stops at start with one error line naming the fix, exit status 2."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dapo-lightning"), "fit",
         "--config", str(root / "configs" / "quickstart.yaml"),
         "--data.init_args.environment", '{"name": "python"}',
         "--trainer.default_root_dir", str(tmp_path / "run")],
        cwd=tmp_path, env=dict(os.environ, PATH=str(tmp_path)),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert "bubblewrap (bwrap) is not installed" in errors[0]
    assert "scripts/setup.sh" in errors[0] and "isolation: none" in errors[0]


def test_the_docs_example_builds_the_environment_and_the_reward():
    """docs/environments.md's sandbox YAML builds the real environment, scoring settings and
    reward."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    section = text[text.index("## Model-written code: the sandbox") :]
    block = section[section.index("```yaml\n") + len("```yaml\n") :]
    data = yaml.safe_load(block[: block.index("```")])["data"]["init_args"]
    env = environment_factory(EnvironmentConfig(**data["environment"]))()
    scoring = ScoringConfig(**data["scoring"])
    reward = get_reward(data["reward"], **scoring.reward_kwargs)
    assert isinstance(env, PythonToolEnvironment) and isinstance(reward, CodeTestsReward)
    assert (env.sandbox_config.timeout_s, env.sandbox_config.pool_size) == (5, 2)
    assert reward.sandbox.timeout_s < scoring.timeout_s
