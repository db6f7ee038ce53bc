"""Rollout engines by name: the one check of an engine setting and the factory.

``vllm`` is imported only when its engine is built (:mod:`dapo_lightning.rollout.vllm` costs
nothing to import).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dapo_lightning.rollout.base import RolloutEngine
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.rollout.vllm import _INSTALL_HINT, VLLMRolloutEngine

__all__ = ["ENGINE_KINDS", "check_engine", "create_engine"]

#: Engine kinds :func:`create_engine` builds.
ENGINE_KINDS = ("hf", "vllm")


def check_engine(
    engine: Any, model_path: str | None, *, field: str = "engine", path_field: str = "model_path"
) -> None:
    """Refuse an engine setting that cannot be built, before any set-up is spent.

    ``engine`` is a kind of :data:`ENGINE_KINDS` or a :class:`RolloutEngine` object; ``"vllm"``
    needs ``model_path`` (the checkpoint vLLM loads) and vLLM installed. ``field`` and
    ``path_field`` are the settings' names in the messages (``data.engine`` ...).

    Raises:
        ValueError: an unknown kind, or ``"vllm"`` without ``model_path``.
        TypeError: an object that does not subclass :class:`RolloutEngine`.
        ImportError: ``"vllm"`` without vLLM installed.
    """
    if isinstance(engine, str):
        if engine not in ENGINE_KINDS:
            raise ValueError(
                f"{field}={engine!r}: use one of {list(ENGINE_KINDS)} or an engine object "
                "(a dapo_lightning.RolloutEngine subclass)."
            )
        if engine == "vllm" and model_path is None:
            raise ValueError(f"{field}='vllm' needs {path_field} (the checkpoint vLLM loads).")
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ImportError(f"{field}='vllm' but vllm is not installed. {_INSTALL_HINT}")
        return
    if not isinstance(engine, RolloutEngine):
        raise TypeError(
            f"{field} ({type(engine).__name__}) does not subclass "
            "dapo_lightning.RolloutEngine: subclass it (generate and load_weights are required; "
            "sleep, adapters and RNG state have no-op defaults)."
        )


def create_engine(
    kind: str,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_path: str | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> RolloutEngine:
    """Build a rollout engine by name.

    Args:
        kind: ``"hf"`` (samples with ``model`` itself; needs ``model``) or ``"vllm"`` (an
            in-process ``vllm.LLM`` on ``model_path``).
        model: The policy module (``"hf"``).
        tokenizer: Gives the HF engine its EOS / pad ids (``"hf"``).
        model_path: Checkpoint folder or hub id vLLM loads (``"vllm"``).
        seed: Base sampling seed; engines add the data-parallel rank themselves where relevant
            (``"vllm"``); for ``"hf"`` pass ``seed + rank``.
        **kwargs: Passed to the engine's constructor.
    """
    check_engine(kind, model_path, field="kind")
    if kind == "hf":
        if model is None:
            raise ValueError("create_engine('hf') needs model=<the policy module>.")
        return HFRolloutEngine(model, tokenizer, seed=seed, **kwargs)
    return VLLMRolloutEngine(str(model_path), seed=seed, **kwargs)
