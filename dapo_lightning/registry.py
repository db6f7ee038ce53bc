"""Name -> implementation tables for the library's extension points (policy objectives,
advantage estimators): one :class:`Registry` per kind, filled by a decorator.

A name is either one registered with the decorator (``"dapo"``) or a dotted import path
``"my_pkg.my_module.my_function"``: the module is imported (so its decorators run) and the
attribute must be a function that one of them registered. A user's objective is therefore
selectable from YAML without editing the library::

    # my_pkg/my_module.py
    @register_policy_objective("my_objective")
    def my_objective(inputs, config, params): ...

    # config.yaml: model.init_args.loss.objective: my_pkg.my_module.my_objective
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered implementation.

    Args:
        name: The name it is registered under.
        fn: The implementation (the registry's fixed signature).
        params: Its own parameters and their defaults (e.g. SAPO's temperatures); a user's
            value for any other key is rejected.
        traits: Kind-specific facts the caller needs (e.g. an estimator's least group size).
    """

    name: str
    fn: F
    params: dict[str, float] = field(default_factory=dict)
    traits: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[F]):
    """A table of named implementations of one kind (``kind`` names it in errors)."""

    def __init__(self, kind: str, field_name: str, decorator: str) -> None:
        self.kind, self.field_name, self.decorator = kind, field_name, decorator
        self._entries: dict[str, Entry[F]] = {}

    def names(self) -> list[str]:
        """The registered names, in registration order (the built-ins first)."""
        return list(self._entries)

    def register(
        self, name: str, params: dict[str, float] | None = None, **traits: Any
    ) -> Callable[[F], F]:
        """Decorator: register the function under ``name`` (a second, different function under
        the same name is an error; re-importing the same module is not)."""
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                f"a {self.kind} name must be a non-empty string without dots, got {name!r}."
            )

        def decorate(fn: F) -> F:
            old = self._entries.get(name)
            same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (
                fn.__module__,
                fn.__qualname__,
            )
            if old is not None and not same:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({old.fn.__module__}."
                    f"{old.fn.__qualname__}); choose another name."
                )
            self._entries[name] = Entry(name, fn, dict(params or {}), dict(traits))
            return fn

        return decorate

    def get(self, name: str) -> Entry[F]:
        """The entry of a registered name or of a dotted import path; a ValueError naming the
        field and the valid names otherwise."""
        if name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and "." in name:
            return self._from_path(name)
        raise ValueError(
            f"{self.field_name}={name!r} is not a registered {self.kind}; valid: "
            f"{', '.join(self.names())}, or the dotted import path 'pkg.module.function' of a "
            f"function decorated with @{self.decorator}."
        )

    def _from_path(self, path: str) -> Entry[F]:
        module_name, _, attr = path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"{self.field_name}={path!r}: module {module_name!r} cannot be imported ({err}). "
                "Fix: put it on PYTHONPATH, or use a registered name: "
                f"{', '.join(self.names())}."
            ) from err
        fn = getattr(module, attr, None)
        for entry in self._entries.values():
            if entry.fn is fn:
                return entry
        raise ValueError(
            f"{self.field_name}={path!r}: {module_name} has no function {attr!r} registered as a "
            f"{self.kind}. Fix: decorate it with @{self.decorator}('<name>')."
        )


__all__ = ["Entry", "Registry"]
