"""Packaging: ``callbacks/`` ships as ``dapo_lightning.callbacks`` (never a top-level
``callbacks`` package), in the wheel and in the editable install; the tiny checkpoint loads
with Hugging Face auto classes."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_wheel_maps_callbacks_into_the_library(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("dapo_lightning-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dapo_lightning/callbacks/__init__.py" in names
    assert "dapo_lightning/callbacks/overlong.py" in names
    assert not [n for n in names if n.startswith("callbacks/")], "top-level callbacks/ shipped"
    assert not [n for n in names if n.startswith("tests/")]


def test_editable_install_imports_callbacks_from_anywhere(tmp_path):
    code = (
        "import dapo_lightning.callbacks as c, importlib.util as u;"
        "print(c.__file__); print(u.find_spec('callbacks'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(out[0]) == ROOT / "callbacks" / "__init__.py"
    assert out[1] == "None"  # no top-level `callbacks` module is importable


def test_tiny_checkpoint_loads_with_auto_classes(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    text = "12+34=46\nAnswer: 46"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per ASCII character
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert chat.endswith("<|im_start|>assistant\n")
    assert model.config.head_dim >= 32 and model.config.tie_word_embeddings
    assert (
        model.get_output_embeddings().weight.data_ptr()
        == model.get_input_embeddings().weight.data_ptr()
    )
