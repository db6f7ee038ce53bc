"""What an untrained model can already do on a task: greedy accuracy, sampled accuracy and
pass@n, per template, through the vLLM engine the recipes train with.

RL on a small model mostly sharpens what it can already sample: when pass@n of the untrained
model is low, dynamic sampling finds few groups with any correct answer and the held-out
accuracy moves slowly. Measure this before tuning a recipe's hyper-parameters.

For each word-problem mix (``dapo_lightning.tasks.word_problems.MIXES``, ``--mixes``) and each
reasoning-gym setting (:data:`RG_SETTINGS`, ``--rg``: a dataset and a difficulty config, the
prompts and scorer of ``task: reasoning_gym``) it prints, on the first ``--prompts`` problems of
seed 0 (the recipes' training split starts there):

* greedy: accuracy of one temperature-0 response per problem;
* sampled: mean accuracy of ``--n`` responses per problem at ``--temperature`` (the recipe's
  rollout temperature, 1.0);
* pass@n: the fraction of problems with at least one correct sample among those ``n``; a group
  of ``n`` is kept by DAPO's filter only when some, not all, of its samples are right;
* tokens: mean response length.

The engine runs in ``--dtype`` (default ``auto``: float32 on a CPU without bf16 hardware).
Writes ``benchmarks/out/task_headroom.png`` (accuracy per template) and ``.json``.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.task_headroom          # SmolLM2, ~4 min
    .venv/bin/python -m benchmarks.task_headroom --mixes additive --prompts 64 --n 16
    .venv/bin/python -m benchmarks.task_headroom --mixes --rg ba_2x1_addsub chain_2x1 \
        --prompts 32 --max-tokens 64       # reasoning-gym settings only
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Any

from benchmarks._common import bar_chart, out_dir, print_table
from benchmarks._shared.smollm2 import DEFAULT_MODEL_DIR, RG_SETTINGS, ensure_model
from dapo_lightning.prompts import encode_prompt
from dapo_lightning.rollout.base import SamplingConfig
from dapo_lightning.tasks.reasoning_gym import (
    ReasoningGymReward,
    make_reasoning_gym_rows,
)
from dapo_lightning.tasks.word_problems import (
    MIXES,
    LastNumberReward,
    make_word_problem_rows,
)


def word_problem_rows(mix: str, prompts: int) -> tuple[list[dict[str, Any]], Any]:
    """The mix's first ``prompts`` seed-0 problems and a ``(text, row) -> acc`` scorer."""
    reward = LastNumberReward()
    rows = make_word_problem_rows(prompts, seed=0, templates=mix)
    return rows, lambda text, row: reward.score_one(text, row["answer"]).acc


def reasoning_gym_rows(
    setting: str, prompts: int, answer_format: str = "last_number"
) -> tuple[list[dict[str, Any]], Any]:
    """The setting's first ``prompts`` seed-0 training problems (template: the setting's
    name) and their reasoning-gym scorer reading ``answer_format``."""
    dataset, config = RG_SETTINGS[setting]
    rows = make_reasoning_gym_rows(seed=0, dataset=dataset, config=config, size=prompts, val_size=0)
    for row in rows:
        row["template"] = setting
    reward = ReasoningGymReward(answer_format=answer_format)
    return rows, lambda text, row: reward.score_one(text, row["reward_kwargs"]["rg_entry"]).acc


def score_rows(
    engine: Any,
    tokenizer: Any,
    name: str,
    task: tuple[list[dict[str, Any]], Any],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """Rows (one per template, then ``"all"``) of greedy / sampled accuracy and pass@n of the
    problems and scorer ``task`` (``name``: the mix or setting)."""
    rows, judge = task
    ids = [encode_prompt(tokenizer, r["prompt"], apply_chat_template=True) for r in rows]
    from vllm import SamplingParams  # greedy: below SamplingConfig, which is for RL sampling

    requests = [{"prompt_token_ids": p} for p in ids]
    greedy = engine.llm.generate(
        requests, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    t0 = time.perf_counter()
    sampled = engine.generate(
        ids, n, SamplingConfig(max_tokens=max_tokens, temperature=temperature)
    )
    seconds = time.perf_counter() - t0
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row, g, group in zip(rows, greedy, sampled):
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        ok = [judge(text, row) for text in texts]
        first = judge(g.outputs[0].text, row)
        for key in (row["template"], "all"):
            per[key]["greedy"].append(float(first))
            per[key]["sampled"].extend(map(float, ok))
            per[key]["pass"].append(float(any(ok)))
            per[key]["tokens"].extend(len(c.token_ids) for c in group)
    return [
        {
            "mix": name,
            "template": key,
            "problems": len(v["greedy"]),
            "greedy": round(fmean(v["greedy"]), 3),
            "sampled": round(fmean(v["sampled"]), 3),
            f"pass@{n}": round(fmean(v["pass"]), 3),
            "tokens": round(fmean(v["tokens"]), 1),
            "sample s": round(seconds, 1) if key == "all" else "",
        }
        for key, v in sorted(per.items(), key=lambda kv: kv[0] == "all")  # "all" last
    ]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--mixes", nargs="*", choices=sorted(MIXES), default=list(MIXES))
    parser.add_argument("--rg", nargs="*", choices=sorted(RG_SETTINGS), default=[])
    parser.add_argument("--prompts", type=int, default=128, help="problems per mix / setting")
    parser.add_argument("--n", type=int, default=8, help="samples per problem (group size)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--max-tokens", type=int, default=128, help="response tokens")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: fits the device)")
    parser.add_argument(
        "--answer-format", default="last_number", help="reasoning-gym extractor (the recipe's)"
    )
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from dapo_lightning.rollout.vllm import VLLMRolloutEngine

    model_dir = ensure_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRolloutEngine(
        str(model_dir), dtype=args.dtype, max_model_len=224, kv_cache_space_gb=2, seed=0
    )
    tasks = {m: word_problem_rows(m, args.prompts) for m in args.mixes} | {
        s: reasoning_gym_rows(s, args.prompts, args.answer_format) for s in args.rg
    }
    kw = dict(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens)
    results = []
    for name, task in tasks.items():  # one line per mix / setting as it finishes
        rows = score_rows(engine, tokenizer, name, task, **kw)
        print(f"{name}: {rows[-1]}", flush=True)
        results.extend(rows)
    columns = list(results[0])
    print_table(
        f"untrained {model_dir.name}: accuracy per template (seed-0 problems, "
        f"{args.n} samples at T={args.temperature}, {args.max_tokens} tokens, "
        f"dtype {engine.dtype})",
        columns,
        [[r[c] for c in columns] for r in results],
    )
    bar_chart(
        out_dir() / "task_headroom.png",
        "untrained accuracy per template",
        [f"{r['mix']}/{r['template']}" for r in results],
        {k: [r[k] for r in results] for k in ("greedy", "sampled", f"pass@{args.n}")},
        ylabel="accuracy",
    )
    (out_dir() / "task_headroom.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
