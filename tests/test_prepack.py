"""oneDNN's primitive caches are bounded: a process that meets GEMMs of every row count (a server's steps)
keeps a few dozen compiled primitives, not one per size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pagedllm.models.prepack import PRIMITIVE_CACHE_CAPACITY

# Prepacks the default model's four layer shapes and runs each at 240 row counts, in a fresh process (the
# caches are per process, and read their capacity once); prints the heap's growth in MiB.
_GROWTH = """
import json, torch
from pagedllm.models.prepack import can_prepack, prepacked

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

dtype = torch.bfloat16 if can_prepack(torch.empty(1, dtype=torch.bfloat16)) else torch.float32
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
weights = [prepacked(torch.randn(out, inp, dtype=dtype)) for out, inp in shapes]
inputs = {inp: torch.randn(256, inp, dtype=dtype) for _, inp in shapes}
torch.ops.mkldnn._linear_pointwise(inputs[576][:1], weights[0], None, "none", [], "")
before = rss_mib()
for rows in range(17, 257):
    for (_, inp), weight in zip(shapes, weights):
        torch.ops.mkldnn._linear_pointwise(inputs[inp][:rows], weight, None, "none", [], "")
print(json.dumps(rss_mib() - before))
"""


def _heap_growth_mib(capacity: int | None) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = str(capacity)
    done = subprocess.run([sys.executable, "-c", _GROWTH], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_gemms_of_every_row_count_keep_a_bounded_heap():
    bounded = _heap_growth_mib(None)  # pagedllm's own cap
    unbounded = _heap_growth_mib(1024)  # oneDNN's and ideep's default
    assert PRIMITIVE_CACHE_CAPACITY < 960  # 240 sizes x 4 shapes would all fit otherwise
    # The primitives' size depends on the kind: float32 ones on the AVX2 kind grew the heap 97-128 MiB capped and
    # about 600 MiB uncapped (bf16 ones on the AVX512 kinds stayed under 100 MiB capped).
    assert bounded < 200, f"the heap grew {bounded:.0f} MiB over 960 GEMM primitives"
    assert unbounded > 2 * bounded, f"capped {bounded:.0f} MiB, uncapped {unbounded:.0f} MiB: is the cap read?"


def test_a_capacity_in_the_environment_wins():
    env = dict(os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY="7", LRU_CACHE_CAPACITY="7")
    code = "import os, pagedllm.models.prepack; print(os.environ['LRU_CACHE_CAPACITY'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "7", done.stderr
