"""`pagedllm bench flood` end to end on a tiny model that both chats and embeds."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pooling_models import save_embedding_model


def test_bench_flood_times_the_stream_idle_and_beside_the_flood(tmp_path):
    folder = save_embedding_model(tmp_path / "m", "qwen3", "last", lm_head=True)
    command = [sys.executable, "-m", "pagedllm", "bench", "flood", "--model", str(folder), "--dtype", "float32"]
    command += ["--num-documents", "40", "--max-tokens", "64", "--rounds", "1", "--pooling-stretch", "2"]
    log = tmp_path / "out.txt"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=300)
    output = log.read_text()
    assert done.returncode == 0, output
    assert "pooling_stretch 2.0; 40 documents queued" in output
    record = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    assert record["idle"]["tpot_ms"] > 0 and record["flood"]["tpot_ms"] > 0
    assert record["idle"]["pooled_tokens_per_s"] == 0 < record["flood"]["pooled_tokens_per_s"]
    assert record["ratio"] == record["flood"]["tpot_ms"] / record["idle"]["tpot_ms"]
