"""README.md's commands and Python, run as written on a clean copy of the repository, and those
of the docs pages that took over README sections (:data:`PAGES`: docs/environments.md holds the
own-environment example); every relative link of these pages and docs/cluster.md points at a
file and heading that exist.

The copy holds the repository's files that git tracks or would track (``git ls-files --cached
--others --exclude-standard``: no ``runs/``, no ``.venv/``, nothing built), plus what the set-up
command gives a fresh clone: ``.venv`` (a link to the environment running the tests) and the
``dapo_lightning.callbacks`` mapping of the editable install (a link). ``PYTHONPATH`` points at
the copy, so its code is what runs; ``PATH`` has no ``.venv/bin`` unless the README activates it.

Every ``bash`` block line and every ``python`` block is checked by the first rule that matches
(:func:`plan`); a line no rule covers fails the test, so a new README command needs a rule here:

===========================================  ==============================================
README line                                  what the test runs
===========================================  ==============================================
``bash scripts/X.sh ...``                    ``bash -n`` (syntax) and the script exists: these
                                             set up a venv, run the suite or the whole quickstart
``source .venv/bin/activate``                puts ``.venv/bin`` on PATH for the lines after it
``... dapo-lightning fit --help`` or any     as written
command with ``--help`` / ``--model.help``
/ ``--data.help`` / ``--print_config``
``... dapo-lightning fit/sft ...``           the same line plus ``--print_config`` (every key and
                                             config file must parse; training is too heavy)
``... dapo-lightning validate/plot/export``  as written, on the quickstart run the test makes
on ``configs/quickstart.yaml`` / runs/       first (2 updates of the tiny model)
``... dapo-lightning make-model ...``        ``make-model --help`` (it writes a 135M model)
``[.venv/bin/]python [-m] benchmarks...``    the same plus ``--help``
``python`` block                             as a script file in the copy, unless its first
                                             line is ``# not run by tests/test_readme.py: WHY``
===========================================  ==============================================

Environment assignments before a command (``OMP_NUM_THREADS=2 .venv/bin/...``) are kept. The
extraction and the rules are checked without running anything (fast); the run on the copy is
``slow`` (``bash scripts/test.sh tests/test_readme.py -m slow``: minutes, two tiny fits).

Fast too: every import line the README shows (its ``python`` blocks' and the inline ones) runs in
a fresh interpreter, and the README stays a front page (issue 55): at most
:data:`MAX_README_LINES` lines, the picture of module, contract, data and engine near the top, one
results table whose rows link to their measurements and whose decimals are benchmarks/RESULTS.md's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._harness import write_run_config

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: The pages whose ``bash`` / ``python`` blocks run: the README first, then the docs pages that
#: took over its sections (issue 42), checked by the same rules.
PAGES = [README] + [REPO / "docs" / n for n in ("sampling.md", "objectives.md", "environments.md",
                                              "running.md")]  # fmt: skip
VENV = Path(sys.executable).parent.parent
SKIP_MARK = "# not run by tests/test_readme.py:"
#: ``--config`` files the quickstart run of the copy serves for validate / plot / export.
QUICKSTART = "configs/quickstart.yaml"


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    page: str = "README.md"  # relative to the repository root


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced ``bash`` / ``sh`` / ``python`` blocks of ``text``, in order."""
    blocks = []
    for match in re.finditer(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M):
        if match[1] in ("bash", "sh", "python"):
            line = text.count("\n", 0, match.start()) + 1
            lang = "python" if match[1] == "python" else "bash"
            blocks.append(Block(lang, match[2], line, page))
    return blocks


def page_blocks() -> list[Block]:
    """The blocks of every page of :data:`PAGES`, the README's first."""
    return [b for p in PAGES for b in readme_blocks(p.read_text(), str(p.relative_to(REPO)))]


def shell_lines(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = block.text.replace("\\\n", " ")
    out = []
    for raw in joined.splitlines():
        words = shlex.split(raw, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


@dataclass(frozen=True)
class Step:
    rule: str
    argv: list[str]  # what runs (empty: nothing to run)
    env: dict[str, str]


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, value = words[0].split("=", 1)
        env[key] = value
        words = words[1:]
    return env, words


def plan(command: str) -> Step:
    """What the test runs for one README command (the rules of the module docstring)."""
    env, words = _split_env(shlex.split(command))
    prog = words[0] if words else ""
    if prog == "bash" and len(words) > 1 and words[1].startswith("scripts/"):
        return Step("script: syntax only", ["bash", "-n", words[1]], env)
    if words[:2] == ["source", ".venv/bin/activate"]:
        return Step("activate", [], env)
    if prog.endswith("python") and "benchmarks" in " ".join(words[1:3]):
        return Step("benchmark: --help", [*words, "--help"], env)
    if Path(prog).name == "dapo-lightning":
        sub = words[1] if len(words) > 1 else ""
        helpish = {"--help", "-h", "--model.help", "--data.help", "--print_config"}
        if helpish & set(words) or sub in ("", "--help"):
            return Step("help: as written", words, env)
        if sub == "make-model":
            return Step("make-model: --help", [prog, sub, "--help"], env)
        if sub in ("fit", "sft"):
            return Step(f"{sub}: --print_config", [*words, "--print_config"], env)
        on_quickstart = sub in ("plot", "export") or QUICKSTART in words
        if sub in ("validate", "plot", "export") and on_quickstart:
            return Step("quickstart run: as written", words, env)
        if sub == "validate":
            return Step("validate: --print_config", [*words, "--print_config"], env)
    raise AssertionError(
        f"no rule in tests/test_readme.py for the README command {command!r}: add one"
    )


def python_blocks() -> list[Block]:
    return [b for b in page_blocks() if b.lang == "python"]


def commands() -> list[str]:
    return [c for b in page_blocks() if b.lang == "bash" for c in shell_lines(b)]


# ----------------------------------------------------------------------------- fast: the rules
def test_the_readme_has_the_blocks_a_new_user_runs_first():
    cmds = commands()
    assert cmds[0] == "bash scripts/quickstart.sh"  # the README opens with what a user runs
    for sub in ("plot", "export", "validate", "fit"):
        assert any(f"dapo-lightning {sub}" in c for c in cmds), sub
    assert python_blocks(), "the README's Python example"


def test_every_readme_command_has_a_rule():
    steps = [plan(c) for c in commands()]
    assert all(s.rule for s in steps)
    assert plan("OMP_NUM_THREADS=2 .venv/bin/dapo-lightning fit --config x.yaml") == Step(
        "fit: --print_config",
        [".venv/bin/dapo-lightning", "fit", "--config", "x.yaml", "--print_config"],
        {"OMP_NUM_THREADS": "2"},
    )
    with pytest.raises(AssertionError, match="no rule"):
        plan("rm -rf runs")


def test_bare_commands_come_after_an_activation():
    """``dapo-lightning`` alone is not on the PATH after the set-up: the README must write
    ``.venv/bin/dapo-lightning`` (as the scripts do) or activate the venv first."""
    active = False
    for command in commands():
        active = active or command.startswith("source .venv/bin/activate")
        _, words = _split_env(shlex.split(command))
        assert active or words[0] != "dapo-lightning", command


def test_python_examples_that_train_have_the_main_guard():
    for block in python_blocks():
        if ".fit(" in block.text:
            assert 'if __name__ == "__main__":' in block.text, f"{block.page} line {block.line}"


def test_the_moved_examples_are_on_their_pages():
    """The own-environment example runs from docs/environments.md (tests/test_envs.py reads it
    there); the README keeps the Python fit and the own-objective example."""
    pages = {b.page for b in python_blocks()}
    assert {"README.md", "docs/environments.md"} <= pages
    assert any(b.text.startswith("# my_envs.py") for b in python_blocks())
    readme = [b.text for b in python_blocks() if b.page == "README.md"]
    assert any(".fit(" in t for t in readme) and any("my_objectives.py" in t for t in readme)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_point_at_files_and_headings_that_exist():
    pages = [*PAGES, REPO / "docs" / "cluster.md", REPO / "benchmarks" / "RESULTS.md"]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https: and the like
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no file)")
            elif anchor and dest.suffix == ".md":
                heads = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no heading)")
    assert not broken, "\n".join(broken)


#: The names the README's picture (near its top) shows: the module, the contract, the data side,
#: the engine, and what passes between them.
PICTURE_NAMES = ("DAPOModule", "PolicyHandle", "RolloutChannel", "DAPODataModule", "RolloutEngine",
                 "RolloutBatch")  # fmt: skip
MAX_README_LINES = 250


def readme_import_lines(text: str) -> list[str]:
    """Every import line the README shows: those of its ``python`` blocks (top level, as a
    reader copies them) and the inline code spans that are an import statement."""
    lines = [
        line.split("#")[0].strip()
        for block in readme_blocks(text)
        if block.lang == "python"
        for line in block.text.splitlines()
        if re.match(r"(from [\w.]+ )?import \w", line)
    ]
    return lines + re.findall(r"`((?:from [\w.]+ )?import \w[^`]*)`", text)


def results_rows(text: str) -> list[list[str]]:
    """The cells of the table under ``## Results`` (header and rule rows left out)."""
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def test_every_import_line_the_readme_shows_imports():
    """Each import line of the README runs in a fresh interpreter (nothing imported before it),
    so a renamed or moved public name fails here, not only in the slow run of the examples."""
    lines = readme_import_lines(README.read_text())
    assert "from dapo_lightning.callbacks import DAPOCallback" in lines  # the inline one
    assert "from dapo_lightning import register_policy_objective" in lines
    assert len(lines) >= 10, lines
    proc = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_is_a_front_page():
    """At most MAX_README_LINES lines; the picture of module <-> contract <-> data <-> engine
    near the top; one results table whose every row links to its measurement, and whose
    decimals are copied from benchmarks/RESULTS.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    picture = re.search(r"^```text\n(.*?)^```", text, flags=re.S | re.M)
    assert picture and text.count("\n", 0, picture.start()) < 20, "the picture, near the top"
    assert len(picture[1].splitlines()) == 5
    for name in PICTURE_NAMES:
        assert name in picture[1], name
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"^\|---", section, flags=re.M)) == 1, "one results table"
    rows = results_rows(text)
    assert len(rows) >= 8
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    for what, result, where in rows:
        assert "](benchmarks/RESULTS.md#" in where or "](docs/" in where, what
        for number in re.findall(r"\d+\.\d+", f"{what} {result}"):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", results), (what, number)
    assert any("sandboxed Python tool (issue 56)" in what for what, _, _ in rows)


# ----------------------------------------------------------------------------- slow: the runs
def _copy_repository(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(VENV)
    (dest / "dapo_lightning" / "callbacks").symlink_to("../callbacks")
    return dest


def _env(copy: Path, extra: dict[str, str], activated: bool) -> dict[str, str]:
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV / "bin"]
    if activated:
        path.insert(0, str(copy / ".venv" / "bin"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": os.pathsep.join(path), "PYTHONPATH": str(copy),
            "TOKENIZERS_PARALLELISM": "false", **extra}  # fmt: skip


def _run(argv: list[str], copy: Path, env: dict[str, str], timeout: int = 600):
    return subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


def write_tiny_run(path: Path) -> Path:
    """The quickstart run validate / plot / export work on: 2 updates of the tiny random model
    (its answers are never right, so dynamic sampling is off and a length reward gives signal):
    the harness's base run config."""
    return write_run_config(
        path,
        create_model_if_missing={"kind": "tiny", "path": "model"},
        trainer={"max_steps": 2, "val_check_interval": 1},
        data={"init_args": {"reward": {"class_path": "_length_reward.EvenLengthReward"}}},
    )


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The clean copy, with ``runs/quickstart`` made by a 2-update fit of the quickstart."""
    dest = _copy_repository(tmp_path_factory.mktemp("clone"))
    write_tiny_run(dest / "tiny_run.yaml")
    shutil.copy2(REPO / "tests" / "_length_reward.py", dest / "_length_reward.py")
    argv = [".venv/bin/dapo-lightning", "fit", "--config", QUICKSTART, "--config", "tiny_run.yaml"]
    proc = _run(argv, dest, _env(dest, {}, activated=False), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (dest / "runs" / "quickstart" / "checkpoints" / "last.ckpt").exists()
    return dest


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_commands_run_as_written_on_a_clean_copy(copy):
    activated, failures = False, []
    for command in commands():
        step = plan(command)
        activated = activated or step.rule == "activate"
        if not step.argv:
            continue
        proc = _run(step.argv, copy, _env(copy, step.env, activated))
        if proc.returncode != 0:
            failures.append(f"{command}\n  ({step.rule}) exit {proc.returncode}: "
                            f"{(proc.stderr or proc.stdout)[-1500:]}")  # fmt: skip
    assert not failures, "\n".join(failures)
    assert (copy / "runs" / "quickstart" / "metrics.png").stat().st_size > 10_000
    assert (copy / "runs" / "quickstart" / "hf" / "model.safetensors").exists()
    assert (copy / "runs" / "quickstart" / "logs-validate").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_python_runs_as_written_and_a_missing_guard_is_named(copy):
    for i, block in enumerate(python_blocks()):
        if block.text.startswith(SKIP_MARK):
            continue
        script = copy / f"readme_example_{i}.py"
        script.write_text(block.text)
        proc = _run([sys.executable, script.name], copy, _env(copy, {}, False), timeout=1800)
        assert proc.returncode == 0, f"{block.page} line {block.line}:\n{proc.stderr[-4000:]}"
    (example,) = [b for b in python_blocks() if ".fit(" in b.text][:1]
    head, body = example.text.split('if __name__ == "__main__":', 1)
    body = body.split("\n", 1)[1]  # the guard line's comment
    unguarded = copy / "readme_unguarded.py"
    unguarded.write_text(head + textwrap.dedent(body))
    proc = _run([sys.executable, unguarded.name], copy, _env(copy, {}, False), timeout=1800)
    assert proc.returncode != 0
    assert "MissingMainGuardError" in proc.stderr  # the worker's own error
    assert 'put the training code under `if __name__ == "__main__":`' in proc.stderr
    assert "ended before it started" in proc.stderr  # the parent's, not "did not start within"
