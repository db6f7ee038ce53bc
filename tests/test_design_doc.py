"""docs/design.md held to the code (issue 64): its floor table row by row against the import
graph, and its layout against the modules that exist.

The floors: every module of ``dapo_lightning`` (each sub-package one node) sits on the row of
the longest import chain beneath it (0: it imports nothing of the library). A failure prints
the table as the code has it, to paste over the doc's (keep the doc's notes in parentheses).
"""

from __future__ import annotations

import re

import pytest

from tests.test_structure import PACKAGES, ROOT, Source, import_graph, iter_sources

DESIGN = ROOT / "docs" / "design.md"


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return list(iter_sources(PACKAGES, ROOT))


def node_of(module: str, packages: set[str]) -> str:
    """The table's node of ``module``: its first-level sub-package, else the module."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    return package if len(parts) > 2 or module in packages else module


def floors(sources: list[Source]) -> dict[str, int]:
    """node -> its floor: 0 without library imports, else 1 + the highest floor it imports
    (module-level and ``TYPE_CHECKING`` imports; the graph has no cycle, tested elsewhere)."""
    packages = {s.module for s in sources if s.is_package and s.module.count(".") == 1}
    graph: dict[str, set[str]] = {}
    for module, deps in import_graph(sources, type_checking=True).items():
        node = node_of(module, packages)
        graph.setdefault(node, set()).update(node_of(d, packages) for d in deps)
        graph[node].discard(node)
    found: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in found:
            found[node] = 1 + max((floor(d) for d in graph[node]), default=-1)
        return found[node]

    for node in graph:
        floor(node)
    return found


def doc_name(node: str) -> str:
    """``dapo_lightning.cli`` -> ``cli/``, ``dapo_lightning.module`` -> ``module.py``, the
    package's own ``__init__`` -> ``__init__.py``."""
    if node == "dapo_lightning":
        return "__init__.py"
    name = node.removeprefix("dapo_lightning.")
    return (
        f"{name}/"
        if (ROOT / "dapo_lightning" / name).is_dir() or name == "callbacks"
        else (f"{name}.py")
    )


def doc_floors(text: str) -> dict[str, int]:
    """The floor table of docs/design.md: name -> row (notes in parentheses dropped)."""
    block = text.split("Each row imports only from rows below it", 1)[1]
    block = block.split("```", 2)[1]
    rows: dict[str, int] = {}
    row = None
    for line in block.splitlines():
        match = re.match(r"^(\d+)\s+(.*)$", line)
        if match:
            row, line = int(match[1]), match[2]
        line = re.sub(r"\([^)]*\)", "", line)
        for name in (n.strip() for n in line.split(",")):
            if name and row is not None:
                if name in rows:
                    raise AssertionError(f"docs/design.md's floors list {name} twice")
                rows[name] = row
    return rows


def render(found: dict[str, int]) -> str:
    rows: dict[int, list[str]] = {}
    for node, row in found.items():
        rows.setdefault(row, []).append(doc_name(node))
    return "\n".join(f"{r}  {', '.join(sorted(rows[r]))}" for r in sorted(rows, reverse=True))


def test_the_floor_table_is_the_import_graph(sources):
    found = {doc_name(node): row for node, row in floors(sources).items()}
    documented = doc_floors(DESIGN.read_text())
    assert "cli/" in documented and "checks.py" in documented  # the table was read
    wrong = {
        name: (documented.get(name), row)
        for name, row in found.items()
        if documented.get(name) != row
    }
    extra = sorted(set(documented) - set(found))
    assert not wrong and not extra, (
        f"docs/design.md's floors differ from the code (name: (doc, code)): {wrong}; in the doc "
        f"but not the code: {extra}. The code's table:\n{render(floors(sources))}"
    )


def test_the_floor_check_finds_a_planted_drift(sources):
    """The check fails on a table that moves one module and on one that names a module that
    does not exist."""
    text = DESIGN.read_text()
    found = {doc_name(node): row for node, row in floors(sources).items()}
    moved = text.replace("\n0  checks.py, ", "\n0  ", 1).replace("\n8  ", "\n8  checks.py, ", 1)
    assert doc_floors(moved)["checks.py"] == 8 != found["checks.py"]
    ghost = doc_floors(text.replace("\n0  checks.py", "\n0  ghost.py, checks.py", 1))
    with pytest.raises(AssertionError, match="list checks.py twice"):
        doc_floors(text.replace("\n8  ", "\n8  checks.py, ", 1))
    assert "ghost.py" in set(ghost) - set(found)


def test_the_layout_names_every_top_level_module(sources):
    """docs/design.md's layout (its first block, the tree) names each top-level module and
    sub-package."""
    layout = DESIGN.read_text().split("## Layout", 1)[1].split("```", 2)[1]  # the tree
    names = {doc_name(n) for n in floors(sources)} - {"__init__.py", "__main__.py"}
    missing = sorted(n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", layout))
    assert not missing, f"modules missing from docs/design.md's layout: {missing}"
