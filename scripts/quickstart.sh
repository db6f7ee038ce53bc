#!/usr/bin/env bash
# Set-up (when needed) and the main job: DAPO on the built-in arithmetic task, on CPU, with a
# tiny model the project writes itself (nothing is downloaded). Extra arguments go to the CLI,
# e.g. `bash scripts/quickstart.sh --seed_everything 1`. Threads: the CLI's default
# (`--threads auto`: one for the tiny model, dapo_lightning/threads.py); OMP_NUM_THREADS or
# `--threads N` override it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/dapo-lightning fit --config configs/quickstart.yaml "$@"
