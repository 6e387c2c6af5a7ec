"""oneDNN prepacking of bf16 CPU weights: reordered once into oneDNN's blocked layout, because
`F.linear` otherwise repacks the weight on every call (docs/PERFORMANCE.md)."""

from __future__ import annotations

import torch


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's bf16 linear needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU with only AVX2 the
    reorder raises, and bf16 runs through `F.linear`'s emulation instead."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")
    )


def prepacked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in oneDNN's layout, for `torch.ops.mkldnn._linear_pointwise`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)
