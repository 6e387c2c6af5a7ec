"""The KV tensors: one (K, V) pair per layer, `[num_blocks, block_size, num_kv_heads, head_dim]` each."""

from __future__ import annotations

from dataclasses import dataclass

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
        # `empty`, not `zeros`: pages are touched on first write, so start-up does not pay for the whole pool.
        self.kv_caches = [
            (torch.empty(dims, dtype=shape.dtype, device=device), torch.empty(dims, dtype=shape.dtype, device=device))
            for _ in range(shape.num_layers)
        ]
