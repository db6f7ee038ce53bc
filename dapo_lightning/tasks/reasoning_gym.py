"""The built-in reasoning-gym task: procedural problems from the ``reasoning-gym`` package
(``pip install 'dapo-lightning[tasks]'``), scored by each dataset's own ``score_answer``.

reasoning-gym generates ~100 task families (``basic_arithmetic``, ``chain_sum``,
``gsm_symbolic``, ``countdown``, ...) from a seed, each with a config dataclass (difficulty:
number of terms, digits, operators, ...) and a scorer ``score_answer(answer, entry)`` that
returns a value in [0, 1]. This module turns them into rows for :class:`DAPODataModule`::

    data:
      init_args:
        prompts:
          task: reasoning_gym
          task_kwargs:
            dataset: basic_arithmetic              # or datasets: [{name, weight, config}, ...]
            config: {min_terms: 2, max_terms: 2, max_digits: 1, operators: ["+", "-"]}
            size: 256                              # training problems
            val_size: 64                           # held-out problems (another seed)

Rows are::

    {"prompt": [{"role": "user", "content": "Calculate 5 - 3.\\n<instruction>"}],
     "answer": "2", "uid": "rg-basic_arithmetic-0-0", "split": "train",
     "reward_kwargs": {"rg_entry": {"dataset": ..., "config": ..., "question": ...,
                                    "answer": "2", "metadata": {...}}}}

* ``answer`` is the dataset's answer string. What the scorer needs beyond it (the entry's
  metadata, the dataset name and config) travels in ``reward_kwargs``: the data module passes
  each row's ``reward_kwargs`` to the reward with that row's responses, so the reward
  (:class:`ReasoningGymReward`, reward name ``"reasoning_gym"``) rebuilds the scorer from the row
  alone, in the reward worker processes (with their per-sample timeout) as well as in process.
* **Held-out problems** (``split: "val"``) come from ``val_seed`` (default ``seed + 1_000_003``;
  reasoning-gym draws problem ``i`` of seed ``s`` from ``Random(s + i)``, so a nearby seed would
  repeat the training problems shifted by one) and never equal a training problem: questions
  are de-duplicated within and across the splits.
* **Answer format**: the prompt ends with ``instruction`` (default :data:`INSTRUCTION`: the DAPO
  "Answer:" line); the reward extracts the answer with ``answer_format``
  (:data:`EXTRACTORS`): ``"answer_line"`` (default) takes the text after the last ``Answer:``
  (:func:`dapo_lightning.rewards.dapo.extract_answer_line`), stripped of spaces and one trailing
  period; ``"answer_tag"`` the text inside the last ``<answer>...</answer>`` (reasoning-gym's own
  convention); ``"boxed"`` the last ``\\boxed{...}``; ``"last_number"`` the last number
  written anywhere in the response (``"5 - 3 = 2."`` -> ``"2"``; it also reads an ``Answer:``
  line that ends with the number). A response without one scores as the dataset scores
  ``None`` (0: wrong). SmolLM2-135M-Instruct hardly ever writes the ``Answer:`` line it is asked
  for ("The answer is: 2", "5 - 3 = 2."), so its recipe scores with ``"last_number"``.
* **Score**: ``wrong_score + (correct_score - wrong_score) * s`` with ``s`` the dataset's
  ``score_answer`` (+1 right, -1 wrong by default; partial credit in between where the dataset
  gives it), ``acc`` is ``s == 1``.

Bad ``dataset`` names or ``config`` fields fail when the data module is built (the message
lists the valid ones), not at the first generation.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dapo_lightning.rewards import register_reward
from dapo_lightning.rewards.dapo import extract_answer_line, extract_boxed
from dapo_lightning.rewards.results import RewardResult
from dapo_lightning.tasks.base import register_task
from dapo_lightning.tasks.word_problems import last_number_text

#: How to install the package this task needs.
INSTALL_HINT = "install it with: pip install 'dapo-lightning[tasks]' (or pip install reasoning-gym)"

#: Appended to every question (``instruction=`` replaces it): asks for the DAPO "Answer:" line
#: that the default extractor (``answer_format="answer_line"``) reads.
INSTRUCTION = "Give only the result, on one line, as: Answer: <number>"

#: The dataset and config when task_kwargs name none: one-digit sums and differences of two terms
#: (``configs/smollm2_reasoning_gym.yaml``'s setting, chosen by ``benchmarks/task_headroom.py``).
DEFAULT_DATASET = "basic_arithmetic"
DEFAULT_CONFIG: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "max_digits": 1,
    "operators": ["+", "-"],
}

#: Offset of the held-out seed from the training seed when ``val_seed`` is None.
VAL_SEED_OFFSET = 1_000_003

#: Draws per wanted problem before giving up on finding distinct questions.
MAX_DRAWS_PER_PROBLEM = 50

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer_line(response: str) -> str | None:
    line = extract_answer_line(response)
    if line is None:
        return None
    line = line.strip()
    return line[:-1].rstrip() if line.endswith(".") else line


def _answer_tag(response: str) -> str | None:
    found = _ANSWER_TAG_RE.findall(response)
    return found[-1].strip() if found else None


#: Answer extractors by ``answer_format`` name: response -> answer text, or None.
EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_line": _answer_line,
    "answer_tag": _answer_tag,
    "boxed": extract_boxed,
    "last_number": last_number_text,
}


@functools.cache
def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's ``{name: (dataset class, config class)}``, imported on first use (the
    package takes seconds to import, and it is an optional extra)."""
    try:
        importlib.import_module("reasoning_gym")
    except ImportError as err:
        raise ImportError(
            f"task='reasoning_gym' needs the reasoning-gym package: {INSTALL_HINT}."
        ) from err
    return importlib.import_module("reasoning_gym.factory").DATASETS


def dataset_names() -> list[str]:
    """The reasoning-gym datasets installed."""
    return sorted(_registry())


def _config_fields(name: str) -> list[str]:
    return [
        f.name for f in dataclasses.fields(_registry()[name][1]) if f.name not in ("seed", "size")
    ]


def build_dataset(name: str, config: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset(name, seed=seed, size=size, **config)`` with errors that
    name the valid datasets or config fields.

    Raises:
        ImportError: reasoning-gym is not installed.
        ValueError: An unknown dataset, an unknown config field, or a config its ``validate``
            rejects.
    """
    if name not in _registry():
        raise ValueError(
            f"reasoning_gym dataset={name!r} is not a reasoning-gym dataset: use one of "
            f"{', '.join(dataset_names())}."
        )
    if not isinstance(config, Mapping):
        raise ValueError(
            f"reasoning_gym config of {name!r} must be a mapping of fields, got "
            f"{type(config).__name__}."
        )
    fields = _config_fields(name)
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(
            f"reasoning_gym config of {name!r} has unknown field(s) {unknown}: its fields are "
            f"{', '.join(fields)}."
        )
    try:
        create = importlib.import_module("reasoning_gym").create_dataset
        return create(name, seed=seed, size=size, **dict(config))
    except (AssertionError, TypeError, ValueError) as err:
        raise ValueError(
            f"reasoning_gym config {dict(config)} of {name!r} is invalid: {err}"
        ) from err


def _parse_mix(
    dataset: str | None, config: Mapping[str, Any] | None, datasets: Sequence[Any] | None
) -> list[tuple[str, dict[str, Any], float]]:
    """``[(name, config, weight)]`` from either ``dataset`` + ``config`` or ``datasets``."""
    if dataset is not None and datasets is not None:
        raise ValueError(
            "reasoning_gym takes one of dataset (a name, with config) or datasets "
            "(a list of {name, weight, config}), not both."
        )
    if dataset is None and datasets is None:
        dataset, config = DEFAULT_DATASET, dict(DEFAULT_CONFIG) if config is None else config
    if dataset is not None:
        return [(dataset, dict(config or {}), 1.0)]
    if config is not None:
        raise ValueError("reasoning_gym: give each dataset's config inside datasets, not config.")
    if not datasets:
        raise ValueError("reasoning_gym datasets must list at least one {name, weight, config}.")
    mix = []
    for spec in datasets:
        if (
            not isinstance(spec, Mapping)
            or "name" not in spec
            or set(spec) - {"name", "weight", "config"}
        ):
            raise ValueError(
                f"reasoning_gym datasets entry {spec!r}: write {{name: NAME, weight: W, config: {{...}}}}."
            )
        weight = float(spec.get("weight", 1.0))
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"reasoning_gym weight of {spec['name']!r} must be > 0, got {weight}.")
        mix.append((str(spec["name"]), dict(spec.get("config") or {}), weight))
    names = [m[0] for m in mix]
    if len(set(names)) != len(names):
        raise ValueError(f"reasoning_gym datasets lists a name twice: {names}.")
    return mix


def split_counts(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder: counts ``n_k`` with
    ``sum n_k = total`` and ``|n_k - total * w_k / sum w| < 1``."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda k: counts[k] - exact[k])
    for k in order[: total - sum(counts)]:
        counts[k] += 1
    return counts


def _draw(
    name: str, config: dict[str, Any], *, seed: int, count: int, seen: set[str]
) -> list[dict[str, Any]]:
    """``count`` entries of one dataset whose questions are not in ``seen`` (added to it)."""
    budget = max(1, count) * MAX_DRAWS_PER_PROBLEM
    data = build_dataset(name, config, seed=seed, size=budget)
    out = []
    for index in range(budget):
        if len(out) == count:
            break
        entry = data[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        out.append({"index": index, **entry})
    if len(out) < count:
        raise ValueError(
            f"reasoning_gym {name!r} with config {config} gave only {len(out)} distinct new "
            f"questions in {budget} draws (seed {seed}), {count} wanted: lower size / val_size or "
            "widen the config."
        )
    return out


def _row(
    name: str,
    config: dict[str, Any],
    seed: int,
    entry: dict[str, Any],
    split: str,
    instruction: str,
) -> dict[str, Any]:
    content = f"{entry['question']}\n{instruction}".strip()
    return {
        "prompt": [{"role": "user", "content": content}],
        "answer": str(entry["answer"]),
        "uid": f"rg-{name}-{seed}-{entry['index']}",
        "split": split,
        "reward_kwargs": {
            "rg_entry": {
                "dataset": name,
                "config": config,
                "question": entry["question"],
                "answer": entry["answer"],
                "metadata": entry.get("metadata", {}),
            }
        },
    }


def check_task_kwargs(**task_kwargs: Any) -> None:
    """Check ``task_kwargs`` without generating rows (unknown names raise ValueError at once)."""
    kwargs = {k: v for k, v in task_kwargs.items() if k != "seed"}
    known = {"dataset", "config", "datasets", "size", "val_size", "val_seed", "instruction"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"reasoning_gym task_kwargs has unknown key(s) {unknown}: use {sorted(known)}."
        )
    for name, config, _ in _parse_mix(
        kwargs.get("dataset"), kwargs.get("config"), kwargs.get("datasets")
    ):
        build_dataset(name, config, seed=0, size=1)
    for key in ("size", "val_size"):
        value = kwargs.get(key, 1)
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < (1 if key == "size" else 0)
        ):
            raise ValueError(
                f"reasoning_gym {key} must be an integer >= {1 if key == 'size' else 0}, got {value!r}."
            )


@register_task(
    "reasoning_gym",
    reward="reasoning_gym",
    description="reasoning-gym datasets or a weighted mix (tasks extra); their own scorer",
    check=check_task_kwargs,
)
def make_reasoning_gym_rows(
    *,
    seed: int = 0,
    dataset: str | None = None,
    config: Mapping[str, Any] | None = None,
    datasets: Sequence[Mapping[str, Any]] | None = None,
    size: int = 256,
    val_size: int = 64,
    val_seed: int | None = None,
    instruction: str = INSTRUCTION,
) -> list[dict[str, Any]]:
    """Training rows then held-out rows of one reasoning-gym dataset or a weighted mix.

    Args:
        seed: The training problems' seed (same seed, same problems in the same order).
        dataset: A reasoning-gym dataset name (:func:`dataset_names`); with ``config``. With
            neither ``dataset`` nor ``datasets``: :data:`DEFAULT_DATASET` (with
            :data:`DEFAULT_CONFIG` unless ``config`` is given).
        config: That dataset's config fields (e.g. ``{"max_terms": 2}``); seed and size are set
            here.
        datasets: Instead of ``dataset``: ``[{"name", "weight", "config"}]``; each split is
            divided among them in proportion to the weights (largest remainder).
        size: Training problems (distinct questions).
        val_size: Held-out problems (``split: "val"``), distinct from each other and from every
            training question; 0: none.
        val_seed: Their seed; None: ``seed + VAL_SEED_OFFSET``.
        instruction: Appended to each question (the answer format, see the module docstring).

    Returns:
        Rows as the module docstring shows: ``size`` with ``split`` "train", then ``val_size``
        with ``split`` "val".

    Raises:
        ImportError: reasoning-gym is not installed.
        ValueError: Unknown dataset or config names (the message lists the valid ones), or
            fewer distinct questions than asked for.

    Example::

        rows = make_reasoning_gym_rows(seed=0, dataset="chain_sum", config={"max_terms": 2},
                                       size=8, val_size=4)
    """
    check_task_kwargs(
        dataset=dataset, config=config, datasets=datasets, size=size, val_size=val_size
    )
    mix = _parse_mix(dataset, config, datasets)
    val_seed = seed + VAL_SEED_OFFSET if val_seed is None else int(val_seed)
    seen: dict[str, set[str]] = {name: set() for name, *_ in mix}
    rows: list[dict[str, Any]] = []
    for split, split_seed, total in (("train", seed, size), ("val", val_seed, val_size)):
        rows.extend(_split_rows(mix, split, split_seed, total, instruction, seen))
    return rows


def _split_rows(
    mix: list[tuple[str, dict[str, Any], float]],
    split: str,
    split_seed: int,
    total: int,
    instruction: str,
    seen: dict[str, set[str]],
) -> list[dict[str, Any]]:
    """``total`` rows of one split: each dataset of ``mix`` draws its share
    (:func:`split_counts` of the weights) of questions not in ``seen[name]`` (which grows), and
    the shares are interleaved in proportion: row ``i`` of ``n_k`` at position ``(i + 0.5) / n_k``.
    """
    weights = [w for *_, w in mix]
    parts = [
        [
            _row(name, cfg, split_seed, e, split, instruction)
            for e in _draw(name, cfg, seed=split_seed, count=n, seen=seen[name])
        ]
        for (name, cfg, _), n in zip(mix, split_counts(total, weights))
    ]
    spread = [((i + 0.5) / len(p), k, row) for k, p in enumerate(parts) for i, row in enumerate(p)]
    return [row for *_, row in sorted(spread, key=lambda t: t[:2])]


@register_reward("reasoning_gym")
class ReasoningGymReward:
    """The reasoning-gym dataset's own ``score_answer`` on the extracted answer (reward name
    ``"reasoning_gym"``; see the module docstring for the extraction and the score).

    Each response's row carries its entry (``rg_entry``: dataset, config, question, answer,
    metadata); the scorer is rebuilt from it (one dataset object per name and config, cached),
    so the reward pickles into the reward workers without any dataset in it.

    Args:
        answer_format: A key of :data:`EXTRACTORS`.
        correct_score: Score of ``score_answer == 1``.
        wrong_score: Score of ``score_answer == 0`` (and of a failed scoring).

    Example::

        entry = rows[0]["reward_kwargs"]["rg_entry"]
        ReasoningGymReward()(["Answer: 2"], ["2"], rg_entry=[entry])[0].acc  # True
    """

    def __init__(
        self,
        answer_format: str = "answer_line",
        correct_score: float = 1.0,
        wrong_score: float = -1.0,
    ) -> None:
        if answer_format not in EXTRACTORS:
            raise ValueError(
                f"reasoning_gym answer_format={answer_format!r}: use one of {sorted(EXTRACTORS)}."
            )
        if not (math.isfinite(correct_score) and math.isfinite(wrong_score)):
            raise ValueError("reasoning_gym correct_score and wrong_score must be finite.")
        self.answer_format = answer_format
        self.correct_score = float(correct_score)
        self.wrong_score = float(wrong_score)
        self.failure_score = self.wrong_score
        self._scorers: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_scorers": {}}

    def _scorer(self, entry: Mapping[str, Any]) -> Any:
        key = json.dumps([entry["dataset"], entry.get("config") or {}], sort_keys=True, default=str)
        if key not in self._scorers:
            self._scorers[key] = build_dataset(
                entry["dataset"], entry.get("config") or {}, seed=0, size=1
            )
        return self._scorers[key]

    def score_one(self, response: str, entry: Mapping[str, Any]) -> RewardResult:
        """Score one response against its row's entry."""
        answer = EXTRACTORS[self.answer_format](response)
        value = float(self._scorer(entry).score_answer(answer, dict(entry)))
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"reasoning_gym {entry['dataset']!r} score_answer gave {value}, not in [0, 1]."
            )
        return RewardResult(
            score=self.wrong_score + (self.correct_score - self.wrong_score) * value,
            acc=value == 1.0,
            extra={"has_answer": answer is not None, "rg_score": value},
        )

    def __call__(
        self, responses: list[str], ground_truths: list[str], **kw: Any
    ) -> list[RewardResult]:
        entries = kw.get("rg_entry")
        if entries is None or len(entries) != len(responses) or any(e is None for e in entries):
            raise ValueError(
                "reasoning_gym reward needs each response's rg_entry (the rows' reward_kwargs): "
                "use it with task='reasoning_gym'."
            )
        return [self.score_one(r, e) for r, e in zip(responses, entries)]
