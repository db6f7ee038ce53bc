"""What an untrained model does with a tool on a task that needs one: accuracy, pass@n and
tool-call rate per way of telling it about the tool, through the engine the recipes train with.

Issue 39's question before any RL: can the model do the task without the tool (it should not),
can the tool do it (perfect use: it should), and how often does the model call the tool when the
prompt tells it how? RL only reinforces calls the model already makes now and then.

On the first ``--prompts`` training problems of a reasoning-gym setting (``--setting``, one of
``task_headroom.RG_SETTINGS``; default ``products_2x2``: "Solve the following multiplication:
57 * 87.") it runs, per ``--variants``:

* ``no_tool``: single-turn responses to the task's prompt;
* ``tool``: episodes with the ``--env`` environment (``calculator``, or ``arithmetic``: binary
  tools), its instructions as the system message;
* ``nudge``: the same, a turn without a call is asked once to check with the calculator;
* ``demo``: the same, the prompt starting with one worked example as chat turns (a question,
  a tool call, its result, the answer: :meth:`ToolEnvironment.prompt_example`);
* ``perfect``: a scripted policy, the environment's own demonstrations
  (:meth:`CalculatorEnvironment.solution_turns`: a call on the question's expression, then its
  value; the arithmetic one's: a call per operation) replayed by :class:`~dapo_lightning.envs.replay.ReplayEngine`: the task's ceiling with the tool,
  through the same environment and scorer (one episode per problem: it is deterministic).

and prints accuracy (mean over ``--n`` samples), pass@n, the share of episodes with a tool call,
turns per episode and assistant tokens. Writes ``benchmarks/out/tool_headroom.json`` and
``.png``.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.tool_headroom            # ~3 min
    .venv/bin/python -m benchmarks.tool_headroom --variants tool demo --prompts 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from benchmarks._common import bar_chart, out_dir, print_table
from benchmarks._shared.smollm2 import DEFAULT_MODEL_DIR, RG_SETTINGS, ensure_model
from dapo_lightning.data.prompts.sources import (
    FieldMap,
    records_from_rows,
    tokenize_records,
)
from dapo_lightning.envs import EnvironmentConfig, environment_factory
from dapo_lightning.envs.replay import ReplayEngine
from dapo_lightning.envs.runner import EpisodeRunner, ObservationFormatter
from dapo_lightning.envs.session import introduce_tools
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.tasks.reasoning_gym import (
    ReasoningGymReward,
    make_reasoning_gym_rows,
)

VARIANTS = ("no_tool", "tool", "nudge", "demo", "perfect")
NUDGE = "Check it with the calculator first."


def problem_rows(
    setting: str, prompts: int, held_out: int = 0, seed: int = 0
) -> list[dict[str, Any]]:
    """The setting's first ``prompts`` training rows of ``seed`` (the recipes' split), or with
    ``held_out`` > 0 the held-out rows of a split of ``prompts`` training and ``held_out``
    held-out problems (a recipe's ``size`` and ``val_size``: the val/acc set of its run with
    ``seed_everything: seed``)."""
    dataset, config = RG_SETTINGS[setting]
    rows = make_reasoning_gym_rows(
        seed=seed, dataset=dataset, config=config, size=prompts, val_size=held_out
    )
    return [r for r in rows if r["split"] == "val"] if held_out else rows


def run_variant(
    variant: str, engine: Any, tokenizer: Any, rows: list[dict[str, Any]], args: Any
) -> dict[str, Any]:
    """One variant's row of the table (see the module docstring)."""
    records = records_from_rows([dict(r) for r in rows], FieldMap(answer_key="answer"))
    reward = ReasoningGymReward(answer_format=args.answer_format)
    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=args.temperature)
    runner: Any = engine
    if variant != "no_tool":
        kwargs = {"nudge": NUDGE} if variant == "nudge" else {}
        if variant == "demo":
            kwargs = {"example": True}
        if kwargs and args.env != "calculator":
            raise SystemExit(f"error: --variants {variant} is the calculator's (--env calculator)")
        config = EnvironmentConfig(
            name=args.env, kwargs=kwargs, max_turns=args.max_turns,
            max_episode_tokens=args.max_model_len,
        )  # fmt: skip
        make_env = environment_factory(config)
        tools = introduce_tools(records, make_env(), tokenizer, True)
        records, _ = tokenize_records(records, tokenizer, tools=tools)
        if variant == "perfect":  # the calculator's own demonstrations, replayed
            env = make_env()
            engine = ReplayEngine(
                tokenizer, {tuple(r.prompt_ids): env.solution_turns(r) for r in records}
            )
        runner = EpisodeRunner(
            engine, config, make_env=make_env, formatter=ObservationFormatter(tokenizer),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            records=records, max_episode_tokens=args.max_model_len,
        )  # fmt: skip
    else:
        records, _ = tokenize_records(records, tokenizer)
    t0 = time.perf_counter()
    n = 1 if variant == "perfect" else args.n  # a scripted policy: one episode says it all
    groups = runner.generate([r.prompt_ids for r in records], n, sampling)
    seconds = time.perf_counter() - t0
    acc, passed, called, turns, tokens = [], [], [], [], []
    for r, group in zip(records, groups):
        entry = r.meta["reward_kwargs"]["rg_entry"]
        texts = [c.text or tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        ok = [reward.score_one(text, entry).acc for text in texts]
        acc.extend(map(float, ok))
        passed.append(float(any(ok)))
        for c in group:
            called.append(float(getattr(c, "tool_calls", 0) > 0))
            turns.append(float(getattr(c, "turns", 1)))
            tokens.append(sum(c.loss_mask) if c.loss_mask else len(c.token_ids))
    example = groups[0][0]
    return {
        "variant": variant,
        "acc": round(fmean(acc), 3),
        f"pass@{args.n}": round(fmean(passed), 3),
        "tool-call rate": round(fmean(called), 3),
        "turns": round(fmean(turns), 2),
        "tokens": round(fmean(tokens), 1),
        "s": round(seconds, 1),
        "example": tokenizer.decode(example.token_ids, skip_special_tokens=False)[:300],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--setting", choices=sorted(RG_SETTINGS), default="products_2x2")
    parser.add_argument(
        "--env",
        choices=["calculator", "arithmetic"],
        default="calculator",
        help="the tool environment (arithmetic: binary add/subtract/multiply)",
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--prompts", type=int, default=32, help="problems")
    parser.add_argument(
        "--held-out", type=int, default=0,
        help="measure on the held-out problems of a split of --prompts training and this many "
        "held-out ones (the recipe's size and val_size: 160 and 64 gives its val/acc set)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the problems' seed (a run's seed)")
    parser.add_argument("--name", default="tool_headroom", help="output JSON/PNG name")
    parser.add_argument("--n", type=int, default=8, help="samples per problem (group size)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64, help="assistant tokens per episode")
    parser.add_argument("--max-turns", type=int, default=3, help="assistant turns per episode")
    parser.add_argument("--max-model-len", type=int, default=384, help="engine context")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: fits the device)")
    parser.add_argument("--answer-format", default="last_number", help="reasoning-gym extractor")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from dapo_lightning.rollout.vllm import VLLMRolloutEngine

    model_dir = ensure_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRolloutEngine(
        str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len,
        kv_cache_space_gb=2, seed=0,
    )  # fmt: skip
    rows = problem_rows(args.setting, args.prompts, args.held_out, args.seed)
    results = []
    for variant in args.variants:
        row = run_variant(variant, engine, tokenizer, rows, args)
        print(f"{variant}: {row}", flush=True)
        results.append(row)
    columns = [k for k in results[0] if k != "example"]
    print_table(
        f"{model_dir.name} on {args.setting} ({args.env}): {len(rows)} problems, {args.n} "
        f"samples at T={args.temperature}, {args.max_tokens} assistant tokens, "
        f"{args.max_turns} turns (dtype {engine.dtype})",
        columns, [[r[c] for c in columns] for r in results],
    )  # fmt: skip
    for r in results:
        print(f"{r['variant']} example: {r['example']!r}")
    (out_dir() / f"{args.name}.json").write_text(json.dumps({"args": vars(args) | {
        "model_dir": str(args.model_dir)}, "results": results}, indent=1))  # fmt: skip
    bar_chart(
        out_dir() / f"{args.name}.png",
        f"{model_dir.name} on {args.setting} ({args.env})",
        [r["variant"] for r in results],
        {k: [r[k] for r in results] for k in ("acc", f"pass@{args.n}", "tool-call rate")},
        ylabel="share",
    )
    return results


if __name__ == "__main__":
    main()
