"""The warm-up cache (dapo_lightning/tasks/warmup_cache.py): one build per key and run, shared
between processes, never half a folder; the quickstart's warm-up through it is the same model."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_lightning.tasks.arithmetic_warmup import make_quickstart_checkpoint
from dapo_lightning.tasks.warmup_cache import CACHE_ENV, cache_key, cached_build

#: Two processes racing for one key: each builds through the cache (a build of 2 s that counts
#: itself in a file), then prints the sha256 of what it got.
RACER = """
import hashlib, sys, time
from pathlib import Path
from dapo_lightning.tasks.warmup_cache import cached_build

def build(folder):
    with open(sys.argv[2], "a") as calls:
        calls.write("built\\n")
    time.sleep(2)
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 4096)

out = cached_build(Path(sys.argv[1]), "racekey", build)
print(hashlib.sha256((out / "weights.bin").read_bytes()).hexdigest())
"""


def _digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_two_processes_racing_for_a_key_build_it_once(tmp_path):
    env = {CACHE_ENV: str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    calls = tmp_path / "calls.txt"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path / f"out{i}"), str(calls)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    want = hashlib.sha256(bytes(range(256)) * 4096).hexdigest()
    assert outs == [want, want]
    assert calls.read_text() == "built\n"  # the second process waited and copied
    log = (tmp_path / "cache" / "builds.log").read_text().splitlines()
    assert len(log) == 1 and log[0].startswith("racekey ")


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    def broken(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt  # a Ctrl-C in the middle of the warm-up

    with pytest.raises(KeyboardInterrupt):
        cached_build(tmp_path / "a", "k", broken)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k.lock"]
    cached_build(tmp_path / "b", "k", lambda f: (f / "w.bin").write_bytes(b"ok"))
    assert (tmp_path / "b" / "w.bin").read_bytes() == b"ok"


def test_no_cache_folder_builds_in_place(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    cached_build(tmp_path / "m", "k", lambda f: f.mkdir() or (f / "w.bin").write_bytes(b"1"))
    assert (tmp_path / "m" / "w.bin").read_bytes() == b"1" and not (tmp_path / "k").exists()


def test_the_key_changes_with_the_settings_and_the_code(monkeypatch):
    one = cache_key({"seed": 0}, ["dapo_lightning.tasks.warmup_cache"])
    assert one == cache_key({"seed": 0}, ["dapo_lightning.tasks.warmup_cache"])
    assert one != cache_key({"seed": 1}, ["dapo_lightning.tasks.warmup_cache"])
    assert one != cache_key({"seed": 0}, ["dapo_lightning.tasks.warmup_cache", "pytest"])


def test_the_cached_warmup_is_the_warmup(tmp_path, monkeypatch):
    """A short warm-up built without the cache, into it, and copied from it: the same bytes,
    and the copy reports where it came from instead of warming up again."""
    kwargs = dict(sums_steps=3, steps=4, num_prompts=10)
    monkeypatch.delenv(CACHE_ENV, raising=False)
    plain = make_quickstart_checkpoint(tmp_path / "plain", **kwargs)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    built = make_quickstart_checkpoint(tmp_path / "built", **kwargs)
    lines: list[str] = []
    copied = make_quickstart_checkpoint(tmp_path / "copied", report=lines.append, **kwargs)
    assert _digest(plain) == _digest(built) == _digest(copied)
    assert len(lines) == 1 and lines[0].startswith("taken from the warm-up cache "), lines
    other = make_quickstart_checkpoint(tmp_path / "other", seed=1, **kwargs)
    assert _digest(other) != _digest(plain)
    assert len((tmp_path / "cache" / "builds.log").read_text().splitlines()) == 2
