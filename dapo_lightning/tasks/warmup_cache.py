"""A cache of warmed-up model folders: the quickstart's warm-up is a deterministic fit, so one
run of it per settings serves every later caller.

Off unless ``DAPO_LIGHTNING_WARMUP_CACHE`` names a folder (the test suite sets it to one folder
per test run, shared by its pytest-xdist workers and the command lines they start). A folder is
looked up by :func:`cache_key`: the warm-up's settings, the source of the modules that compute
it and the torch and transformers versions, so a change to any of them warms up again.

Safe between processes: the first caller of a key builds it under an exclusive ``flock`` while
the others wait on it, and a built folder appears by an atomic rename, so a caller never sees
half a folder. Each build appends a line to ``builds.log`` in the cache folder (what the test
suite reads to check that the warm-up ran once).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import transformers

#: The environment variable naming the cache folder; unset or empty: no cache.
CACHE_ENV = "DAPO_LIGHTNING_WARMUP_CACHE"


def cache_folder() -> Path | None:
    """The folder ``DAPO_LIGHTNING_WARMUP_CACHE`` names, or None when it is unset or empty."""
    value = os.environ.get(CACHE_ENV, "")
    return Path(value) if value else None


def cache_key(settings: dict[str, Any], modules: Iterable[str]) -> str:
    """A 16-hex-digit key of ``settings`` (JSON-serialisable), the source files of
    ``modules`` (imported module names) and the torch and transformers versions."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode())
    for name in sorted(modules):
        digest.update(Path(sys.modules[name].__file__).read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


def cached_build(
    path: str | Path,
    key: str,
    build: Callable[[Path], Any],
    report: Callable[[str], None] | None = None,
) -> Path:
    """Write the folder ``build(folder)`` writes at ``path``: built into the cache under ``key``
    the first time, copied from it after (:func:`cache_folder`; no cache: ``build(path)``)."""
    path = Path(path)
    root = cache_folder()
    if root is None:
        build(path)
        return path
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per key; the others wait here
        if entry.is_dir():
            if report is not None:
                report(f"taken from the warm-up cache {entry} (the same settings and code)")
        else:
            t0 = time.monotonic()
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
            try:
                build(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.rename(tmp, entry)
            with open(root / "builds.log", "a") as log:
                log.write(f"{key} {time.monotonic() - t0:.1f} s pid {os.getpid()}\n")
    shutil.copytree(entry, path, dirs_exist_ok=True)
    return path
