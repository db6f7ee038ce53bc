"""Name -> implementation tables for every extension point of the library, and its one
importer of dotted paths.

One :class:`Registry` per kind, filled by a decorator:

* policy objectives: ``@register_policy_objective``, ``model.init_args.loss.objective``;
* advantage estimators: ``@register_advantage_estimator``,
  ``model.init_args.loss.advantage_estimator``;
* rewards: ``@register_reward``, ``data.init_args.reward``;
* tasks: ``@register_task``, ``data.init_args.prompts.task``;
* environments: ``@register_environment``, ``data.init_args.environment.name``;
* rollout engines: ``@register_engine``, ``data.init_args.engine``.

A setting is either a registered name (``"dapo"``) or a dotted import path
``"my_pkg.my_module.my_function"``: the module is imported (so its decorators run) and the
attribute must be what one of them registered (some kinds also take an undecorated class there,
e.g. an environment class). A user's extension is therefore selectable from YAML without
editing the library::

    # my_pkg/my_module.py
    @register_policy_objective("my_objective")
    def my_objective(inputs, config, params): ...

    # config.yaml: model.init_args.loss.objective: my_pkg.my_module.my_objective

A registered *name* of a user's module is found once that module is imported: by a dotted path
used earlier, by the user's own script, or, for the ``dapo-lightning`` command, by an entry point
of the group :data:`EXTENSIONS_GROUP` in the user's package metadata (``pyproject.toml``:
``[project.entry-points."dapo_lightning.extensions"] my_pkg = "my_pkg.my_module"``), which is
imported the first time a name is not found.

:func:`import_object` is the one importer of dotted paths: a path that does not import raises
:class:`ImportPathError` naming the path, the import error and the fix (``PYTHONPATH``).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dapo_lightning.checks import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

#: Entry-point group of modules that register extensions (imported when a name is not found).
EXTENSIONS_GROUP = "dapo_lightning.extensions"


class ImportPathError(ConfigError, ImportError):
    """A dotted import path does not import: the message names the path, the error and the fix.

    Both a :class:`~dapo_lightning.checks.ConfigError` (the CLI prints it as one ``error:`` line,
    exit 2) and an ``ImportError``.
    """


_RAISE = object()


def import_object(path: str, what: str, missing: Any = _RAISE) -> Any:
    """The object at the dotted import path ``path`` (``"pkg.module.attr"``).

    Args:
        path: Module path, a dot, attribute name.
        what: The setting it comes from, for the message (``"model.loss.objective"``).
        missing: Returned when the module imports but has no such attribute (default: raise).

    Raises:
        ImportPathError: ``path`` has no dot, its module cannot be imported, or the module has no
            such attribute. The error is raised ``from None``: its message carries the import
            error, so a caller that reports an exception's root cause reports this one.
    """
    module_name, _, attr = str(path).rpartition(".")
    if "/" in str(path) or "\\" in str(path) or str(path).endswith(".py"):
        raise ImportPathError(
            f"{what} {path!r} is a file path, not an import path. Fix: give "
            "'module.Name' (the file's module, a dot, the name in it), with the file's folder on "
            "PYTHONPATH."
        )
    if not module_name or not attr:
        raise ImportPathError(f"{what} {path!r} must be a dotted path 'package.module.Name'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportPathError(
            f"{what} {path!r} does not import ({type(err).__name__}: {err}): module "
            f"{module_name!r} cannot be imported from where the command runs. Fix: check the "
            "spelling, and put the folder that holds it on PYTHONPATH (or pip-install its package)."
        ) from None
    if not hasattr(module, attr):
        if missing is not _RAISE:
            return missing
        raise ImportPathError(
            f"{what} {path!r} does not import (AttributeError: module {module_name!r} has no "
            f"attribute {attr!r}). Fix: check the spelling of the name after the last dot."
        ) from None
    return getattr(module, attr)


def load_extensions() -> list[str]:
    """Import the modules of every :data:`EXTENSIONS_GROUP` entry point installed (each once);
    the names of those loaded now.

    Raises:
        ImportPathError: an entry point's module does not import (names it and the error).
    """
    loaded = []
    for entry_point in importlib.metadata.entry_points(group=EXTENSIONS_GROUP):
        if entry_point.value in _LOADED:
            continue
        _LOADED.add(entry_point.value)
        try:
            entry_point.load()
        except ImportError as err:
            raise ImportPathError(
                f"the {EXTENSIONS_GROUP} entry point {entry_point.name!r} = "
                f"{entry_point.value!r} does not import ({type(err).__name__}: {err}). Fix: "
                "install what it needs, or uninstall the package that declares it."
            ) from None
        loaded.append(entry_point.value)
    return loaded


_LOADED: set[str] = set()


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered implementation.

    Args:
        name: The name it is registered under (its dotted path when it was not registered).
        fn: The implementation (the registry's fixed signature: a function or a class).
        params: Its own parameters and their defaults (e.g. SAPO's temperatures); a user's
            value for any other key is rejected.
        traits: Kind-specific facts the caller needs (e.g. an estimator's least group size, a
            task's reward).
    """

    name: str
    fn: F
    params: dict[str, float] = field(default_factory=dict)
    traits: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[F]):
    """A table of named implementations of one kind.

    Args:
        kind: What it holds, in messages (``"policy objective"``).
        field_name: The setting that selects one, in messages (``"model.loss.objective"``).
        decorator: The decorator's name, in messages (``"register_policy_objective"``).
        adopt: Which objects a dotted path may name without their being registered (e.g. any
            environment class); None: only registered ones.
        unknown: The message for a name that is neither registered nor a dotted path, from the
            setting's name, the name and the registered names; None: the standard one.
    """

    def __init__(
        self,
        kind: str,
        field_name: str,
        decorator: str,
        *,
        adopt: Callable[[Any], bool] | None = None,
        unknown: Callable[[str, str, list[str]], str] | None = None,
    ) -> None:
        self.kind, self.field_name, self.decorator = kind, field_name, decorator
        self.adopt, self.unknown = adopt, unknown
        self._entries: dict[str, Entry[F]] = {}

    def names(self) -> list[str]:
        """The registered names, in registration order (the built-ins first)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def register(
        self, name: str, params: dict[str, float] | None = None, **traits: Any
    ) -> Callable[[F], F]:
        """Decorator: register the function or class under ``name`` (a second, different one
        under the same name is an error; re-importing the same module is not)."""
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

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a KeyError if it is not registered): for a test or a notebook that
        registers a throw-away entry."""
        del self._entries[name]

    def get(self, name: str, field: str | None = None) -> Entry[F]:
        """The entry of a registered name or of a dotted import path; a ConfigError naming the
        setting (``field``, default the registry's) and the valid names otherwise
        (:class:`ImportPathError` for a path that does not import)."""
        field = field or self.field_name
        if name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and "." in name:
            return self._from_path(name, field)
        if load_extensions() and name in self._entries:
            return self._entries[name]
        if self.unknown is not None:
            raise ConfigError(self.unknown(field, name, self.names()))
        raise ConfigError(
            f"{field}={name!r} is not a registered {self.kind}; valid: "
            f"{', '.join(self.names())}, or the dotted import path 'pkg.module.name' of what "
            f"you decorated with @{self.decorator}."
        )

    def _from_path(self, path: str, field: str) -> Entry[F]:
        fn = import_object(path, field, missing=None)
        module_name, _, attr = path.rpartition(".")
        if fn is None:  # the module imports, the name is not in it
            names = [n for n in dir(importlib.import_module(module_name)) if not n.startswith("_")]
            match = difflib.get_close_matches(attr, names, n=1)
            hint = f" Did you mean {module_name}.{match[0]}?" if match else ""
            raise ConfigError(
                f"{field}={path!r} was not found: module {module_name} has no {attr!r}.{hint} "
                "Fix: check the name after the last dot."
            )
        for entry in self._entries.values():
            if entry.fn is fn:
                return entry
        if self.adopt is not None and self.adopt(fn):
            return Entry(path, fn)
        article = "an" if self.kind[0] in "aeiou" else "a"
        raise ConfigError(
            f"{field}={path!r}: {module_name} has no function {attr!r} registered as {article} "
            f"{self.kind}. Fix: decorate it with @{self.decorator}('<name>')."
        )


__all__ = [
    "EXTENSIONS_GROUP",
    "Entry",
    "ImportPathError",
    "Registry",
    "import_object",
    "load_extensions",
]
