"""What an untrained model can already do on a task: greedy accuracy, sampled accuracy and
pass@n, per template, through the vLLM engine the recipes train with.

RL on a small model mostly sharpens what it can already sample: when pass@n of the untrained
model is low, dynamic sampling finds few groups with any correct answer and the held-out
accuracy moves slowly. Measure this before tuning a recipe's hyper-parameters.

For each word-problem mix (``dapo_lightning.tasks.word_problems.MIXES``) it prints, on the
first ``--prompts`` problems of seed 0 (the recipe's training split starts there):

* greedy: accuracy of one temperature-0 response per problem;
* sampled: mean accuracy of ``--n`` responses per problem at ``--temperature`` (the recipe's
  rollout temperature, 1.0);
* pass@n: the fraction of problems with at least one correct sample among those ``n``; a group
  of ``n`` is kept by DAPO's filter only when some, not all, of its samples are right;
* tokens: mean response length.

Writes ``benchmarks/out/task_headroom.png`` (accuracy per template) and ``.json``.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/task_headroom.py          # SmolLM2, ~4 min
    .venv/bin/python benchmarks/task_headroom.py --mixes additive --prompts 64 --n 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bar_chart, out_dir, print_table  # noqa: E402
from smollm2_curve import DEFAULT_MODEL_DIR, ensure_model  # noqa: E402

from dapo_lightning.data.sources import encode_prompt  # noqa: E402
from dapo_lightning.rollout.base import SamplingConfig  # noqa: E402
from dapo_lightning.tasks.word_problems import (  # noqa: E402
    MIXES,
    LastNumberReward,
    make_word_problem_rows,
)


def score_mix(
    engine: Any, tokenizer: Any, mix: str, *, prompts: int, n: int, temperature: float
) -> list[dict[str, Any]]:
    """Rows (one per template, then ``"all"``) of greedy / sampled accuracy and pass@n."""
    rows = make_word_problem_rows(prompts, seed=0, templates=mix)
    ids = [encode_prompt(tokenizer, r["prompt"], apply_chat_template=True) for r in rows]
    reward = LastNumberReward()
    from vllm import SamplingParams  # greedy: below SamplingConfig, which is for RL sampling

    requests = [{"prompt_token_ids": p} for p in ids]
    greedy = engine.llm.generate(
        requests, SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False
    )
    t0 = time.perf_counter()
    sampled = engine.generate(ids, n, SamplingConfig(max_tokens=128, temperature=temperature))
    seconds = time.perf_counter() - t0
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row, g, group in zip(rows, greedy, sampled):
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        ok = [reward.score_one(text, row["answer"]).acc for text in texts]
        first = reward.score_one(g.outputs[0].text, row["answer"]).acc
        for key in (row["template"], "all"):
            per[key]["greedy"].append(float(first))
            per[key]["sampled"].extend(map(float, ok))
            per[key]["pass"].append(float(any(ok)))
            per[key]["tokens"].extend(len(c.token_ids) for c in group)
    return [
        {
            "mix": mix,
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
    parser.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    parser.add_argument("--prompts", type=int, default=128, help="problems per mix")
    parser.add_argument("--n", type=int, default=8, help="samples per problem (group size)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from dapo_lightning.rollout.vllm import VLLMRolloutEngine

    model_dir = ensure_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRolloutEngine(
        str(model_dir), dtype="bfloat16", max_model_len=224, kv_cache_space_gb=2, seed=0
    )
    results = [
        row
        for mix in args.mixes
        for row in score_mix(
            engine, tokenizer, mix, prompts=args.prompts, n=args.n, temperature=args.temperature
        )
    ]
    columns = list(results[0])
    print_table(
        f"untrained {model_dir.name}: accuracy per template (seed-0 problems, "
        f"{args.n} samples at T={args.temperature})",
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
