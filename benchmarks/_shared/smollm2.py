"""The SmolLM2-135M-Instruct recipes: their config files, targets, model folder, the
reasoning-gym settings of the headroom scripts and the mean val/acc over a budget."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT

#: The recipes (``--recipe``), relative to the repository root.
RECIPES = {
    "word_problems": "configs/smollm2_135m.yaml",
    "reasoning_gym": "configs/smollm2_reasoning_gym.yaml",
    "tool_use": "configs/smollm2_tool_use.yaml",  # agent RL: products with the calculator
    "arithmetic": "configs/smollm2_arithmetic.yaml",  # agent RL: chained calls of binary tools
    "python_tool": "configs/smollm2_python_tool.yaml",  # agent RL: a sandboxed Python tool
    "code_functions": "configs/smollm2_code_functions.yaml",  # code scored by unit tests
}


#: Each recipe's target: ``("acc", x)`` held-out val/acc >= x, ``("gain", x)`` val/acc >= the
#: initial val/acc + x.
TARGETS = {
    "word_problems": ("acc", 0.8),
    "reasoning_gym": ("gain", 0.35),
    "tool_use": ("acc", 0.6),
    "arithmetic": ("acc", 0.6),
    "python_tool": ("acc", 0.8),
    "code_functions": ("gain", 0.1),
}


#: Where the shared model folder is written when ``--model-dir`` is not given.
DEFAULT_MODEL_DIR = REPO_ROOT / "runs" / "smollm2" / "model"


def process_cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ensure_model(model_dir: Path) -> Path:
    """The model folder, written with ``make-model smollm2-135m-instruct`` when missing."""
    if not (model_dir / "config.json").exists():
        from dapo_lightning.models import make_smollm2_folder

        print(f"writing SmolLM2-135M-Instruct into {model_dir} (not timed) ...", flush=True)
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        make_smollm2_folder(model_dir)
    return model_dir.resolve()


def mean_over_budget(curve: list[Any], budget_min: float, clock: str) -> float | None:
    """val/acc averaged over the training budget: the area under the curve of val/acc against
    minutes (wall or idle-equivalent, by ``clock``), linear between validations, cut at the
    budget, divided by the minutes covered (the budget, or less if the run ended sooner)::

        (1 / T) * integral_0^T acc(t) dt,  T = min(budget, last validation)

    Equal for two runs at every instant means equal; one run ahead of the other at every
    instant has the larger value (None: fewer than two validations)."""
    column = 2 if clock == "wall" else 3
    points = [(p[column] / 60, p[1]) for p in curve]
    if len(points) < 2:
        return None
    area, covered = 0.0, 0.0
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t0 >= budget_min or t1 <= t0:
            continue
        end = min(t1, budget_min)
        a_end = a0 + (a1 - a0) * (end - t0) / (t1 - t0)
        area += (a0 + a_end) / 2 * (end - t0)
        covered = end
    return area / covered if covered else None


#: Reasoning-gym settings measured with ``--rg``: name -> (dataset, config). One operation on
#: one-digit numbers first (each chained step multiplies a small model's slips).
RG_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ba_2x1_add": (
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]},
    ),
    "ba_2x1_addsub": (
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]},
    ),
    "ba_2x1_addsub_plain": (  # no parentheses or negative operands: "Calculate 7 - 3."
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "ba_2x1_mul": (
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["*"]},
    ),
    "chain_2x1": ("chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    "chain_3x1": ("chain_sum", {"min_terms": 3, "max_terms": 3, "max_digits": 1}),
    "chain_2x2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    # issue 39's tool-needing task: "Solve the following multiplication: 57 * 87."
    "products_2x2": (
        "products",
        {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    ),
    # the two-call task (binary tools: multiply, then multiply the result): "15 * 43 * 75."
    "products_3x2": (
        "products",
        {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2},
    ),
}
