#!/usr/bin/env bash
# Installs OpenVINO GenAI (with optimum-intel and nncf, to export a Hugging Face folder to OpenVINO IR) into its
# own venv (default: .venv-openvino) for `pagedllm bench throughput --engines openvino --openvino-python
# DIR/bin/python`. torch goes in first, pinned to the CPU build: optimum-intel's export imports it, and an
# unpinned one would pull a CUDA torch.
set -euo pipefail
VENV="${1:-.venv-openvino}"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet torch==2.13.0
"$PY" -m pip install --quiet openvino-genai openvino-tokenizers "optimum-intel[openvino]" nncf
"$PY" -c "import openvino, openvino_genai; print('openvino', openvino.__version__, 'genai', openvino_genai.__version__)"
