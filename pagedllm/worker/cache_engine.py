"""The KV tensors: one (K, V) pair per layer, `[num_blocks, block_size, num_kv_heads, head_dim]` each, or in
an int8 cache `[..., head_dim + 4]` (each row's float32 scale after its values: `attention.kv_quant`), so
that swaps and copy-on-write move a block's scales with it."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from pagedllm.attention import kv_quant

KV_CACHE_DTYPES = {"int8": torch.int8}  # besides "auto", the model's dtype


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of the cache tensors: the model's, or torch.int8

    @classmethod
    def of(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, model_dtype: torch.dtype, kv_dtype: str
    ) -> KVShape:
        """The shape of a model's cache in `kv_dtype`: "auto" (the model's dtype) or a key of KV_CACHE_DTYPES."""
        return cls(num_layers, num_kv_heads, head_dim, block_size, KV_CACHE_DTYPES.get(kv_dtype, model_dtype))

    @property
    def row_width(self) -> int:
        """Elements of one (slot, KV head) row: the head dim, and an int8 row's scale bytes."""
        return self.head_dim + (kv_quant.SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * element


class CacheEngine:
    """Owns the KV tensors and the CPU swap space; carries out the block copies and swaps that the
    scheduler decided, before the forward pass."""

    def __init__(
        self, shape: KVShape, num_blocks: int, num_cpu_blocks: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.row_width)
        cpu_dims = (num_cpu_blocks, *dims[1:])
        self.cpu_caches = (
            [
                (zeroed(cpu_dims, shape.dtype, "cpu"), zeroed(cpu_dims, shape.dtype, "cpu"))
                for _ in range(shape.num_layers)
            ]
            if num_cpu_blocks
            else []
        )
        self.kv_caches = [
            (zeroed(dims, shape.dtype, device), zeroed(dims, shape.dtype, device)) for _ in range(shape.num_layers)
        ]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        _copy_between(self.kv_caches, self.cpu_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        _copy_between(self.cpu_caches, self.kv_caches, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        _copy_between(self.kv_caches, self.kv_caches, pairs)


def _copy_between(
    source: list[tuple[torch.Tensor, torch.Tensor]],
    target: list[tuple[torch.Tensor, torch.Tensor]],
    pairs: list[tuple[int, int]],
) -> None:
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
        dst_k.index_copy_(0, dst.to(dst_k.device), src_k.index_select(0, src.to(src_k.device)).to(dst_k.device))
        dst_v.index_copy_(0, dst.to(dst_v.device), src_v.index_select(0, src.to(src_v.device)).to(dst_v.device))


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. Zeros matter: attention multiplies padded positions by a weight of 0, and
    0 times leftover garbage (a NaN bit pattern) would poison the output.

    On the CPU the memory is an anonymous mapping, which the OS zeroes lazily, so a 4 GiB pool costs
    nothing at start-up. The pool hands out fresh blocks in LRU order, so a block's first write faults its
    pages in. The mapping asks for base pages (MADV_NOHUGEPAGE, which also marks it in /proc/PID/smaps as
    the pool: 'nh'): on both AVX512 kinds measured, a first touch of 1 GiB cost 4-6x more with transparent
    huge pages (the kernel compacts memory for each one), and attention read K/V no faster from them. Huge
    pages fault fast only while memory a large process just gave back is still contiguous, which misled a
    start-up probe into them after a server restart: TPOT there was 3x a warm server's
    (docs/PERFORMANCE.md)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    num_bytes = torch.empty((), dtype=dtype).element_size()
    for dim in dims:
        num_bytes *= dim
    if num_bytes == 0:
        return torch.zeros(dims, dtype=dtype)
    # Private: a shared mapping would be zero-filled shmem, which is a file; private anonymous is plain RAM.
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux only; elsewhere base pages anyway
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(dims)
