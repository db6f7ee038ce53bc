"""The ``--config`` files of ``fit``, ``validate`` and ``sft``, checked before the parser reads
them: each fault is one :class:`~dapo_lightning.checks.ConfigError` line naming the file, the
line and the fix (jsonargparse would print a 71-line ``UnicodeDecodeError`` traceback for a
binary file, "Unexpected config" for an empty one, a YAML scanner message that never says
"tab", and it keeps the last of two equal keys without a word).

Checked: the file is UTF-8 text (no NUL byte), it is valid YAML (a tab in the indentation said
as such), it holds a mapping of settings (not nothing, nor only comments), and no mapping in it
has the same key twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from dapo_lightning.checks import ConfigError

__all__ = ["check_config_file", "check_config_files", "config_file_args"]

#: The options that take a config file.
CONFIG_OPTIONS = ("--config", "-c")


def config_file_args(argv: Sequence[str]) -> list[str]:
    """The values of every ``--config FILE`` / ``--config=FILE`` / ``-c FILE`` in ``argv``."""
    found = []
    for i, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if name in CONFIG_OPTIONS:
            if eq:
                found.append(value)
            elif i + 1 < len(argv):
                found.append(argv[i + 1])
    return found


def check_config_files(argv: Sequence[str]) -> None:
    """:func:`check_config_file` on each config file ``argv`` names (a value that is no file, a
    YAML string given inline, is left to the parser)."""
    for value in config_file_args(argv):
        path = Path(value).expanduser()
        if path.is_file():
            check_config_file(path)


def check_config_file(path: Path) -> None:
    """Raise :class:`~dapo_lightning.checks.ConfigError` (one line) when ``path`` is no YAML
    mapping of settings: not UTF-8 text, a YAML syntax error (a tab in the indentation said),
    empty or only comments, a top level that is no mapping, or a key given twice in one
    mapping."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        text = None
        byte = error.start
    else:
        byte = data.find(b"\x00")
    if text is None or byte >= 0:
        line = data[:byte].count(b"\n") + 1
        raise ConfigError(
            f"--config {path}: not a YAML text file (byte {byte}, line {line}, is "
            f"{data[byte : byte + 1]!r}: a binary file, or text not saved as UTF-8). Fix: give "
            "a YAML config file, e.g. --config configs/quickstart.yaml."
        )
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        raise ConfigError(_syntax_message(path, text, error)) from None
    if root is None:
        raise ConfigError(
            f"--config {path} is empty (no settings, only blank lines or comments). Fix: put "
            "the settings in it (trainer:, model:, data:; configs/quickstart.yaml is an "
            "example), or leave out this --config."
        )
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else f"the value {root.value!r}"
        raise ConfigError(
            f"--config {path}: the top level is {kind}, not a mapping of settings. Fix: write "
            "it as `key: value` lines (trainer:, model:, data:; configs/quickstart.yaml is an "
            "example)."
        )
    _check_duplicate_keys(path, root)


def _syntax_message(path: Path, text: str, error: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: where, what, and a tab named as such."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return f"--config {path}: not valid YAML ({problem}). Fix: correct the YAML syntax."
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    indent = line[: len(line) - len(line.lstrip(" \t"))]
    where = f"--config {path}, line {mark.line + 1}"
    if "\t" in indent or "'\\t'" in problem:
        return (
            f"{where} is indented with a tab: YAML indents with spaces only. Fix: replace the "
            "tab(s) with spaces (e.g. `expand -t 2 FILE`, or your editor's tabs-to-spaces)."
        )
    return (
        f"{where}, column {mark.column + 1}: not valid YAML ({problem}): {line.strip()!r}. "
        "Fix: correct the YAML syntax there."
    )


def _check_duplicate_keys(path: Path, node: yaml.Node, where: str = "") -> None:
    """Raise naming the first key a mapping under ``node`` holds twice (YAML would keep the
    last one without a word); ``where`` is the dotted path of ``node``."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(path, item, where)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key, value in node.value:
        name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
        if name is not None and name != "<<":
            dotted = f"{where}.{name}" if where else name
            if name in seen:
                raise ConfigError(
                    f"--config {path}, line {key.start_mark.line + 1}: the key {dotted} is "
                    f"given twice (first on line {seen[name]}); YAML would keep only the last "
                    "one. Fix: delete one of them."
                )
            seen[name] = key.start_mark.line + 1
        _check_duplicate_keys(path, value, f"{where}.{name}" if where and name else name or where)
