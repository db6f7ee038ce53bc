"""The CLI's argument parser: options spelled out in full, help that keeps its line breaks,
``trainer.precision: auto``, and a non-finite number given plainly (``nan``), an unknown key or
a class path that does not import said in one line (the closest valid name suggested).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
from collections.abc import Callable
from typing import Any, Literal, NoReturn

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

#: The top of ``fit --help`` / ``validate --help``: where the DAPO options are.
SUBCOMMAND_HELP = """{what}

DAPO options (the Trainer's follow below):
  --model.help DAPOModule          the policy update: clip ratios, loss aggregation, optimizer
  --data.help DAPODataModule       prompts, rewards, rollout engine, group size, dynamic sampling
  --create_model_if_missing ...    write the quickstart's tiny model on first use
  --ckpt_path auto                 resume from the run's latest update that loads
  --print_config                   the whole resolved config, as YAML
"""


class DAPOHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description's own line breaks kept."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class StrictArgumentParser(LightningArgumentParser):
    """A parser that refuses abbreviated options (``allow_abbrev=False``): argparse would take
    ``--model.init_args.loss.clip_ratio_hi 0.3`` for ``clip_ratio_high`` without a word, so a
    typo could set another option. jsonargparse builds the parsers of subcommands and of
    subclass arguments (``--model.init_args.*``) with the class of their parent, so one class
    covers all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """jsonargparse's error, with a non-finite number said in one line
        (:func:`nonfinite_message`; by the parser that prints it, not by the nested parsers
        whose messages it quotes)."""
        shorter = None
        if self.exit_on_error:
            parser = getattr(ex, "subcommand_parser", None) or self
            shorter = (
                nonfinite_message(message)
                or bad_key_message(message, lambda class_path: known_keys(parser, class_path))
                or type_message(message)
            )
        super().error(shorter or message, ex)


def known_keys(parser: Any, class_path: str | None = None) -> list[str]:
    """The option names of ``class_path``'s arguments (``scoring.workers``), or with None of
    ``parser`` and its subcommands' parsers (``trainer.max_steps``); [] when it cannot say."""
    if class_path is not None:
        try:
            module, _, name = class_path.rpartition(".")
            owner = ArgumentParser(exit_on_error=False)
            owner.add_class_arguments(
                getattr(importlib.import_module(module), name), fail_untyped=False
            )
        except Exception:  # noqa: BLE001 - no suggestion then
            return []
        parser = owner
    keys = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            keys += [k for sub in action.choices.values() for k in known_keys(sub)]
        elif action.dest not in ("help", argparse.SUPPRESS):
            keys.append(action.dest)
    return keys


def closest(name: str, names: list[str], prefix: str = "") -> str:
    """`` Did you mean PREFIX+X?`` for the name X of ``names`` closest to ``name``: the names it
    is the start of (an abbreviation, ``model`` for ``model_name_or_path``; several named
    together), else the closest by difflib; ``""`` when none is close."""
    starts = [n for n in names if n.startswith(name) and "." not in n[len(name) :]]
    if starts:
        return f" Did you mean {' or '.join(prefix + n for n in sorted(set(starts))[:5])}?"
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" Did you mean {prefix}{match[0]}?" if match else ""


_ROOT_KEY = re.compile(r'^Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)':\s*\n\s*(.+)")
_UNKNOWN = (
    re.compile(r"unrecognized arguments: --([\w.]+)"),  # --data.init_args.scoring.workerz 2
    re.compile(r"Group '([\w.]+)' does not accept option '(\w+)'"),  # a YAML file's
    re.compile(r"Option '([\w.]+)' is not accepted"),
)
#: The class path on the line of a class argument's refusal (``Got value: Namespace(...)``).
_INNER_CLASS = re.compile(r"class_path='([\w.]+)'[^\n]*$")
_PARSER_KEYS = re.compile(r'Parser key "([\w.]+)"')
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def bad_key_message(message: str, keys: Callable[[str | None], list[str]]) -> str | None:
    """One line for jsonargparse's 3-13-line error of an unknown key or of a class path that
    does not import: the key as given on the command line, what is wrong, the closest valid
    name (``keys(class_path)``: the valid keys of that class, None: of the parser) and the fix;
    None for any other message."""
    root = _ROOT_KEY.match(message)
    owner = _CLASS_PATH.search(message)
    detail = owner.group(2) if owner else message.strip().splitlines()[0]
    for pattern in _UNKNOWN:
        found = pattern.search(detail)
        class_path = owner.group(1) if owner else None
        prefix = f"{root.group(1)}.init_args." if root and owner else ""
        if found is None and owner is not None:  # a class argument of the class (optimizer)
            found = pattern.search(message, owner.end(1))
            end = message.find("\n", found.end()) if found else -1
            inner = _INNER_CLASS.search(message[: None if end < 0 else end]) if found else None
            parents = _PARSER_KEYS.findall(message, owner.end(1), found.start()) if found else []
            if inner is None or not parents:
                continue
            class_path, prefix = inner.group(1), f"{prefix}{parents[-1]}.init_args."
        if found is None:
            continue
        key = ".".join(found.groups())
        valid = keys(class_path)
        where = f" of {class_path.rpartition('.')[2]}" if class_path else ""
        hint = closest(key, valid, prefix)
        return (
            f"{prefix}{key} is not an option{where}.{hint} Fix: correct the key "
            "(--print_config shows the valid ones)."
        )
    field = f"{root.group(1)}: " if root else ""
    if owner is not None and (missing := _NO_ATTRIBUTE.search(detail)) is not None:
        module, name = missing.groups()
        try:
            names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except Exception:  # noqa: BLE001 - no suggestion then
            names = []
        hint = closest(name, names, f"{module}.")
        return (
            f"{field}class_path {owner.group(1)} does not exist: {module} has no {name}.{hint}"
            " Fix: correct the class path."
        )
    if owner is not None and (missing := _NO_MODULE.search(detail)) is not None:
        return (
            f"{field}class_path {owner.group(1)} does not import: no module named "
            f"{missing.group(1)}. Fix: correct the module path, or install its package."
        )
    return None


_NONFINITE = r"[+-]?(?:nan|inf|infinity)"
#: The innermost line of a type error naming the value, when it is a NaN / infinity spelled
#: plainly (``nan``: YAML reads it as a string; ``.nan`` reaches the class's own check).
_NONFINITE_VALUE = re.compile(rf"^( *).*\b(?:Given|Got) value: ({_NONFINITE})\s*$", re.I | re.M)
#: The outer line of a nested one: ``Given value: NestedArg(key='loss.eps', val='nan')``.
_NONFINITE_NESTED = re.compile(rf"NestedArg\(key='([^']+)', val='({_NONFINITE})'\)", re.I)
_PARSER_KEY = re.compile(r'^( *)(?:- )?Parser key "([^"]+)"')


def nonfinite_message(message: str) -> str | None:
    """``model.gradient_clip_val=nan is not finite...`` for jsonargparse's 12-17-line union dump
    of a plain ``nan`` / ``inf`` given for a number; None for any other message. The field is
    the chain of ``Parser key`` lines the value line is nested in (by indentation)."""
    found = _NONFINITE_VALUE.search(message)
    if found is not None:
        depth, keys = len(found.group(1)), []
        for line in reversed(message[: found.start()].splitlines()):
            key = _PARSER_KEY.match(line)
            if key is not None and len(key.group(1)) < depth:
                depth = len(key.group(1))
                keys.insert(0, key.group(2))
        field, value = ".".join(keys), found.group(2)
    elif (nested := _NONFINITE_NESTED.search(message)) is not None:
        outer = _PARSER_KEY.match(message)
        field = ".".join([outer.group(2), nested.group(1)] if outer else [nested.group(1)])
        value = nested.group(2)
    else:
        return None
    return f"{field or 'a setting'}={value} is not finite. Give a finite number."


#: A line carrying the value a type refused: ``Expected a <class 'int'>. Got value: abc`` /
#: ``Given value: fast. Got value: Namespace(...)`` / ``Given value: [1, 2]``.
_VALUE_LINE = re.compile(
    r"^( *)(?:- )?(?:Expected a (?P<type>.+?)\. Got value: (?P<got>.*)"
    r"|Given value: (?P<given>.*?)(?:\. Got value: Namespace\(.*)?)$"
)
_SUBTYPES = re.compile(r"^( *)Subtypes: \[(.*)\]$")
_GIVEN_TYPE = re.compile(r"^ *Given value type: <class '(?:[\w.]+\.)?(\w+)'>$")
_TYPE_NAME = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>|typing\.Literal\[([^\]]*)\]")
#: A plain way to write each simple type, for the fix.
_TYPE_EXAMPLES = {
    "int": "a whole number (e.g. 4)",
    "float": "a number (e.g. 0.5 or 1e-4)",
    "bool": "true or false",
    "str": "a string",
    "NoneType": "null",
}


def _type_words(types: str) -> list[str]:
    """``["a number (e.g. 0.5 or 1e-4)", "one of 'a', 'b'"]`` for a jsonargparse type list."""
    words = []
    for found in _TYPE_NAME.finditer(types):
        name, choices = found.groups()
        if choices is not None:
            words.append(f"one of {choices}")
        elif name == "Tensor" and words:
            continue  # float | Tensor: a number
        else:
            words.append(
                _TYPE_EXAMPLES.get(
                    name, f"a {name} (a class path, or a mapping of class_path and init_args)"
                )
            )
    return words


def _field_of(lines: list[str], index: int) -> str:
    """The dotted field of the value on ``lines[index]``: the ``Parser key`` lines it is nested
    in (by indentation), with ``init_args`` after a key whose value is a class."""
    depth = len(lines[index]) - len(lines[index].lstrip(" "))
    chain: list[tuple[int, str]] = []
    for i in range(index - 1, -1, -1):
        indent = len(lines[i]) - len(lines[i].lstrip(" "))
        keys = _PARSER_KEYS.findall(lines[i])
        if keys and indent < depth:
            depth = indent
            chain.insert(0, (i, keys[-1]))
    parts = []
    for n, (i, key) in enumerate(chain):
        parts.append(key)
        if n + 1 < len(chain):
            between = "\n".join(lines[i : chain[n + 1][0] + 1])
            if "class_path" in between or "callable class" in between:
                parts.append("init_args")
    return ".".join(parts)


def type_message(message: str) -> str | None:
    """One line for jsonargparse's 3-19-line dump of a value of the wrong type (``lr: fast``,
    ``data:`` given a list): the field as the config spells it, what it expects, what it got
    and the fix; None for any other message."""
    lines = message.splitlines()
    found = [(i, m) for i, line in enumerate(lines) if (m := _VALUE_LINE.match(line))]
    if not found:
        return None
    index, value = max(found, key=lambda f: len(f[1].group(1)))  # the innermost
    depth = len(value.group(1))
    expected = value.group("type")
    if expected is None:  # the nearest list of subtypes above it, in its own block
        for line in reversed(lines[:index]):
            subtypes = _SUBTYPES.match(line)
            if subtypes is not None and len(subtypes.group(1)) <= depth:
                expected = subtypes.group(2)
                break
    words = _type_words(expected or "")
    field = _field_of(lines, index)
    if not words or not field:
        return None
    got = value.group("got") if value.group("got") is not None else value.group("given")
    kind = next(
        (t.group(1) for line in lines[index - 1 : index + 1] if (t := _GIVEN_TYPE.match(line))),
        None,
    )
    of_kind = f" (a {kind})" if kind and kind not in ("str", "NestedArg") else ""
    fix = next((w for w in words if w != "null"), words[0])
    return f"{field}: expected {' or '.join(words)}, got {got}{of_kind}. Fix: give it {fix}."


def allow_auto_precision(parser: Any) -> None:
    """Let ``trainer.precision`` take ``"auto"`` (the Trainer's own type has no such value;
    :func:`~dapo_lightning.precision.resolve_trainer_precision` replaces it before the Trainer
    is built)."""
    for action in parser._actions:
        if action.dest == "trainer.precision" and hasattr(action, "_typehint"):
            action._typehint = Literal["auto"] | action._typehint


#: The CLI's roots given as ``class_path`` + ``init_args`` (their nested nulls are rewritten).
SUBCLASS_ROOTS = ("model", "data")
#: YAML's spellings of null.
_NULLS = frozenset({"null", "Null", "NULL", "~"})


def nested_nulls(argv: list[str]) -> list[str]:
    """``argv`` with every ``--model.A.B null`` / ``--data.init_args.A.B=null`` (a null for a
    field of a settings group, two or more keys below the root) given as
    ``--model '{"init_args": {"A": {"B": null}}}'``.

    Why: jsonargparse (4.53) refuses a plain ``null`` for an optional field of a dataclass
    nested in a ``class_path`` / ``init_args`` argument (a 15-line union dump, although a
    YAML file's ``null`` is accepted); the whole-argument dict form is parsed, and merged with
    the values given before it, as the YAML file is.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        key, eq, value = token.partition("=")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        parts = key[2:].split(".") if key.startswith("--") else []
        if parts and parts[0] in SUBCLASS_ROOTS and value in _NULLS:
            path = parts[2:] if len(parts) > 1 and parts[1] == "init_args" else parts[1:]
            if len(path) >= 2:
                nested: Any = None
                for name in reversed(path):
                    nested = {name: nested}
                out += [f"--{parts[0]}", json.dumps({"init_args": nested})]
                i += 1 if eq else 2
                continue
        out.append(token)
        i += 1
    return out
