"""oneDNN prepacking of CPU weights: reordered once into oneDNN's blocked layout, because `F.linear`
otherwise repacks a bf16 weight on every call, and takes a slower GEMM for float32 ones
(docs/PERFORMANCE.md has the figures)."""

from __future__ import annotations

import os

import torch

# oneDNN compiles a GEMM primitive (with its JIT code, ~0.6 MiB each on the default model) for every row
# count and weight shape it sees, and keeps it twice over: in its own cache and in ideep's above it, 1024
# entries each by default. A server meets steps of every size, so those caches grew its heap by ~500 MiB
# over a soak. Capped here, before the process runs its first oneDNN operator (a value already in the
# environment wins): re-creating a primitive costs ~0.5 ms, a step uses five shapes, and 64 entries keep
# the last dozen step sizes; offline throughput was the same as with 1024 (docs/RELIABILITY.md).
PRIMITIVE_CACHE_CAPACITY = 64
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, str(PRIMITIVE_CACHE_CAPACITY))

# The batch size oneDNN picks the blocked layout for. float32, measured on 2 AVX2 cores over the default
# model's five shapes: a hint of 64 serves 8 to 2048 rows within 2% of each size's own best; a hint of 1
# is 1.7x slower at 8 rows. bf16 keeps the hint its figures were measured with.
_BATCH_HINT = {torch.float32: 64, torch.bfloat16: 1}


def can_prepack(weight: torch.Tensor) -> bool:
    """float32 everywhere oneDNN runs; bf16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU
    with only AVX2 oneDNN's bf16 reorder raises, and bf16 runs through `F.linear`'s emulation instead."""
    if weight.device.type != "cpu" or weight.dtype not in _BATCH_HINT or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


def prepacked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in oneDNN's layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT[weight.dtype])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for a weight `prepacked` returned (oneDNN's prepacked GEMM)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
