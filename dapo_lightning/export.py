"""Write a trained policy as a Hugging Face model folder: ``dapo-lightning export CKPT OUT``.

A Lightning checkpoint holds the policy's weights (``state_dict`` keys ``policy.*``) and the
module's hyper-parameters, among them ``model_name_or_path``, the folder the run started
from. :func:`export_checkpoint` rebuilds the architecture and the tokenizer from that folder,
loads the trained weights and hands them to :func:`export_pretrained`, which writes a folder
that ``AutoModelForCausalLM``, ``AutoTokenizer`` and ``vllm.LLM`` load:

* ``model.safetensors`` (tied weights written once) and ``config.json``;
* the tokenizer files, chat template included;
* ``generation_config.json`` with the EOS and pad token ids set.

A LoRA run (``model.lora``; its checkpoint holds the adapters only) exports the merged model
(``W + scaling * B @ A``, a plain ``transformers`` folder) by default, or with ``--adapter``
(``adapter=True``) the peft adapter folder (``adapter_config.json``,
``adapter_model.safetensors``, the tokenizer), which ``PeftModel.from_pretrained(base, OUT)``
and vLLM's ``LoRARequest`` load.

Every folder is written beside its destination and renamed into place when complete
(:func:`atomic_folder`), so a crash never leaves a half-written model at ``OUT``; its files get
the modes the user's umask gives new files (safetensors writes its files 0600).

Example::

    dapo-lightning export runs/quickstart/checkpoints/last.ckpt runs/quickstart/model-final
    dapo-lightning export last.ckpt out/ --model_name_or_path /data/Qwen2.5-0.5B  # moved base
    dapo-lightning export last.ckpt out/adapter --adapter  # a LoRA run's adapters only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from dapo_lightning.checkpoint.checks import is_sharded_checkpoint
from dapo_lightning.lora import (
    apply_lora,
    check_adapter_checkpoint,
    is_peft_model,
    load_quantized_policy,
    merged_model,
)
from dapo_lightning.lora.settings import LoraSettings
from dapo_lightning.weights import load_policy

#: The LightningModule attribute the policy lives under (state_dict keys ``policy.<name>``).
POLICY_PREFIX = "policy."


def check_new_folder(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir`` as a Path, after checking that a new folder may be written there.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty folder.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} already exists: remove it or choose another output folder (a model folder "
            "is never written over)."
        )
    return out


@contextlib.contextmanager
def atomic_folder(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; rename it to ``out_dir`` when the block ends
    without an error (it is deleted otherwise).

    Args:
        out_dir: Where the complete folder ends up; must not exist yet, or be an empty folder.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty folder.

    Example::

        with atomic_folder("out/model") as tmp:
            model.save_pretrained(tmp)
    """
    out = check_new_folder(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # (not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder)
    try:
        yield tmp
        apply_umask(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above); os.replace cannot replace a folder otherwise
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: str | os.PathLike[str]) -> None:
    """Give ``folder`` and everything under it the modes a new file or folder gets under the
    user's umask: ``0o666 & ~umask`` for files (``0o777`` for executables), ``0o777 & ~umask``
    for folders. Writers that create files 0600 (safetensors, temp-file-and-rename) otherwise
    leave a model folder that only its owner can read."""
    mask = current_umask()
    root = Path(folder)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        if path.is_dir():
            mode = 0o777
        else:
            mode = 0o777 if path.stat().st_mode & 0o100 else 0o666
        path.chmod(mode & ~mask)


def _token_id(tokenizer: Any, name: str) -> int | None:
    value = getattr(tokenizer, f"{name}_token_id", None)
    return int(value) if value is not None else None


def export_pretrained(
    policy: nn.Module, tokenizer: Any, out_dir: str | os.PathLike[str], *, adapter: bool = False
) -> Path:
    """Write ``policy`` and ``tokenizer`` as one Hugging Face model folder at ``out_dir``.

    A LoRA policy (peft model) is written merged (:func:`~dapo_lightning.lora.merged_model`;
    the policy itself is left as it is), or with ``adapter=True`` as its peft adapter folder.

    The generation config gets the tokenizer's EOS id (when it has none) and a pad id (the
    tokenizer's pad token, else EOS), so ``generate`` and vLLM stop and pad without warnings.

    Args:
        policy: A ``transformers`` causal LM (a ``PreTrainedModel``: it has ``save_pretrained``
            and a ``config``), or a peft LoRA model of one (unsharded).
        tokenizer: Its tokenizer; its chat template is written with it.
        out_dir: The folder to create (see :func:`atomic_folder`).
        adapter: Write the LoRA adapters only (``policy`` must be a peft model).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``policy`` is not a ``transformers`` model or ``tokenizer`` has no
            ``save_pretrained``.
        ValueError: ``adapter=True`` with a policy that has no LoRA adapters.
        FileExistsError: ``out_dir`` exists and is not empty.

    Example::

        export_pretrained(module.policy, AutoTokenizer.from_pretrained(base), "out/model")
        export_pretrained(module.policy, tokenizer, "out/adapter", adapter=True)  # LoRA run
    """
    if is_peft_model(policy) and not adapter:
        policy = merged_model(policy)
    elif adapter and not is_peft_model(policy):
        raise ValueError(
            f"adapter=True (--adapter) needs a LoRA policy, but {type(policy).__name__} has no "
            "peft adapters (the run trained every weight): export without --adapter."
        )
    if not adapter:
        _check_transformers_model(policy)
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(
            f"export_pretrained needs a transformers tokenizer, got {type(tokenizer).__name__}."
        )
    if not adapter:
        _set_generation_token_ids(policy, tokenizer)
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        policy.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def _check_transformers_model(policy: nn.Module) -> None:
    """Raise a TypeError unless ``policy`` has ``save_pretrained`` and a ``config``."""
    if not hasattr(policy, "save_pretrained") or not hasattr(policy, "config"):
        raise TypeError(
            f"export_pretrained needs a transformers model (with save_pretrained and config), "
            f"got {type(policy).__name__}: unwrap it first (e.g. module.policy)."
        )


def _set_generation_token_ids(policy: nn.Module, tokenizer: Any) -> None:
    """Fill ``policy.generation_config``'s missing ids: EOS from the tokenizer, pad = the
    tokenizer's pad token, else EOS (a policy without a generation config is left as it is)."""
    gen = getattr(policy, "generation_config", None)
    eos, pad = _token_id(tokenizer, "eos"), _token_id(tokenizer, "pad")
    if gen is not None:
        if gen.eos_token_id is None and eos is not None:
            gen.eos_token_id = eos
        if gen.pad_token_id is None:
            gen.pad_token_id = pad if pad is not None else eos


def _load_checkpoint(ckpt_path: Path) -> dict[str, Any]:
    if not ckpt_path.exists():
        raise FileNotFoundError(f"checkpoint {ckpt_path} does not exist: give a .ckpt file path.")
    if is_sharded_checkpoint(ckpt_path):
        raise IsADirectoryError(
            f"checkpoint {ckpt_path} is a folder (a sharded DeepSpeed/FSDP checkpoint): "
            "consolidate it into one file first, e.g. with "
            "lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict."
        )
    if ckpt_path.is_dir():
        inside = sorted(p.name for p in ckpt_path.glob("*.ckpt"))
        holds = f"; it holds {', '.join(inside[:4])}" if inside else ""
        what = (
            "a Hugging Face model folder" if (ckpt_path / "config.json").is_file() else "a folder"
        )
        raise IsADirectoryError(
            f"checkpoint {ckpt_path} is {what}, not a checkpoint{holds}. export expects one "
            "Lightning .ckpt file, e.g. RUN/checkpoints/last.ckpt."
        )
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(
            f"checkpoint {ckpt_path} could not be read as a Lightning checkpoint "
            f"({type(err).__name__}: {str(err)[:300]}): is it complete (not truncated) and a "
            "file written by the Trainer?"
        ) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"checkpoint {ckpt_path} has no 'state_dict': it is not a Lightning checkpoint."
        )
    return checkpoint


def policy_state_dict(checkpoint: dict[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """The policy's weights of a Lightning checkpoint, ``policy.`` prefix stripped.

    Args:
        checkpoint: A loaded Lightning checkpoint (``torch.load`` of a ``.ckpt`` file).
        where: How to name the checkpoint in the error.

    Raises:
        ValueError: No ``state_dict`` key starts with ``policy.``.
    """
    state = checkpoint.get("state_dict", {})
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state.items() if k.startswith(POLICY_PREFIX)}
    if not weights:
        raise ValueError(
            f"{where} holds no policy weights (no state_dict key starts with {POLICY_PREFIX!r}; "
            f"found {sorted(state)[:5]}): export a checkpoint written by training a DAPOModule."
        )
    return weights


def _load_weights(model: nn.Module, weights: dict[str, Any], where: str) -> None:
    """``load_state_dict`` that accepts tied weights given once and rejects anything else
    missing or unexpected."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    loaded = {p.data_ptr() for k, p in model.state_dict().items() if k in weights}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(
            f"the policy weights in {where} do not fit the architecture of the model folder "
            f"(missing {untied[:5]}, unexpected {unexpected[:5]}): pass --model_name_or_path "
            "with the folder the run was trained from."
        )


def export_checkpoint(
    ckpt_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_name_or_path: str | os.PathLike[str] | None = None,
    adapter: bool = False,
) -> Path:
    """Export the policy of a Lightning checkpoint as a Hugging Face model folder.

    A LoRA checkpoint (adapters only) is put on the base from ``model_name_or_path`` and
    exported merged, or with ``adapter=True`` as the peft adapter folder.

    Args:
        ckpt_path: A ``.ckpt`` file of a DAPOModule run (``last.ckpt``, ``hpc_ckpt_1.ckpt``...).
        out_dir: The folder to create (see :func:`export_pretrained`).
        model_name_or_path: The folder to take the architecture, tokenizer and generation
            config from (and, for a LoRA run, the base weights); default the checkpoint's
            ``hyper_parameters["model_name_or_path"]``.
        adapter: Write a LoRA run's adapters only (see :func:`export_pretrained`).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: The checkpoint or the model folder does not exist.
        ValueError: The checkpoint is unreadable, holds no policy weights, or names no model
            folder; ``adapter`` for a full-policy checkpoint; a QLoRA checkpoint exported
            merged without CUDA.

    Example::

        export_checkpoint("runs/quickstart/checkpoints/last.ckpt", "runs/quickstart/final")
    """
    check_new_folder(out_dir)
    ckpt = Path(ckpt_path)
    checkpoint = _load_checkpoint(ckpt)
    weights = policy_state_dict(checkpoint, where=f"checkpoint {ckpt}")
    folder, config, tokenizer = _load_model_folder(checkpoint, ckpt, model_name_or_path)
    lora = (checkpoint.get("dapo") or {}).get("lora")
    if lora is not None:
        model = _lora_policy(checkpoint, lora, weights, folder, adapter, ckpt)
        return export_pretrained(model.eval(), tokenizer, out_dir, adapter=adapter)
    if adapter:
        raise ValueError(
            f"--adapter: checkpoint {ckpt} holds a full policy (the run had no model.lora): "
            "export it without --adapter."
        )
    model = _full_policy(folder, config, weights, ckpt)
    return export_pretrained(model.eval(), tokenizer, out_dir)


def _load_model_folder(
    checkpoint: dict[str, Any], ckpt: Path, model_name_or_path: str | os.PathLike[str] | None
) -> tuple[str | os.PathLike[str], Any, Any]:
    """``(folder, config, tokenizer)`` of the model folder to build on: ``model_name_or_path``,
    else the checkpoint's ``hyper_parameters["model_name_or_path"]`` (an error names where the
    folder came from when it is missing or does not load)."""
    from transformers import AutoConfig, AutoTokenizer

    source = "--model_name_or_path"
    if model_name_or_path is None:
        model_name_or_path = (checkpoint.get("hyper_parameters") or {}).get("model_name_or_path")
        source = f"the checkpoint's hyper_parameters.model_name_or_path={model_name_or_path!r}"
        if model_name_or_path is None:
            raise ValueError(
                f"checkpoint {ckpt} names no model folder (hyper_parameters.model_name_or_path "
                "is missing): pass --model_name_or_path with the folder the run started from."
            )
    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    except OSError as err:
        raise FileNotFoundError(
            f"{source} could not be loaded ({str(err)[:200]}): the folder was moved or deleted. "
            "Pass --model_name_or_path DIR (model_name_or_path= in Python) with a folder of the "
            "same architecture and tokenizer, e.g. a copy of the base model."
        ) from err
    return model_name_or_path, config, tokenizer


def _full_policy(
    model_name_or_path: str | os.PathLike[str], config: Any, weights: dict[str, Any], ckpt: Path
) -> nn.Module:
    """The architecture ``config`` in the weights' dtype, with the generation config of
    ``model_name_or_path`` when it has one and the checkpoint's full-policy ``weights`` loaded."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = next(iter(weights.values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with contextlib.suppress(OSError):  # a folder without generation_config.json keeps the default
        model.generation_config = GenerationConfig.from_pretrained(model_name_or_path)
    _load_weights(model, weights, where=f"checkpoint {ckpt}")
    return model


def _lora_policy(
    checkpoint: dict[str, Any],
    lora: dict[str, Any],
    weights: dict[str, Any],
    model_name_or_path: str | os.PathLike[str],
    adapter: bool,
    ckpt: Path,
) -> nn.Module:
    """The peft model of a LoRA checkpoint: the base from ``model_name_or_path`` (4-bit for a
    QLoRA run exported merged), the checkpoint's adapters on it."""
    if not lora.get("settings"):
        raise ValueError(
            f"checkpoint {ckpt} holds adapters of a peft policy built outside DAPOModule's "
            "lora setting (no LoraSettings recorded): export it from the live module with "
            "export_pretrained(module.policy, tokenizer, out)."
        )
    settings = LoraSettings(**lora["settings"])
    dtype = str((checkpoint.get("hyper_parameters") or {}).get("torch_dtype", "float32"))
    quantized = settings.quantize_4bit and not adapter
    if quantized and not torch.cuda.is_available():
        raise ValueError(
            f"checkpoint {ckpt} trained QLoRA adapters over a 4-bit base: the merged model needs "
            "that base, which needs CUDA (bitsandbytes). Export the adapters with --adapter, or "
            "run the export on a CUDA machine."
        )
    if quantized:
        base = load_quantized_policy(str(model_name_or_path), dtype)
    else:
        base = load_policy(str(model_name_or_path), dtype)
    model = apply_lora(base, dataclasses.replace(settings, quantize_4bit=quantized))
    check_adapter_checkpoint(weights, model, where=f"checkpoint {ckpt}")
    model.load_state_dict(weights, strict=False)
    return model


def export_main(argv: Sequence[str] | None = None) -> Path:
    """``dapo-lightning export CKPT OUT [--model_name_or_path DIR]``.

    Args:
        argv: The arguments after ``export``.

    Returns:
        The written folder.
    """
    parser = argparse.ArgumentParser(
        prog="dapo-lightning export",
        description="Write the policy of a Lightning checkpoint as a Hugging Face model folder "
        "(safetensors weights, config, tokenizer with chat template, generation config).",
    )
    parser.add_argument("ckpt", help="the .ckpt file (e.g. runs/quickstart/checkpoints/last.ckpt)")
    parser.add_argument("out", help="the folder to create (must not exist or be empty)")
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="folder with the architecture and tokenizer (default: the checkpoint's "
        "model.model_name_or_path); use it when that folder has moved",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the peft adapter folder instead of the merged model",
    )
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()  # "Writing model shards: 100%" for a one-file model
    try:
        out = export_checkpoint(
            args.ckpt, args.out, model_name_or_path=args.model_name_or_path, adapter=args.adapter
        )
    except (OSError, ValueError, TypeError) as err:
        parser.exit(2, f"dapo-lightning export: error: {err}\n")
    print(f"wrote {out}")
    return out
