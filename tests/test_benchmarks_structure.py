"""The layout of benchmarks/ (issue 64): every script runs as ``python -m benchmarks.<name>``
from the repository root, none edits ``sys.path``, none imports another script (what several
share lives in the helper modules, ``benchmarks._common``, ``benchmarks._probe`` and
``benchmarks._shared``: a name that starts with ``_``), and ``benchmarks/README.md`` indexes every
script. Each check is pinned on a planted source it must flag; functions over the library's
60-line limit are listed (printed, not failing).
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
INDEX = BENCH / "README.md"
#: The library's function limit (tests/test_structure.py), lines from ``def`` to the end.
FUNCTION_LIMIT = 60


def benchmark_sources() -> list[Path]:
    """Every ``.py`` file under benchmarks/ (the gitignored ``out/`` aside)."""
    return sorted(p for p in BENCH.rglob("*.py") if "out" not in p.relative_to(BENCH).parts)


def module_name(path: Path) -> str:
    """``benchmarks/roofline.py`` -> ``benchmarks.roofline`` (a package: its folder's name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_helper(module: str) -> bool:
    """A shared helper module: some part below ``benchmarks`` starts with ``_``."""
    return any(part.startswith("_") for part in module.split(".")[1:])


def scripts() -> list[str]:
    """The benchmark scripts' module names (every module that is not a helper or a package's
    ``__init__``)."""
    names = (module_name(p) for p in benchmark_sources() if p.name != "__init__.py")
    return sorted(n for n in names if not is_helper(n))


# ----------------------------------------------------------------------------- the checks
def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def sys_path_edit_nodes(source: str) -> list[ast.stmt | ast.expr]:
    """The nodes that change ``sys.path``: a method call on it (``insert``, ``append``, ...),
    an assignment to it or to an item of it, ``+=``."""
    nodes: list[ast.stmt | ast.expr] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if _is_sys_path(node.func.value):
                nodes.append(node)
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        if any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value))
               for t in targets):  # fmt: skip
            nodes.append(node)
    return nodes


def sys_path_edits(source: str) -> list[int]:
    """Lines of :func:`sys_path_edit_nodes`."""
    return sorted({node.lineno for node in sys_path_edit_nodes(source)})


def script_imports(source: str, script_names: set[str]) -> list[str]:
    """Imports of a benchmark script (not a helper) in ``source``: ``benchmarks.x`` or
    ``from benchmarks import x`` with ``x`` not a helper, a relative import of one, or the old
    bare ``import x`` / ``from x import`` of a name in ``script_names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .x import y
                base = "benchmarks." + base if base else "benchmarks"
            if base == "benchmarks":
                mods = [f"benchmarks.{a.name}" for a in node.names]
            else:
                mods = [base]
        else:
            continue
        for mod in mods:
            top = mod.split(".")[0]
            if top == "benchmarks" and mod != "benchmarks" and not is_helper(mod):
                found.append(mod)
            elif top in script_names:
                found.append(mod)
    return found


def long_functions(source: str, limit: int = FUNCTION_LIMIT) -> list[tuple[str, int]]:
    """``(name, lines from def)`` of every function longer than ``limit`` lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                out.append((node.name, length))
    return out


def _short(names: list[str]) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n in names}


# ----------------------------------------------------------------------------- planted sources
PLANTED_SYS_PATH = """
import sys
from pathlib import Path
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append("benchmarks")
sys.path[0:0] = ["x"]
sys.path += ["y"]
print(sys.path[0])
"""

PLANTED_IMPORTS = """
import smollm2_curve
from quickstart_curve import write_override
from benchmarks.update_throughput import checkpoint_for
from benchmarks import roofline, _common
from . import peer_race
from .peer_race import Recipe
import benchmarks.roofline as r
from benchmarks._common import out_dir
from benchmarks._shared.races import Recipe
from benchmarks import _shared
import json
"""


def test_the_sys_path_check_flags_every_edit_of_a_planted_source():
    assert sys_path_edits(PLANTED_SYS_PATH) == [5, 6, 7, 8]  # reading sys.path is fine
    assert sys_path_edits("import sys\nprint(sys.path)\n") == []


def test_the_import_check_flags_every_script_import_of_a_planted_source():
    found = script_imports(PLANTED_IMPORTS, {"smollm2_curve", "quickstart_curve"})
    assert found == [
        "smollm2_curve",
        "quickstart_curve",
        "benchmarks.update_throughput",
        "benchmarks.roofline",
        "benchmarks.peer_race",
        "benchmarks.peer_race",
        "benchmarks.roofline",
    ]


def test_the_long_function_list_flags_a_planted_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LIMIT))
    assert long_functions(f"def short():\n    pass\n\n\ndef long():\n{body}") == [
        ("long", FUNCTION_LIMIT + 1)
    ]


# ----------------------------------------------------------------------------- the tree
def test_the_layout_is_found():
    assert (BENCH / "__init__.py").exists(), "benchmarks/ must be a package (python -m)"
    names = scripts()
    assert "benchmarks.roofline" in names and "benchmarks.update_throughput" in names
    assert not any(is_helper(n) for n in names)


def test_no_benchmark_edits_sys_path():
    bad = {
        str(p.relative_to(ROOT)): lines
        for p in benchmark_sources()
        if (lines := sys_path_edits(p.read_text()))
    }
    assert not bad, f"sys.path edited (run as python -m benchmarks.<name> instead): {bad}"


def benchmark_path_edits(source: str) -> list[int]:
    """Lines of a test's ``sys.path`` edits that name ``benchmarks``."""
    nodes = sys_path_edit_nodes(source)
    return sorted({n.lineno for n in nodes if "benchmarks" in ast.unparse(n)})


def test_the_test_check_flags_a_planted_test():
    planted = 'import sys\nsys.path.insert(0, str(REPO / "benchmarks"))\nsys.path.append("x")\n'
    assert benchmark_path_edits(planted) == [2]


def test_no_test_puts_benchmarks_on_sys_path():
    bad = {
        p.name: lines
        for p in sorted((ROOT / "tests").glob("*.py"))
        if (lines := benchmark_path_edits(p.read_text()))
    }
    assert not bad, f"tests put benchmarks/ on sys.path (import benchmarks.<name>): {bad}"


def test_no_benchmark_imports_another_benchmark():
    names = set(scripts())
    bare = _short(sorted(names))
    bad = {
        str(p.relative_to(ROOT)): found
        for p in benchmark_sources()
        if (found := script_imports(p.read_text(), bare))
    }
    assert not bad, f"a benchmark imports another (move it to benchmarks/_shared/): {bad}"


def test_benchmarks_are_not_packaged():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    packages = cfg["options"]["packages"].split()
    assert not [p for p in packages if p.split(".")[0] == "benchmarks"]


def test_functions_over_the_limit_are_listed(capsys):
    """Printed, not failing: benchmark functions over the library's 60-line limit."""
    rows = [
        (str(p.relative_to(ROOT)), name, n)
        for p in benchmark_sources()
        for name, n in long_functions(p.read_text())
    ]
    with capsys.disabled():
        print(f"\nbenchmark functions over {FUNCTION_LIMIT} lines: {len(rows)}")
        for path, name, n in sorted(rows, key=lambda r: -r[2]):
            print(f"  {n:4d}  {path}::{name}")


# ----------------------------------------------------------------------------- the index
def indexed_scripts(text: str) -> list[str]:
    """The module of each row of the index's table: its command ``python -m benchmarks.<name>``."""
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    found = []
    for row in rows:
        commands = re.findall(r"python -m (benchmarks(?:\.\w+)+)", row)
        assert commands, f"an index row without its command: {row[:80]}"
        found.append(commands[0])
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading (as tests/test_readme.py computes it)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` to a file or a heading that does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file)")
        elif anchor and anchor not in {
            _slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
        }:
            broken.append(f"{target} (no heading)")
    return broken


def test_the_index_check_reads_a_planted_table():
    planted = (
        "| Script | Question | Command | Results |\n|---|---|---|---|\n"
        "| `a` | why? | `python -m benchmarks.a --quick` | [x](RESULTS.md#x) |\n"
        "| `b` | how? | `python -m benchmarks.races.b` | none |\n"
    )
    assert indexed_scripts(planted) == ["benchmarks.a", "benchmarks.races.b"]
    with pytest.raises(AssertionError, match="without its command"):
        indexed_scripts("| `c` | what? | `python benchmarks/c.py` | none |\n")


def test_the_link_check_flags_a_planted_page(tmp_path):
    (tmp_path / "RESULTS.md").write_text("# Results\n## Compute roofline\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](RESULTS.md#compute-roofline) [gone](RESULTS.md#roofline) [none](NOPE.md)")
    assert broken_links(page) == ["RESULTS.md#roofline (no heading)", "NOPE.md (no file)"]


def test_the_index_names_every_script_once_and_only_scripts():
    indexed = indexed_scripts(INDEX.read_text())
    assert len(indexed) == len(set(indexed)), "a script indexed twice"
    assert not sorted(set(scripts()) - set(indexed)), "scripts missing from benchmarks/README.md"
    assert not sorted(set(indexed) - set(scripts())), "indexed scripts that do not exist"


@pytest.mark.parametrize("page", ["README.md", "RESULTS.md", "JOURNAL.md"])
def test_the_benchmark_pages_links_resolve(page):
    """The index, the current numbers and the journal (README.md's links into RESULTS.md:
    tests/test_readme.py)."""
    assert not broken_links(BENCH / page)


@pytest.mark.parametrize("module", indexed_scripts(INDEX.read_text()) if INDEX.exists() else [])
def test_every_indexed_script_runs_help(module):
    """``python -m benchmarks.<name> --help`` from the repository root: the module imports and
    parses its options (nothing is measured)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout
