#!/usr/bin/env bash
# Set-up (when needed) and the test suite. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m slow          # the slow tests CI skips
#   bash scripts/test.sh tests/test_loss.py
# With no arguments: the tests CI runs (not slow), one pytest-xdist worker per core
# (`-n auto`), each test file on one worker (`--dist loadfile`: a file's tests share fixtures).
# The 25 slowest tests are listed at the end (CI has a 25-minute budget).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Threads: the library's default (dapo_lightning/threads.py; tests/conftest.py applies it in
# process); set OMP_NUM_THREADS to override it.
export TOKENIZERS_PARALLELISM=false
if [ $# -eq 0 ]; then set -- -m "not slow" -n auto --dist loadfile --durations=25; fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when a marker selection collects nothing: that is not a failure.
if [ $rc -eq 5 ]; then rc=0; fi
exit $rc
