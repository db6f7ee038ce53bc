"""Multi-turn episodes (dapo_lightning.envs): the calculator, tool calls, observations, the
episode runner on the real HF engine with the tiny model, masks through the batch, faults.

The tiny random model never writes a well-formed tool call, so the runner tests drive the
real engine with scripted environments (real Environment implementations that answer every
turn the same way); the calculator itself is tested on text.
"""

from __future__ import annotations

import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_lightning.batch import RolloutBatch
from dapo_lightning.data.sampling.producer import concat_rollouts
from dapo_lightning.envs import (
    CalculatorEnvironment,
    CalculatorError,
    EnvironmentConfig,
    EnvironmentFailureError,
    EpisodeRunner,
    ObservationFormatter,
    StepResult,
    ToolCall,
    ToolCallError,
    environment_factory,
    evaluate,
    parse_tool_calls,
    with_instructions,
)
from dapo_lightning.envs.replay import ReplayEngine
from dapo_lightning.envs.runner import episode_results, token_masks
from dapo_lightning.prompts import PromptRecord, encode_prompt
from dapo_lightning.rewards.base import RewardResult
from dapo_lightning.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutEngine,
    SamplingConfig,
)
from dapo_lightning.rollout.hf import HFRolloutEngine, process_logits
from dapo_lightning.rollout.vllm import VLLMRolloutEngine


# ---------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("10-4-3", 3),  # left to right
        ("24/4/2", 3),
        ("-3*-2", 6),
        ("--3", 3),
        ("-(2+3)", -5),
        ("+4", 4),
        ("7/2", Fraction(7, 2)),
        (" 1.5 * 4 ", 6),
        (".5+.25", Fraction(3, 4)),
        ("2*(3+(4-1))/3", 4),
    ],
)
def test_calculator_precedence_and_unary_minus(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("5/(2-2)", "division by zero"),
        ("3+x", "unexpected character 'x'"),
        ("__import__('os')", "unexpected character '_'"),
        ("(1+2", "not closed"),
        ("1+", "ends too early"),
        ("1 2", "unexpected '2' after"),
        ("*3", "unexpected '*'"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than 200"),
        ("(" * 40 + "1" + ")" * 40, "nests deeper"),
    ],
)
def test_calculator_rejects_bad_expressions(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_calculator_environment_answers_tool_calls_and_errors():
    env = CalculatorEnvironment()
    env.reset(PromptRecord("u", "q", "12"))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    assert env.step("Let me compute. " + call) == StepResult(observation="12", tool_calls=1)
    assert env.step(call.replace("3*4", "8/3")).observation == "2.666666667"
    bad = env.step(call.replace("3*4", "1/0"))
    assert bad == StepResult(observation="error: division by zero", tool_calls=1, tool_errors=1)
    garbage = env.step(call.replace("3*4", "3+x") + call)
    assert garbage.observation == "error: unexpected character 'x'\n12"
    assert (garbage.tool_calls, garbage.tool_errors, garbage.done) == (2, 1, False)
    assert env.step("<tool_call>{not json}</tool_call>").observation.startswith(
        "error: the tool call is not valid JSON"
    )
    unknown = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert unknown.observation == "error: no tool named 'search' (tools: ['calculator'])"
    wrong_args = env.step('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>')
    assert wrong_args.observation == (
        "error: calculator() has no argument 'x' (arguments: ['expression'])"
    )
    assert wrong_args.tool_errors == 1
    assert env.step("Answer: 12") == StepResult(done=True)


def test_calculator_nudge_asks_once_for_a_call():
    env = CalculatorEnvironment(nudge="Use the calculator.")
    env.reset(PromptRecord("u", "q", "12"))
    assert env.step("12") == StepResult(observation="Use the calculator.")
    assert env.step("still 12") == StepResult(done=True)
    env = CalculatorEnvironment(nudge="Use the calculator.")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    assert env.step(call).observation == "12" and env.step("12").done


def test_parse_tool_calls_reads_the_tag_format():
    text = (
        'a <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> b '
        '<tool_call>{"name": "g"}</tool_call><tool_call>[1]</tool_call>'
        '<tool_call>{"name": "h", "arguments": 3}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("f", {"x": 1}), ToolCall("g", {})]
    assert all(isinstance(c, ToolCallError) for c in calls[2:]) and len(calls) == 4
    assert parse_tool_calls("no call <tool_call> unterminated") == []


def test_environment_config_and_registry_errors():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        EnvironmentConfig(max_turns=0)
    with pytest.raises(ValueError, match="call_timeout_s must be > 0"):
        EnvironmentConfig(call_timeout_s=0)
    with pytest.raises(ValueError, match="neither a built-in environment"):
        environment_factory(EnvironmentConfig(name="no_such_env"))
    with pytest.raises(ValueError, match="cannot be built with kwargs"):
        environment_factory(EnvironmentConfig(kwargs={"bogus": 1}))
    make = environment_factory(EnvironmentConfig(name="tests.test_envs.ScriptedEnv"))
    assert type(make()).__qualname__ == "ScriptedEnv" and make() is not make()


def test_instructions_become_a_system_message():
    records = [PromptRecord("a", "What is 2+2?", "4"), PromptRecord("b", [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "1")]  # fmt: skip
    with_instructions(records, "Use the tool.", use_chat_template=True)
    assert records[0].prompt == [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert records[1].prompt[0] == {"role": "system", "content": "S\n\nUse the tool."}
    plain = [PromptRecord("a", "Q", "1")]
    with_instructions(plain, "Use the tool.", use_chat_template=False)
    assert plain[0].prompt == "Use the tool.\n\nQ"


# ---------------------------------------------------------------------------- observations
def test_observation_tokens_continue_the_chat_template(tiny_checkpoint):
    """prompt + turn + EOS + observation tokens == the template's own rendering of the
    conversation with a tool message and the next generation prompt."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    fmt = ObservationFormatter(tok, "tool")
    assert fmt.text("12") == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    user = [{"role": "user", "content": "What is 3*4?"}]
    prompt = encode_prompt(tok, user, apply_chat_template=True)
    turn = tok("call", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = list(prompt) + turn + fmt("12")
    expected = tok.apply_chat_template(
        user + [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "12"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(ids) == expected
    assert ObservationFormatter(tok, use_chat_template=False).text("12") == (
        "\n<tool_response>12</tool_response>\n"
    )


# ---------------------------------------------------------------------------- the runner
class ScriptedEnv:
    """Answers every turn with ``observation`` until ``turns`` turns are done; then done, with
    ``reward`` (None: the reward function scores the text)."""

    def __init__(self, observation: str = "obs 7", turns: int = 2, reward: float | None = None):
        self.observation, self.turns, self.reward = observation, turns, reward
        self.seen = 0

    def reset(self, record: PromptRecord) -> None:
        self.record = record

    def step(self, text: str) -> StepResult:
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=self.reward)
        return StepResult(observation=self.observation, tool_calls=1)


class RaisingEnv(ScriptedEnv):
    def step(self, text: str) -> StepResult:
        raise RuntimeError("the tool server is down")


class HangingEnv(ScriptedEnv):
    def step(self, text: str) -> StepResult:
        time.sleep(3.0)
        return StepResult(done=True)


class GarbageEnv(ScriptedEnv):
    def step(self, text: str) -> StepResult:
        return {"observation": 12}  # type: ignore[return-value]


class EveryOther:
    """Fails (raises) in every other episode: the runner counts, it does not crash."""

    count = 0

    def __init__(self) -> None:
        EveryOther.count += 1
        self.bad = EveryOther.count % 2 == 0

    def reset(self, record: PromptRecord) -> None:
        if self.bad:
            raise ValueError("bad episode")

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    prompts = []
    for i, q in enumerate(["What is 3*4?", "Compute 7+8."]):
        r = PromptRecord(f"p{i}", q, "12")
        r.prompt_ids = encode_prompt(tok, q, apply_chat_template=True)
        prompts.append(r)
    return tok, model, prompts


#: Stop ids of the test engine: the EOS and a third of the byte tokens, so the random tiny
#: model ends turns after a few tokens ("stop") and episodes really take several turns.
STOP_IDS = [1, *range(100, 190)]


def make_runner(tiny, make_env, seed=0, **config):
    tok, model, records = tiny
    cfg = EnvironmentConfig(**{"max_turns": 3, "call_timeout_s": 2.0, **config})
    return EpisodeRunner(
        HFRolloutEngine(model, tok, seed=seed, eos_token_id=STOP_IDS),
        cfg,
        make_env=make_env,
        formatter=ObservationFormatter(tok, cfg.observation_role),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        records=records,
        max_episode_tokens=cfg.max_episode_tokens or 400,
    )


def test_episodes_interleave_turns_and_observations(tiny):
    """Token ids are turn, observation, turn, ...; the mask is 1 exactly on the sampled turns;
    the engine's log-probs on them are the model's own (one forward over the whole episode
    at the sampling temperature), 0 on observations; text is the last turn."""
    tok, model, records = tiny
    runner = make_runner(tiny, lambda: ScriptedEnv(turns=3))
    sampling = SamplingConfig(max_tokens=60, temperature=1.0)
    groups = runner.generate([r.prompt_ids for r in records], 2, sampling)
    obs = ObservationFormatter(tok)("obs 7")
    for record, group in zip(records, groups):
        assert len(group) == 2
        for ep in group:
            ids, mask = ep.token_ids, ep.loss_mask
            assert len(ids) == len(mask) == len(ep.log_probs)
            # split into runs of equal mask: sampled, observation, sampled, ...
            runs, start = [], 0
            for t in range(1, len(ids) + 1):
                if t == len(ids) or mask[t] != mask[start]:
                    runs.append((mask[start], ids[start:t]))
                    start = t
            sampled_runs = [r for m, r in runs if m == 1]
            for m, run in runs:
                if m == 0:
                    assert run == obs
            assert all(run[-1] in STOP_IDS for run in sampled_runs[:-1])
            assert ep.turns == len(sampled_runs) <= 3
            assert sum(mask) <= sampling.max_tokens
            assert all(lp == 0.0 for lp, m in zip(ep.log_probs, mask) if m == 0)
            assert ep.text == tok.decode(sampled_runs[-1], skip_special_tokens=True)
            with torch.no_grad():
                seq = torch.tensor([record.prompt_ids + ids])
                logits = model(input_ids=seq).logits[0, len(record.prompt_ids) - 1 : -1]
            logp = process_logits(logits, 1.0, -1, 1.0).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            keep = torch.tensor(mask, dtype=torch.bool)
            engine = torch.tensor(ep.log_probs)
            assert torch.allclose(logp[keep], engine[keep], atol=1e-4)
    stats = runner.take_stats()
    eps = [e for g in groups for e in g]
    assert [e.turns for e in eps] == [3, 3, 3, 3]  # stopped turns: the environment decided
    assert stats["env/turns_mean"] == pytest.approx(sum(e.turns for e in eps) / 4)
    # a call on each of the 2 turns the environment answered; every episode called
    assert stats["env/tool_calls_mean"] == 2.0 and stats["env/tool_use_frac"] == 1.0
    assert stats["env/failures"] == 0 and stats["env/timeouts"] == 0
    lengths = [len(records[i // 2].prompt_ids) + len(e.token_ids) for i, e in enumerate(eps)]
    assert stats["env/episode_tokens_mean"] == pytest.approx(sum(lengths) / 4)
    assert runner.take_stats()["env/turns_mean"] == 0  # a fresh count


def test_budgets_end_episodes_as_length(tiny):
    """sampling.max_tokens bounds the assistant tokens, max_episode_tokens prompt + all."""
    _, _, records = tiny
    runner = make_runner(tiny, lambda: ScriptedEnv(turns=99), max_turns=8)
    eps = runner.generate([r.prompt_ids for r in records], 3, SamplingConfig(max_tokens=5))[0]
    for ep in eps:
        assert sum(ep.loss_mask) <= 5
        if sum(ep.loss_mask) == 5:
            assert ep.finish_reason == "length"
    small = make_runner(tiny, lambda: ScriptedEnv(turns=99), max_turns=8, max_episode_tokens=60)
    for group in small.generate([r.prompt_ids for r in records], 3, SamplingConfig(max_tokens=200)):
        for ep in group:
            assert ep.finish_reason == "length" and ep.episode_tokens <= 60


@pytest.mark.parametrize(
    ("env", "failure"),
    [
        (RaisingEnv, "RuntimeError: the tool server is down"),
        (HangingEnv, "timeout"),
        (GarbageEnv, "TypeError: step() returned dict, not a StepResult."),
    ],
)
def test_environment_faults_fail_episodes_not_the_run(tiny, env, failure):
    _, _, records = tiny
    runner = make_runner(tiny, env, call_timeout_s=0.3, max_failure_frac=1.0)
    groups = runner.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=40))
    eps = [e for g in groups for e in g]
    assert all(e.failure == failure and e.turns == 1 for e in eps)
    stats = runner.take_stats()
    assert stats["env/failures"] == 4 and stats["env/timeouts"] == (4 if env is HangingEnv else 0)
    # the producer's scoring: a failed episode scores the reward's failure score, acc False
    results = episode_results(
        eps, [RewardResult(1.0, True)] * 4, reward=type("R", (), {"failure_score": -1.0})()
    )
    assert [(r.score, r.acc) for r in results] == [(-1.0, False)] * 4
    assert results[0].extra["reward_failure"] == f"environment: {failure}"
    strict = make_runner(tiny, env, call_timeout_s=0.3, max_failure_frac=0.5)
    with pytest.raises(EnvironmentFailureError, match="4 of 4 episodes failed"):
        strict.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=40))


def test_some_failures_under_the_limit_are_counted(tiny):
    _, _, records = tiny
    EveryOther.count = 0
    runner = make_runner(tiny, EveryOther, max_failure_frac=0.5)
    eps = [
        e
        for g in runner.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=4))
        for e in g
    ]
    assert sum(e.failure is not None for e in eps) == 2
    assert all(e.token_ids == [] for e in eps if e.failure is not None)
    assert runner.take_stats()["env/failures"] == 2


def test_environment_reward_replaces_the_reward_function(tiny):
    _, _, records = tiny
    runner = make_runner(tiny, lambda: ScriptedEnv(turns=1, reward=0.25))
    eps = runner.generate([records[0].prompt_ids], 2, SamplingConfig(max_tokens=4))[0]
    results = episode_results(eps, [RewardResult(-1.0, False, {"has_answer": True})] * 2, None)
    assert [(r.score, r.acc, r.extra["has_answer"]) for r in results] == [(0.25, True, True)] * 2
    plain = [Completion([5], [-0.1], "stop")]
    assert episode_results(plain, [RewardResult(-1.0, False)], None)[0].score == -1.0


def test_unknown_prompts_and_context_are_refused(tiny):
    tok, model, records = tiny
    runner = make_runner(tiny, ScriptedEnv)
    with pytest.raises(ValueError, match="not one of its records"):
        runner.generate([[5, 6, 7]], 1, SamplingConfig(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds the engine's context"):
        make_runner(tiny, ScriptedEnv, max_episode_tokens=10_000)
    # the producer streams groups from an engine that declares streaming (vLLM): never past
    # the episode runner, which only delegates what the session and module read
    runner.engine.stream_groups = lambda *a, **k: iter(())
    assert not hasattr(runner, "stream_groups")
    streaming = EngineCapabilities(streaming=True, tensor_parallel=True, sleep=True)
    runner.engine.capabilities = streaming  # what a vLLM engine declares (but adapters)
    assert runner.capabilities == EngineCapabilities(tensor_parallel=True, sleep=True)
    assert runner.model is model and runner.state_dict()["seed"] == runner.engine.seed


class RecordingEngine(RolloutEngine):
    """An engine with every optional part, recording what reaches it; a 300-token context."""

    capabilities = EngineCapabilities(tensor_parallel=True, sleep=True, adapters=True)
    model = "the policy"
    sleep_mode = True
    lora_enabled = True
    max_context_tokens = 300

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, prompts, n, sampling):
        return [[Completion([1], [0.0], "stop")] * n for _ in prompts]

    def load_weights(self, named_tensors):
        self.calls.append(("load_weights", [name for name, _ in named_tensors]))

    def load_adapter(self, named_tensors, peft_config):
        self.calls.append(("load_adapter", [name for name, _ in named_tensors], peft_config))

    def wake_up(self):
        self.calls.append(("wake_up",))
        return True

    def sleep(self):
        self.calls.append(("sleep",))
        return False

    def state_dict(self):
        return {"rng": 7}

    def load_state_dict(self, state):
        self.calls.append(("load_state_dict", state))


def test_the_episode_runner_is_a_rollout_engine_of_the_wrapped_engines_parts(tiny):
    """EpisodeRunner is a RolloutEngine: its context, the policy it samples with, sleep mode,
    adapters, RNG state and weights are the wrapped engine's (each call reaches it), its
    capabilities the wrapped engine's without streaming; nothing else is passed through."""
    tok, model, records = tiny
    hf = make_runner(tiny, ScriptedEnv)
    assert isinstance(hf, RolloutEngine) and isinstance(hf.engine, HFRolloutEngine)
    assert hf.max_context_tokens == model.config.max_position_embeddings == 512
    inner = RecordingEngine()
    runner = EpisodeRunner(
        inner, EnvironmentConfig(max_turns=2), make_env=ScriptedEnv,
        formatter=ObservationFormatter(tok), decode=tok.decode, records=records,
        max_episode_tokens=200,
    )  # fmt: skip
    assert runner.capabilities == RecordingEngine.capabilities
    assert (runner.model, runner.sleep_mode, runner.lora_enabled) == ("the policy", True, True)
    assert runner.max_context_tokens == 300 and runner.state_dict() == {"rng": 7}
    weights = [("w", torch.zeros(1))]
    runner.load_weights(iter(weights))
    runner.load_adapter(iter(weights), "peft config")
    assert runner.wake_up() is True and runner.sleep() is False
    runner.load_state_dict({"rng": 8})
    assert inner.calls == [
        ("load_weights", ["w"]), ("load_adapter", ["w"], "peft config"), ("wake_up",),
        ("sleep",), ("load_state_dict", {"rng": 8}),
    ]  # fmt: skip
    for name in ("llm", "seed", "owns_model", "stream_groups", "tie_word_embeddings"):
        assert not hasattr(runner, name), name
    replay = ReplayEngine(tok, {})
    assert isinstance(replay, RolloutEngine) and replay.max_context_tokens is None


def test_the_episode_budget_is_fitted_to_the_engines_context(tiny, caplog):
    """The default budget is lowered to the context (a warning), a set one over it refused
    naming both, an unknown context (None) limits nothing; vLLM's context is its model
    config's max_model_len."""
    default, given = EnvironmentConfig(max_turns=3), EnvironmentConfig(max_episode_tokens=400)
    with caplog.at_level("WARNING"):
        assert default.within_context(400, 300) == 300
    assert "default budget for 3 turns (400 tokens) is over the engine's context" in caplog.text
    assert given.within_context(300, 300) == 300
    assert given.within_context(10_000, None) == 10_000
    with pytest.raises(ValueError, match=r"max_episode_tokens=400 exceeds the engine's context "
                       r"\(300 tokens\)"):  # fmt: skip
        given.within_context(400, 300)
    tok, _, records = tiny
    with pytest.raises(ValueError, match=r"\(300 tokens\)"):
        EpisodeRunner(
            RecordingEngine(), given, make_env=ScriptedEnv, formatter=ObservationFormatter(tok),
            decode=tok.decode, records=records, max_episode_tokens=400,
        )  # fmt: skip
    vllm = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # no vLLM here: its model config only
    config = type("ModelConfig", (), {"max_model_len": 1234})()
    vllm.llm = type("LLM", (), {"llm_engine": type("Engine", (), {"model_config": config})()})()
    assert vllm.max_context_tokens == 1234


class CountingEnv(ScriptedEnv):
    """ScriptedEnv that reports its own metric: 1 per turn, 10 on the turn that ends."""

    metric_names = ("turn_marks",)

    def step(self, text: str) -> StepResult:
        result = super().step(text)
        result.metrics = {"turn_marks": 10.0 if result.done else 1.0}
        return result


class UndeclaredMetricEnv(ScriptedEnv):
    def step(self, text: str) -> StepResult:
        return StepResult(done=True, metrics={"secret": 1.0})


def test_environments_log_their_own_declared_metrics(tiny):
    """env/<name> = the metric summed over each episode's turns, / episodes; zeros before any
    episode (every rank logs the same names); an undeclared name fails its episode, named."""
    _, _, records = tiny
    runner = make_runner(tiny, lambda: CountingEnv(turns=3), max_turns=3)
    assert runner.take_stats()["env/turn_marks"] == 0.0
    groups = runner.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=60))
    eps = [e for g in groups for e in g]
    # per episode: 1 for each turn that got an observation, 10 for the last (done) turn
    expected = [sum([1.0] * (e.turns - 1) + [10.0]) for e in eps]
    assert [e.metrics["turn_marks"] for e in eps] == expected
    stats = runner.take_stats()
    assert stats["env/turn_marks"] == pytest.approx(sum(expected) / len(eps))
    bad = make_runner(tiny, UndeclaredMetricEnv, max_failure_frac=1.0)
    (ep, *_), *_ = bad.generate([records[0].prompt_ids], 2, SamplingConfig(max_tokens=8))
    assert "'secret', which the environment does not declare" in ep.failure


def test_the_default_episode_budget_fits_the_turns_and_says_when_it_cuts(tiny, caplog):
    """null max_episode_tokens = prompt + max_tokens + (max_turns - 1) x max_observation_tokens,
    lowered to the engine's context with a warning; an observation that does not fit ends its
    episode, counted in env/observations_cut, with one warning naming the numbers."""
    config = EnvironmentConfig(max_turns=4, max_observation_tokens=50)
    assert config.episode_budget(32, 20) == 32 + 20 + 3 * 50
    assert EnvironmentConfig(max_episode_tokens=99).episode_budget(32, 20) == 99
    tok, model, records = tiny
    context = model.config.max_position_embeddings
    with caplog.at_level("WARNING"):
        wide = EpisodeRunner(
            HFRolloutEngine(model, tok, seed=0, eos_token_id=STOP_IDS),
            EnvironmentConfig(max_turns=3),
            make_env=ScriptedEnv, formatter=ObservationFormatter(tok),
            decode=lambda ids: tok.decode(ids), records=records,
            max_episode_tokens=context + 500,
        )  # fmt: skip
    assert wide.max_episode_tokens == context
    assert "default budget for 3 turns" in caplog.text
    long_obs = "x " * 200  # far more tokens than the room left
    runner = make_runner(tiny, lambda: ScriptedEnv(observation=long_obs, turns=5))
    runner.max_episode_tokens = 80
    with caplog.at_level("WARNING"):
        groups = runner.generate([r.prompt_ids for r in records], 2, SamplingConfig(max_tokens=8))
    assert all(e.finish_reason == "length" for g in groups for e in g)
    assert runner.take_stats()["env/observations_cut"] == 4
    assert caplog.text.count("did not fit") == 1 and "max_episode_tokens=80" in caplog.text


# ---------------------------------------------------------------------------- the batch
def test_token_masks_reach_the_response_mask(tiny):
    """ScoredRollouts.token_mask: response_length counts sampled tokens only; the batch's
    response_mask is loss_mask AND token mask; select / concat / state_dict keep it."""
    _, _, records = tiny
    runner = make_runner(tiny, lambda: ScriptedEnv(turns=2))
    eps = runner.generate([records[0].prompt_ids], 2, SamplingConfig(max_tokens=12))[0]
    masks = token_masks(eps)
    assert masks == [e.loss_mask for e in eps]
    assert token_masks([Completion([1, 2], [0.0, 0.0], "stop")]) is None
    from dapo_lightning.batch import ScoredRollouts

    rollouts = ScoredRollouts(
        prompt_ids=[records[0].prompt_ids] * 2,
        response_ids=[e.token_ids for e in eps],
        rollout_log_probs=[e.log_probs for e in eps],
        finish_reason=[e.finish_reason for e in eps],
        group_index=torch.zeros(2, dtype=torch.long),
        prompt_uid=["p0", "p0"],
        score=torch.tensor([1.0, -1.0]),
        acc=torch.tensor([1.0, 0.0]),
        sampling=SamplingConfig(max_tokens=12),
        token_mask=masks,
    )
    assert rollouts.response_length.tolist() == [sum(m) for m in masks]
    rollouts.loss_mask[1] = False
    batch = RolloutBatch.from_rollouts(rollouts, group_size=2, pad_token_id=0)
    for i, m in enumerate(masks):
        expect = torch.zeros(batch.response_width)
        expect[: len(m)] = torch.tensor(m, dtype=torch.float32) * float(i == 0)
        assert torch.equal(batch.response_mask[i], expect)
        assert int(batch.attention_mask[i, batch.prompt_width :].sum()) == len(m)
    again = ScoredRollouts.from_state_dict(rollouts.state_dict())
    assert again.token_mask == masks
    assert rollouts.select([1]).token_mask == [masks[1]]
    single = ScoredRollouts(
        prompt_ids=[[3]], response_ids=[[4, 5]], rollout_log_probs=[[0.0, 0.0]],
        finish_reason=["stop"], group_index=torch.zeros(1, dtype=torch.long), prompt_uid=["x"],
        score=torch.zeros(1), acc=torch.zeros(1), sampling=SamplingConfig(max_tokens=12),
    )  # fmt: skip
    both = concat_rollouts([rollouts, single])
    assert both.token_mask == masks + [[1, 1]]
    assert concat_rollouts([single, single]).token_mask is None


def _readme_blocks() -> tuple[str, str]:
    """The own-environment example (moved from the README to docs/environments.md): the
    ``# my_envs.py`` block and the YAML after it."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "environments.md").read_text()
    section = text[text.index("## Multi-turn episodes and tools") :]
    code = section[section.index("```python\n# my_envs.py") + len("```python\n") :]
    code = code[: code.index("```")]
    yml = section[section.index("```yaml\n") + len("```yaml\n") :]
    return code, yml[: yml.index("```")]


def test_readme_environment_example_runs(tiny, tmp_path, monkeypatch):
    """The README's example, written to my_envs.py, built from its YAML by class path and run
    on the real HF engine: it rewards itself, retries with its hint, stops after 3 tries."""
    code, yml = _readme_blocks()
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    env_cfg = yaml.safe_load(yml)["data"]["init_args"]["environment"]
    config = EnvironmentConfig(**env_cfg)
    assert config.name == "my_envs.RetryUntilRight" and config.max_turns == 3
    make = environment_factory(config)
    env = make()
    env.reset(PromptRecord("u", "q", "12"))
    assert env.step("It is 11") == StepResult(observation="Not quite. Try again.")
    assert env.step("It is 12") == StepResult(done=True, reward=1.0)
    runner = make_runner(tiny, make, max_turns=3, max_episode_tokens=400)
    _, _, records = tiny
    eps = runner.generate([records[0].prompt_ids], 2, SamplingConfig(max_tokens=40))[0]
    for ep in eps:  # the random model never writes 12: three tries, reward -1, two hints
        assert ep.turns == 3 and ep.env_reward == -1.0 and ep.failure is None
        hints = len(ep.loss_mask) - sum(ep.loss_mask)
        tok = tiny[0]
        assert hints == 2 * len(ObservationFormatter(tok)("Not quite. Try again."))


def test_env_stats_are_the_counts_per_episode():
    """env/tool_use_frac is the share of episodes with a call (issue 39's "calls in 80% of
    episodes"), beside calls per episode."""
    from dapo_lightning.envs.stats import env_stats

    totals = {
        "episodes": 4,
        "turns": 7,
        "tool_calls": 5,
        "tool_errors": 1,
        "calling": 3,
        "tokens": 100,
    }
    stats = env_stats(totals)
    assert stats["env/tool_use_frac"] == 0.75 and stats["env/tool_calls_mean"] == 1.25
    assert stats["env/turns_mean"] == 1.75 and stats["env/tool_error_rate"] == 0.2
    assert env_stats(None)["env/tool_use_frac"] == 0.0
