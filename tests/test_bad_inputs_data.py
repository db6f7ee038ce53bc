"""Bad prompt data through the real ``dapo-lightning fit`` console script (issue 38, item 7): each
case is one ``dapo-lightning: error:`` line naming the file or the field and the fix, exit
status 2, no traceback, before any training (no checkpoint folder).

Cases: a JSONL prompt holding a lone UTF-16 surrogate (a JSON ``"\\ud800"`` escape without its
pair), which once failed with a ``UnicodeEncodeError`` in ``prompt_uid`` naming no row; and
``dynamic_sampling.gen_batch_size`` larger than the training prompts, which once failed with a
traceback. (The same checks as library calls: tests/test_data_sources.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "dapo-lightning")


def fit_config(tmp_path: Path, model_path: Path, data: str, source: str) -> Path:
    """A one-update fit of the tiny model; ``data`` is the data module's other settings,
    ``source`` the prompts' source (``task`` / ``train_files`` keys of ``prompts``)."""
    config = tmp_path / "fit.yaml"
    config.write_text(
        f"""
model:
  class_path: dapo_lightning.DAPOModule
  init_args:
    model_name_or_path: {model_path}
    batching: {{micro_batch_size: 8}}
    parity_check_every: 0
data:
  class_path: dapo_lightning.DAPODataModule
  init_args:
{data}
    scoring: {{in_process: true}}
    prompts: {{{source}, apply_chat_template: false, max_prompt_length: 16, answer_key: answer}}
    sampling: {{max_tokens: 4}}
trainer:
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  accelerator: cpu
  default_root_dir: {tmp_path / "run"}
"""
    )
    return config


def run_fit(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    argv = [CLI, "fit", "--config", str(config)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    err = proc.stderr
    lines = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("dapo-lightning: error: "), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_lone_surrogate_in_a_jsonl_prompt_names_the_file_and_row(tiny_checkpoint, tmp_path):
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(6)]
    lines = [json.dumps(r) for r in rows]
    lines[3] = '{"prompt": "3 + 1 = \\ud83d", "answer": "4"}'  # half of an emoji's escape pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    source = f"task: null, train_files: {prompts}"
    data = """    validation: {fraction: 0.0}
    reward: arithmetic
    dynamic_sampling: {n: 2, train_batch_size: 2, filter_metric: null}"""
    proc = run_fit(fit_config(tmp_path, tiny_checkpoint, data, source), tmp_path)
    line = assert_one_error_line(proc, f"{prompts} row 4", "'prompt'", "surrogate")
    assert "UnicodeEncodeError" not in proc.stderr, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_gen_batch_size_above_the_prompt_count_is_one_error_line(tiny_checkpoint, tmp_path):
    source = "task: arithmetic, task_kwargs: {level: 1, num_prompts: 16}"
    data = """    dynamic_sampling: {n: 2, train_batch_size: 2, gen_batch_size: 64, filter_metric: null}"""
    proc = run_fit(fit_config(tmp_path, tiny_checkpoint, data, source), tmp_path)
    assert_one_error_line(proc, "data.dynamic_sampling.gen_batch_size=64", "Fix:")
    assert not (tmp_path / "run" / "checkpoints").exists()
