"""The checks every setting shares, and the one error type a bad configuration raises.

A comparison such as ``x < 0`` is False for NaN, so a range check written that way lets NaN
through; every float setting is therefore checked with :func:`check_finite` first (or with a
range test written so that NaN fails it, ``not x >= 0``).

:class:`ConfigError` is what a check that runs after the classes are built raises (the data's
settings against the model's, the optimizer's arguments, prompt files): the ``dapo-lightning``
CLI prints it as one ``error:`` line and exits with status 2, as it does for an argument a
class's constructor rejects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, get_args, get_origin

__all__ = [
    "ConfigError",
    "as_group",
    "check_count",
    "check_finite",
    "check_optimizer_settings",
    "optimizer_error",
]

#: Words of torch's optimizer argument errors -> the argument they are about.
_TORCH_ARGUMENT_WORDS = {
    "learning rate": "lr",
    "epsilon": "eps",
    "weight_decay": "weight_decay",
    "beta": "betas",
    "momentum": "momentum",
}


class ConfigError(ValueError):
    """A setting is invalid; the message names the field and the fix."""


def check_finite(name: str, value: Any, fix: str = "", *, none_ok: bool = False) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value`` is a finite real number.

    Args:
        name: The field as the user writes it (e.g. ``"data.sampling.temperature"``).
        value: The value given.
        fix: What to give instead (appended to the message).
        none_ok: None is a valid value (the setting is optional).
    """
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}." + (f" {fix}" if fix else ""))
    if not math.isfinite(value):
        raise ConfigError(
            f"{name}={value} is not finite." + (f" {fix}" if fix else " Give a finite number.")
        )


Group = TypeVar("Group")


def as_group(value: Any, group: type[Group], path: str, fix: str) -> Group:
    """``value`` as the settings group ``group`` (a dataclass; a mapping of its fields is built
    into one), e.g. ``dynamic_sampling.selection`` given in YAML.

    Raises:
        ConfigError: anything else, naming ``path`` and showing ``fix`` (how to write it).
    """
    if isinstance(value, group):
        return value
    if isinstance(value, dict):
        return group(**value)
    raise ConfigError(f"{path} is a group of settings, got {value!r}: write {fix}.")


def check_count(name: str, value: Any, low: int, what: str, *, none_ok: bool = False) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value`` is an integer >= ``low``.

    Args:
        name: The field as the user writes it (e.g. ``"data.dynamic_sampling.n"``).
        value: The value given.
        low: The least valid value.
        what: What the number counts, or what 0 means (shown in parentheses).
        none_ok: None is a valid value (the setting is optional; the message says "or null").
    """
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        null = " or null" if none_ok else ""
        raise ConfigError(f"{name} must be an integer >= {low}{null} ({what}), got {value!r}.")


def choices_of(alias: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` type admits, in order (``Literal[...] | None`` adds None): a
    setting's choices are declared once, in its type, and checked with :func:`check_choice`.

    Example: ``choices_of(Literal["acc", "score"] | None) == ("acc", "score", None)``.
    """
    out: list[Any] = []
    for arg in get_args(alias):
        if arg is type(None):
            out.append(None)
        elif get_origin(arg) is Literal:
            out.extend(choices_of(arg))
        else:
            out.append(arg)
    if not out:
        raise TypeError(f"{alias!r} is not a Literal type (or a union of them with None)")
    return tuple(out)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value`` is one of ``choices`` (None
    is written ``null``, as in YAML)."""
    choices = list(choices)
    if value not in choices:
        shown = ["null" if c is None else repr(c) for c in choices]
        listed = ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]
        raise ConfigError(f"{name} must be {listed}, got {value!r}.")


def _numbers(value: Any) -> Iterable[Any]:
    """The numbers inside an optimizer hyper-parameter (a float, or a tuple such as ``betas``)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value
    elif hasattr(value, "numel") and value.numel() == 1 and value.is_floating_point():
        yield float(value)  # a tensor learning rate


def check_optimizer_settings(param_groups: Iterable[dict[str, Any]], prefix: str) -> None:
    """Every number among the optimizer's hyper-parameters (``lr``, ``weight_decay``, ``betas``,
    ``eps``, ``momentum``, ...) is finite; raises :class:`ConfigError` naming
    ``{prefix}.{key}`` otherwise (torch checks some of them with ``not 0.0 <= lr``, some with
    ``lr < 0``, which NaN passes)."""
    for group in param_groups:
        for key, value in group.items():
            if key == "params":
                continue
            for number in _numbers(value):
                if not math.isfinite(number):
                    raise ConfigError(
                        f"{prefix}.{key}={value} is not finite: every optimizer setting must be "
                        "a finite number (a NaN learning rate turns every weight into NaN)."
                    )


def optimizer_error(error: ValueError, prefix: str) -> ConfigError:
    """A :class:`ConfigError` naming ``{prefix}.{argument}`` for torch's rejection of an
    optimizer argument (``Invalid learning rate: -1.0`` names no config path)."""
    text = str(error)
    key = next((k for w, k in _TORCH_ARGUMENT_WORDS.items() if w in text.lower()), None)
    where = f"{prefix}.{key}" if key else prefix
    return ConfigError(f"{where}: {text}. Fix: give the optimizer a valid {key or 'argument'}.")
