"""The KV tensors: one (K, V) pair per layer, `[num_blocks, block_size, num_kv_heads, head_dim]` each, or in
an int8 cache `[..., head_dim + 4]` (each row's float32 scale after its values: `attention.kv_quant`), so
that swaps and copy-on-write move a block's scales with it.

That shape is a view: the memory holds each block head-major, `[num_blocks, num_kv_heads, block_size, row]`,
so that one KV head's rows of a block are one contiguous run (4 KB for the default model) which a decode
step's attention reads as a stream, instead of a third of every 768-byte position row (docs/PERFORMANCE.md,
"Decode attention reads a block head by head"). Whatever reads or writes the caches goes through their
strides or their indexing, never a `view` of the slots."""

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
        self.cpu_caches = (
            [
                (kv_tensor(shape, num_cpu_blocks, "cpu"), kv_tensor(shape, num_cpu_blocks, "cpu"))
                for _ in range(shape.num_layers)
            ]
            if num_cpu_blocks
            else []
        )
        self.kv_caches = [
            (kv_tensor(shape, num_blocks, device), kv_tensor(shape, num_blocks, device))
            for _ in range(shape.num_layers)
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


def kv_tensor(shape: KVShape, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """One layer's K or V cache: `[num_blocks, block_size, num_kv_heads, row_width]`, stored head-major."""
    storage = zeroed((num_blocks, shape.num_kv_heads, shape.block_size, shape.row_width), shape.dtype, device)
    return storage.transpose(1, 2)


def stored_layout(cache: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` `[blocks, block_size, H_kv, row]` laid out as `kv_tensor` lays out the engine's (for
    tests and benchmarks that build caches by hand)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


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
