"""The int8 KV cache's layout, which every backend reads: a cache `[num_blocks, block_size, H_kv, D + 4]` of
int8 whose every (slot, KV head) row holds that token's D values for that head, quantized symmetrically
(value ~ q * scale, q in -127..127, scale = the row's absmax / 127), and in its last 4 bytes the scale as a
float32.

Why a scale per slot and head rather than per (block, head): during decode a block fills one token at a
time, so a block scale fixed by its first tokens would clip a larger later one, and requantizing the block
whenever a larger value arrives would round its earlier tokens a second time and turn every write into a
read-modify-write of the whole block. A row's scale is known when the row is written and never changes
(llama.cpp's q8_0 KV and vLLM's CPU int8 KV also scale small groups of one token's values). The scale sits
in the row itself, as a q8_0 block holds its scale beside its values, so a block's scales travel with it
whenever it is swapped or copied, and the pool's bytes count them without a second tensor."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row
QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim(cache: torch.Tensor) -> int:
    """The head dim of a cache's rows: its last dimension, less the scale's bytes in an int8 cache."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows `[..., D]` of any float dtype as int8 rows `[..., D + 4]` (values, then their float32 scale)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / QMAX
    # An all-zero row has scale 0: divide by the smallest normal float instead, which leaves its zeros.
    values = torch.round(x32 / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-QMAX, QMAX)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = values.to(torch.int8)
    rows[..., x.shape[-1] :] = scale.view(torch.int8)
    return rows


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each int8 row `[..., D + 4]`, as `[..., 1]`."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Int8 rows `[..., D + 4]` as float32 `[..., D]`."""
    return rows[..., :-SCALE_BYTES].float() * scales(rows)


def as_float(cache_rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache, in float32: dequantized from an int8 cache, widened from any other."""
    return dequantize(cache_rows) if is_int8(cache_rows) else cache_rows.float()
