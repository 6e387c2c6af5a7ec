"""The KV tensors: one (K, V) pair per layer, `[num_blocks, block_size, num_kv_heads, head_dim]` each."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_memory(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


class CacheEngine:
    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.kv_caches = [
            (zeroed(dims, shape.dtype, device), zeroed(dims, shape.dtype, device)) for _ in range(shape.num_layers)
        ]


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. Zeros matter: attention multiplies padded positions by a weight of 0, and
    0 times leftover garbage (a NaN bit pattern) would poison the output. On the CPU the memory comes
    from numpy's calloc, whose fresh pages the OS zeroes lazily, so a 4 GiB pool costs nothing at start-up."""
    if torch.device(device).type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    num_bytes = torch.empty((), dtype=dtype).element_size()
    for dim in dims:
        num_bytes *= dim
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(dims)
