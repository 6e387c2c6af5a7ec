#!/usr/bin/env bash
# `pagedllm serve` against `vllm serve` on the embedded default model, the same load from `pagedllm bench serve`:
# for each engine and each request rate (all at once, 2/s), a fresh server's first run (no warm-up requests)
# and then a warm run (8 warm-up requests first); the ready time of each start; peak RSS of each server's
# processes (VmHWM, summed over the server and its children: vLLM's API server and engine core, pagedllm's
# server and engine core). Writes OUT_DIR/*.json and prints a markdown table.
#   scripts/bench_serve_vs_vllm.sh [OUT_DIR]      (VLLM_PYTHON: vLLM's CPU wheel, default .venv-vllm/bin/python;
#                                                 ENGINES: default "pagedllm vllm")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench-serve-out}"
VLLM_PYTHON="${VLLM_PYTHON:-.venv-vllm/bin/python}"
PORT="${PORT:-8391}"
LOAD=(--num-prompts 64 --input-len 200 --max-tokens 128 --ignore-eos)
mkdir -p "$OUT"
PY=.venv/bin/python
FOLDER=$($PY -c "from pagedllm.models.loader import resolve_model_folder; print(resolve_model_folder(None))")
# vLLM computes in the dtype pagedllm's "auto" picks here: bf16 where the CPU has bf16 instructions, else float32
# (bf16 is emulated there, several times slower).
DTYPE=$($PY -c "from pagedllm.config import resolve_dtype; print(str(resolve_dtype('auto')).removeprefix('torch.'))")
ENGINES="${ENGINES:-pagedllm vllm}"

start_server() {  # ENGINE -> sets SERVER_PID; the server's output goes to a file, never a pipe
    local engine=$1 log="$OUT/$1-server.log"
    if [ "$engine" = pagedllm ]; then
        .venv/bin/pagedllm serve --port "$PORT" >>"$log" 2>&1 &
    else
        # vLLM's best configuration on 2 cores (docs/VLLM_CPU.md): both cores bound, none reserved.
        OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
            "$VLLM_PYTHON" scripts/vllm_serve.py "$FOLDER" --port "$PORT" --dtype "$DTYPE" >>"$log" 2>&1 &
    fi
    SERVER_PID=$!
    local started=$SECONDS
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$SERVER_PID" || { echo "$engine exited; see $log" >&2; exit 1; }
        sleep 0.2
    done
    echo "$engine ready in $((SECONDS - started)) s" | tee -a "$OUT/ready.txt"
}

peak_rss_mb() {  # PID: VmHWM of it and its descendants, summed
    local total=0 pid
    for pid in $1 $(pgrep -P "$1") $(for c in $(pgrep -P "$1"); do pgrep -P "$c"; done); do
        total=$((total + $(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)))
    done
    echo $((total / 1024))
}

stop_server() {
    echo "$1 peak RSS $(peak_rss_mb "$SERVER_PID") MB" | tee -a "$OUT/rss.txt"
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
}

bench() {  # ENGINE RATE WARMUPS: the warm run draws other prompts (--seed 1), so no prompt is a prefix-cache hit
    .venv/bin/pagedllm bench serve --base-url "http://127.0.0.1:$PORT" "${LOAD[@]}" --request-rate "$2" \
        --num-warmups "$3" --seed "$(( $3 > 0 ))" --json "$OUT/$1-rate$2-warm$3.json" >"$OUT/$1-rate$2-warm$3.txt"
}

: >"$OUT/ready.txt"
: >"$OUT/rss.txt"
for engine in $ENGINES; do
    for rate in inf 2; do
        start_server "$engine"
        bench "$engine" "$rate" 0
        bench "$engine" "$rate" 8
        stop_server "$engine"
    done
done

$PY - "$OUT" <<'PYTHON'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| engine | rate (req/s) | warm-up | output tok/s | mean TTFT (ms) | median TTFT (ms) | mean TPOT (ms) | median TPOT (ms) |")
print("|---|---|---|---|---|---|---|---|")
for engine in ("pagedllm", "vllm"):
    for rate in ("inf", "2"):
        for warm in ("0", "8"):
            if not (out / f"{engine}-rate{rate}-warm{warm}.json").exists():
                continue
            r = json.loads((out / f"{engine}-rate{rate}-warm{warm}.json").read_text())
            label = "none (fresh server)" if warm == "0" else "8 requests"
            print(f"| {engine} | {rate} | {label} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | "
                  f"{r['median_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['median_tpot_ms']:.1f} |")
PYTHON
cat "$OUT/ready.txt" "$OUT/rss.txt"
