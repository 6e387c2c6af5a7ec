"""Engine configuration: one dataclass, validated once, with the defaults a CPU user wants."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_KV_CACHE_MEMORY = 4 << 30  # bytes; the same default as vLLM's CPU backend
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(slots=True)
class EngineConfig:
    model: str | Path | None = None
    dtype: str | torch.dtype = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of CPU memory for blocks swapped out (used when preemption_mode="swap")
    device: str = "cpu"  # "cuda" runs the model and KV cache on the GPU with the Triton kernels

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        resolve_dtype(self.dtype)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int | float) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() or torch.cuda.is_available() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """bf16 pays on the CPU only with hardware support (AVX-512 BF16 or AMX); otherwise it is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
