"""Rollout engines by name: the table (:data:`ENGINES`, filled by :func:`register_engine`), the one
check of an engine setting and the factory.

``vllm`` is imported only when its engine is built (:mod:`dapo_lightning.rollout.vllm` costs
nothing to import). Your own engine, in your own module::

    @register_engine("my_engine")
    class MyEngine(HFRolloutEngine):  # or any RolloutEngine subclass
        ...

selected by ``data.init_args.engine: my_engine`` (once its module is imported) or by its dotted
path; it is built by its :meth:`~dapo_lightning.rollout.base.RolloutEngine.from_setup` and its
:attr:`~dapo_lightning.rollout.base.RolloutEngine.capabilities` say what the library may ask of it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from dapo_lightning.registry import Registry
from dapo_lightning.rollout.base import EngineCapabilities, EngineSetup, RolloutEngine
from dapo_lightning.rollout.hf import HFRolloutEngine
from dapo_lightning.rollout.vllm import VLLMRolloutEngine

__all__ = [
    "ENGINES",
    "check_engine",
    "create_engine",
    "engine_capabilities",
    "engine_class",
    "register_engine",
]


def _unknown_engine(field: str, name: str, names: list[str]) -> str:
    return (
        f"{field}={name!r}: use one of {names}, the dotted path of a RolloutEngine subclass, or "
        "an engine object (a dapo_lightning.RolloutEngine subclass)."
    )


def _is_engine_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, RolloutEngine)


#: Engine classes by name (``data.engine``); a dotted path may name any RolloutEngine subclass.
ENGINES: Registry[type[RolloutEngine]] = Registry(
    "rollout engine", "engine", "register_engine", adopt=_is_engine_class, unknown=_unknown_engine
)
ENGINES.register("hf")(HFRolloutEngine)
ENGINES.register("vllm")(VLLMRolloutEngine)


def register_engine(name: str) -> Callable[[type[RolloutEngine]], type[RolloutEngine]]:
    """Class decorator registering a :class:`~dapo_lightning.rollout.base.RolloutEngine`
    subclass under ``name`` (``data.engine``)."""

    def decorate(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if not _is_engine_class(cls):
            raise TypeError(f"@register_engine({name!r}) decorates a RolloutEngine subclass.")
        return ENGINES.register(name)(cls)

    return decorate


def engine_class(name: str, field: str = "engine") -> type[RolloutEngine]:
    """The engine class registered as ``name`` or at the dotted path ``name``."""
    return ENGINES.get(name, field).fn


def engine_capabilities(engine: str | RolloutEngine) -> EngineCapabilities:
    """What the engine ``engine`` (a name, a dotted path or an engine object) declares it can do."""
    return engine_class(engine).capabilities if isinstance(engine, str) else engine.capabilities


def check_engine(
    engine: Any, model_path: str | None, *, field: str = "engine", path_field: str = "model_path"
) -> None:
    """Refuse an engine setting that cannot be built, before any set-up is spent.

    ``engine`` is a name or dotted path of :data:`ENGINES` or a :class:`RolloutEngine` object;
    an engine class that ``needs_model_path`` needs ``model_path``, one that
    ``requires_package`` needs it installed. ``field`` and ``path_field`` are the settings'
    names in the messages (``data.engine`` ...).

    Raises:
        ValueError: an unknown name, or no ``model_path`` for an engine that needs it.
        TypeError: an object that does not subclass :class:`RolloutEngine`.
        ImportError: the engine's package is not installed, or a dotted path does not import.
    """
    if isinstance(engine, str):
        cls = engine_class(engine, field)
        if cls.needs_model_path and model_path is None:
            raise ValueError(
                f"{field}={engine!r} needs {path_field} (the checkpoint {cls.__name__} loads)."
            )
        if cls.requires_package is not None:
            package, hint = cls.requires_package
            if importlib.util.find_spec(package) is None:
                raise ImportError(f"{field}={engine!r} but {package} is not installed. {hint}")
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
    """Build a rollout engine by name (its ``from_setup``).

    Args:
        kind: ``"hf"`` (samples with ``model`` itself; needs ``model``), ``"vllm"`` (an
            in-process ``vllm.LLM`` on ``model_path``), or another registered name / dotted path.
        model: The policy module (``"hf"``); ``owns_model=True`` in ``kwargs`` marks it as the
            engine's own copy.
        tokenizer: Gives the HF engine its EOS / pad ids (``"hf"``).
        model_path: Checkpoint folder or hub id vLLM loads (``"vllm"``).
        seed: Base sampling seed; engines add the data-parallel rank themselves where relevant
            (``"vllm"``); for ``"hf"`` pass ``seed + rank``.
        **kwargs: Passed to the engine's constructor.
    """
    check_engine(kind, model_path, field="kind")
    owned = bool(kwargs.pop("owns_model", False))
    setup = EngineSetup(
        kwargs,
        model_path=model_path,
        tokenizer=tokenizer,
        seed=seed,
        sampling_module=None if model is None else lambda: (model, owned),
    )
    return engine_class(kind, "kind").from_setup(setup)
