#!/usr/bin/env python
r"""Record verl's ``math_dapo.compute_score`` on the DAPO reward corpus, as a test fixture.

``tests/test_rewards_dapo.py`` checks that :class:`dapo_lightning.rewards.DAPOAnswerReward`
gives the same score, acc and prediction as verl on every case of
``tests/data/dapo_reward_corpus.jsonl``; this script writes the reference side of that check,
``tests/data/verl_math_dapo_outputs.json``. The test reads the recorded file only, so neither it
nor CI needs verl.

verl is installed without its dependencies into a scratch virtual environment::

    python3.11 -m venv /tmp/verl-venv
    /tmp/verl-venv/bin/pip install --no-deps verl
    /tmp/verl-venv/bin/python scripts/record_verl_rewards.py

``import verl`` pulls in Ray, torch and tensordict (``verl/__init__.py`` imports
``verl.protocol``), but ``verl/utils/reward_score/math_dapo.py`` itself needs only the standard
library. So this script does not import the package: it finds the installed distribution with
``importlib.metadata`` and loads that one file by path (``importlib.util``), which is verl's
real code, unchanged. No other package is installed.

A corpus line is a JSON object with ``id``, ``category``, ``response``, ``ground_truth`` and,
optionally, ``strict_box_verify`` and ``pause_tokens_index`` (passed to ``compute_score`` as
keyword arguments when present; verl's defaults, ``False`` and ``None``, otherwise).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import platform
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "dapo_reward_corpus.jsonl"
OUT = ROOT / "tests" / "data" / "verl_math_dapo_outputs.json"
MODULE_PATH = "verl/utils/reward_score/math_dapo.py"
OPTION_KEYS = ("strict_box_verify", "pause_tokens_index")


def case_digest(case: dict[str, Any]) -> str:
    """SHA-256 of a case's inputs (the test uses it to catch a corpus edited after recording)."""
    inputs = {k: case[k] for k in ("response", "ground_truth", *OPTION_KEYS) if k in case}
    blob = json.dumps(inputs, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def load_math_dapo(module_file: str | None) -> tuple[ModuleType, str, Path]:
    """verl's math_dapo module, loaded from its file; with verl's version and the file path."""
    dist = importlib.metadata.distribution("verl")
    path = Path(module_file) if module_file else Path(str(dist.locate_file(MODULE_PATH)))
    if not path.is_file():
        raise SystemExit(f"{path} not found: install verl with `pip install --no-deps verl`.")
    spec = importlib.util.spec_from_file_location("verl_math_dapo", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, dist.version, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--module-file", help=f"path of {MODULE_PATH} (default: installed verl)")
    args = parser.parse_args(argv)

    math_dapo, version, path = load_math_dapo(args.module_file)
    signature = str(inspect.signature(math_dapo.compute_score))
    params = inspect.signature(math_dapo.compute_score).parameters
    for key in OPTION_KEYS:
        if key not in params:
            raise SystemExit(f"verl {version}'s compute_score has no {key!r}: {signature}")

    cases = [json.loads(line) for line in args.corpus.read_text().splitlines() if line.strip()]
    outputs = []
    for case in cases:
        opts = {k: case[k] for k in OPTION_KEYS if k in case}
        out = math_dapo.compute_score(case["response"], case["ground_truth"], **opts)
        outputs.append(
            {
                "id": case["id"],
                "inputs_sha256": case_digest(case),
                "score": float(out["score"]),
                "acc": bool(out["acc"]),
                "pred": out["pred"],
            }
        )

    record = {
        "source": f"verl {version}, {MODULE_PATH}, compute_score",
        "verl_version": version,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "module_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "compute_score_signature": signature,
        "how": (
            "pip install --no-deps verl into a scratch venv; the single file "
            f"{MODULE_PATH} loaded by path with importlib (import verl needs Ray and torch)"
        ),
        "corpus": str(args.corpus.resolve().relative_to(ROOT)),
        "num_cases": len(outputs),
        "cases": outputs,
    }
    args.out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    right = sum(o["acc"] for o in outputs)
    print(f"verl {version}: {len(outputs)} cases ({right} correct) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
