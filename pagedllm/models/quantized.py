"""Linear layers and embeddings on GGUF's block-quantized weights, held as stored.

A `QuantizedWeight` is a GGUF tensor's blocks, one row of blocks per output feature. Q4_0, Q4_1, Q8_0 and
the K-quants Q4_K, Q5_K and Q6_K have C kernels (`pagedllm/csrc/quant_ops.c`): few rows (decode) multiply
straight from the blocks (float32, or bf16 dot products where the CPU has AVX512-BF16), many rows (prefill,
big batches) dequantize the weight a tile at a time into the activations' dtype for torch's GEMM. Without a
compiler (or with PAGEDLLM_NATIVE=0) both go through gguf's own dequantization, the portable path: the same
numbers, slower. Where the CPU has AVX512-VNNI, a bf16 model's Q4_0, Q4_1, Q4_K and Q6_K matrices are repacked at
load, 16 rows side by side, and meet every row count in integer dot products (`PackedWeight`). Other
quantized types (Q5_0, Q2_K, the IQ types, ...) have no kernel yet and are dequantized once at load
(`holds_quantized` says which).

Activations and sums stay in float32 on the few-row path, so a float32 model on quantized weights is the
float32 model on the dequantized weights up to summation order.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from pagedllm import native
from pagedllm.models.prepack import packed_linear, prepacked

_KERNELS = {
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k",
    GGMLQuantizationType.Q6_K: "q6_k",
}
# Where in each block its fp16 scales (and minimums) lie.
_SCALE_BYTES = {
    GGMLQuantizationType.Q4_0: slice(0, 2),
    GGMLQuantizationType.Q4_1: slice(0, 4),
    GGMLQuantizationType.Q8_0: slice(0, 2),
    GGMLQuantizationType.Q4_K: slice(0, 4),
    GGMLQuantizationType.Q5_K: slice(0, 4),
    GGMLQuantizationType.Q6_K: slice(208, 210),
}
# Up to this many float32 activation rows, the blocks are multiplied as stored (each weight row expanded once per
# call; from 20 rows on in GEMM-style panels), also in a layer that holds a dense copy; above it, torch's GEMM on
# the copy or on dequantized tiles: the activations no longer stay in L2 across the panels (AVX2 kind: the panels
# 1.04-1.2x faster than the prepacked float32 copy from 16 to 768 rows, level at 1024, 0.95x at 2048;
# docs/PERFORMANCE.md).
FEW_ROWS = 768
# Activations of another dtype (bf16) that no kernel of theirs takes are widened to float32 for the blocks up to
# this many rows only: above it torch's bf16 GEMM on dequantized tiles, native where bf16 is, is the faster.
WIDENED_ROWS = 8
# A layer that holds a bf16 dense copy (bf16 without AVX512-VNNI) multiplies up to this many rows from its
# blocks, and more with the copy.
BLOCK_ROWS = 4
# Up to this many bf16 rows, where the CPU has AVX512-BF16, the blocks are multiplied as stored with bf16
# dot products; above it the tiles below.
BF16_ROWS = 16
# Up to this many bf16 rows, Q4_0, Q4_1 and Q4_K blocks are multiplied through the bf16 table of their 4-bit values
# (`gemm_bf16_lut_*`), above it as the other types.
LUT_ROWS = 4
_LUT_KINDS = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}
# A dequantized tile of a weight, on the many-row path: small enough to stay in a core's L2 cache.
TILE_BYTES = 2 << 20
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def few_rows(dtype: torch.dtype) -> int:
    """Most rows of `dtype` whose product runs on the blocks' float32 kernels (`gemm_*`)."""
    return FEW_ROWS if dtype == torch.float32 else WIDENED_ROWS


def _runs(start: int, count: int) -> list[tuple[int, int]]:
    return [(start + 4 * t, 4) for t in range(count)]


def _q6_k_runs() -> list[tuple[int, int]]:
    """Per half h and quad j: low-nibble bytes 64h + 4j and 64h + 32 + 4j, high-bit bytes 128 + 32h + 4j."""
    return [
        (at, 4)
        for h in range(2)
        for j in range(8)
        for at in (64 * h + 4 * j, 64 * h + 32 + 4 * j, 128 + 32 * h + 4 * j)
    ]


# The types a model's matrices can be repacked in at load, 16 rows side by side: each block as segments
# (offset, size) that `pack_x16` gathers across the 16 rows (the fp16 scales first, so one load reads all 16;
# the values in runs of 4 bytes). quant_ops.c says what each kernel reads where.
_PACKED_SEGMENTS = {
    GGMLQuantizationType.Q4_0: [(0, 2), *_runs(2, 4)],
    GGMLQuantizationType.Q4_1: [(0, 2), (2, 2), *_runs(4, 4)],
    GGMLQuantizationType.Q8_0: [(0, 2), *_runs(2, 8)],
    GGMLQuantizationType.Q4_K: [(0, 2), (2, 2), *((4 + j, 1) for j in range(12)), *_runs(16, 32)],
    # Q5_K: as Q4_K, with the fifth bits (32 bytes: byte l's bit s is value l's of sub-block s) before the nibbles.
    GGMLQuantizationType.Q5_K: [(0, 2), (2, 2), *((4 + j, 1) for j in range(12)), *_runs(16, 8), *_runs(48, 32)],
    GGMLQuantizationType.Q6_K: [(208, 2), *((192 + s, 1) for s in range(16)), *_q6_k_runs()],
}
# The packed types each dtype's integer kernel takes: bf16's on AVX512-VNNI (`gemm_vnni_*`), float32's on AVX2
# (`gemm_x16_*`). Both quantize the activations to int16 per block of 32, which `int16_activations=False`
# declines.
_PACKED_KINDS = {
    torch.bfloat16: {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    },
    torch.float32: {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    },
}
# Activations meet a packed weight in integer dot products at every row count: from one row (bandwidth) to a
# prefill's thousands they measured faster than the dequantized tiles into torch's GEMM, bf16 on AVX512-VNNI and
# float32 on AVX2 (docs/PERFORMANCE.md).
PACK_ROWS = 16
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


def holds_quantized(kind: GGMLQuantizationType) -> bool:
    """Whether weights of this GGUF type stay quantized in memory (a kernel multiplies them)."""
    return kind in _KERNELS


@cache
def library() -> ctypes.CDLL | None:
    lib = native.load("quant_ops.c")
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of quant_ops.c) with its functions' argument types set."""
    gemm, dequant = [_PTR, _I64, _I64, _PTR, _I64, _PTR], [_PTR, _I64, _I64, _PTR]
    lib.has_bf16_gemm.restype = ctypes.c_int
    names = [(f"gemm_{s}", gemm) for s in _KERNELS.values()]
    names += [(f"dequant_{s}_{t}", dequant) for s in _KERNELS.values() for t in _SUFFIXES.values()]
    names += [(name, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]) for name in ("pack_x16", "unpack_x16")]
    lib.has_vnni_gemm.restype = ctypes.c_int
    lib.has_x16_gemm.restype = ctypes.c_int
    if lib.has_vnni_gemm():
        names += [(f"gemm_vnni_{_KERNELS[kind]}", gemm) for kind in _PACKED_KINDS[torch.bfloat16]]
    if lib.has_x16_gemm():
        names += [(f"gemm_x16_{_KERNELS[kind]}", gemm) for kind in _PACKED_KINDS[torch.float32]]
    if lib.has_bf16_gemm():
        names += [(f"gemm_bf16_{s}", gemm) for s in _KERNELS.values()]
        names += [(f"gemm_bf16_lut_{_KERNELS[kind]}", gemm) for kind in _LUT_KINDS]
    for name, argtypes in names:
        kernel = getattr(lib, name)
        kernel.argtypes = argtypes
        kernel.restype = None
    return lib


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """`data` holds `[out_features, bytes per row]` of GGUF blocks of type `kind`; each row is one output
    feature's `in_features` values."""

    kind: GGMLQuantizationType
    data: torch.Tensor  # uint8
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def slice(self, start: int, end: int) -> QuantizedWeight:
        """Rows `start .. end`, sharing this weight's memory."""
        return QuantizedWeight(self.kind, self.data[start:end], self.in_features)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows `index`, in that order: a row's blocks hold that row's values only."""
        return QuantizedWeight(self.kind, self.data[index].contiguous(), self.in_features)

    def check(self, where: str) -> None:
        """Refuse blocks whose scales (and Q4_1's minimums) are not finite: a damaged file."""
        scales = self.data.view(self.out_features, -1, GGML_QUANT_SIZES[self.kind][1])[..., _SCALE_BYTES[self.kind]]
        # A float16 is NaN or inf when its five exponent bits are all set: read from the bits, nothing converted
        # (at every start, for every matrix of the file).
        bad = ((scales.contiguous().view(torch.int16) & 0x7C00) == 0x7C00).nonzero()
        if len(bad):
            row, block = bad[0, 0].item(), bad[0, 1].item()
            raise ValueError(f"{where}: {self.kind.name} block {block} of row {row} has a scale that is NaN or inf")

    def dequantize(self, dtype: torch.dtype, native_ok: bool = True) -> torch.Tensor:
        """The values, `[out_features, in_features]` in `dtype`."""
        lib = library() if native_ok else None
        suffix = _SUFFIXES.get(dtype)
        if lib is None or self.kind not in _KERNELS or suffix is None:
            values = dequantize(self.data.numpy(), self.kind).reshape(self.out_features, self.in_features)
            return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        kernel = getattr(lib, f"dequant_{_KERNELS[self.kind]}_{suffix}")
        kernel(self.data.data_ptr(), self.out_features, self.in_features, out.data_ptr())
        return out


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight repacked for the integer kernel: `data` holds the same bytes as the GGUF blocks,
    each block of `PACK_ROWS` rows side by side (`pack_x16` in quant_ops.c says how)."""

    kind: GGMLQuantizationType
    data: torch.Tensor  # uint8, [out_features, bytes per row] in size only
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def unpacked(self, start: int, end: int) -> QuantizedWeight:
        """Rows `start .. end` (multiples of PACK_ROWS, or `end` the last row) in GGUF's layout, a copy."""
        assert start % PACK_ROWS == 0 and end > start
        return _unpack(self.kind, self.data[start:end].contiguous(), self.in_features)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows `index` in GGUF's layout (a tied embedding's lookups): their groups unpacked, a copy."""
        groups = torch.unique(index // PACK_ROWS)
        by_group = self.data.view(-1, PACK_ROWS, self.data.shape[1])
        unpacked = _unpack(self.kind, by_group[groups].reshape(-1, self.data.shape[1]), self.in_features)
        at = torch.searchsorted(groups, index // PACK_ROWS) * PACK_ROWS + index % PACK_ROWS
        return unpacked.rows(at)


@cache  # read by every packed embedding lookup
def _segments(kind: GGMLQuantizationType) -> tuple[ctypes.Array, int]:
    flat = [value for segment in _PACKED_SEGMENTS[kind] for value in segment]
    return (ctypes.c_int32 * len(flat))(*flat), len(flat) // 2


def _unpack(kind: GGMLQuantizationType, packed: torch.Tensor, in_features: int) -> QuantizedWeight:
    lib = library()
    assert lib is not None
    out = torch.empty_like(packed)
    block, size = GGML_QUANT_SIZES[kind]
    segments, count = _segments(kind)
    lib.unpack_x16(packed.data_ptr(), packed.shape[0], in_features // block, size, segments, count, out.data_ptr())
    return QuantizedWeight(kind, out, in_features)


def has_integer_kernel(dtype: torch.dtype) -> bool:
    """Whether activations of `dtype` meet packed quantized weights in integer dot products here (bf16 on a CPU
    with AVX512-VNNI, float32 with AVX2). Elsewhere every product expands the weights to floats first: above a
    few rows, slower than the dequantized model's prepacked GEMM (`docs/PERFORMANCE.md`)."""
    lib = library()
    if lib is None:
        return False
    if dtype == torch.bfloat16:
        return bool(lib.has_vnni_gemm())
    return dtype == torch.float32 and bool(lib.has_x16_gemm())


def packs_kind(kind: GGMLQuantizationType, dtype: torch.dtype) -> bool:
    """Whether weights of `kind` are repacked for `dtype`'s integer kernel here (a type it has, on a CPU that
    has the kernel), where their rows make whole groups."""
    return kind in _PACKED_KINDS.get(dtype, ()) and has_integer_kernel(dtype)


def packs(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether `weight` can be repacked for `dtype`'s integer kernel here."""
    return weight.out_features % PACK_ROWS == 0 and packs_kind(weight.kind, dtype)


def pack(weight: QuantizedWeight) -> PackedWeight:
    """`weight` repacked (see `packs`) in its own memory, so that a model is never held twice: `weight` is
    consumed, and its blocks must have no other reader."""
    lib = library()
    assert lib is not None and weight.data.is_contiguous()
    data = weight.data
    block, size = GGML_QUANT_SIZES[weight.kind]
    segments, count = _segments(weight.kind)
    lib.pack_x16(
        data.data_ptr(), weight.out_features, weight.in_features // block, size, segments, count, data.data_ptr()
    )
    return PackedWeight(weight.kind, data, weight.in_features)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of one fused matrix (q, k, v or gate, up) stacked by rows; all of one type and width."""
    first = parts[0]
    if any(p.kind != first.kind or p.in_features != first.in_features for p in parts):
        raise ValueError("parts of one fused matrix differ in type or width")
    return QuantizedWeight(first.kind, torch.cat([p.data for p in parts]), first.in_features)


def direct_kernel(weight: QuantizedWeight | PackedWeight, dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """The C kernel that multiplies up to `direct_rows(weight, dtype)` rows of `dtype` by `weight` in one call, reading
    the rows and writing `[rows, out_features]` in `dtype` (`kernel(x, rows, in_features, blocks, out_features,
    y)`): the blocks' float32 kernel, or the dtype's integer kernel on packed weights. None where `matmul` does more
    around its kernel (widens, rounds, tiles)."""
    lib = library()
    if lib is None or weight.kind not in _KERNELS:
        return None
    if isinstance(weight, PackedWeight):
        if not packs_kind(weight.kind, dtype):
            return None
        prefix = "gemm_vnni" if dtype == torch.bfloat16 else "gemm_x16"
        return getattr(lib, f"{prefix}_{_KERNELS[weight.kind]}")
    return getattr(lib, f"gemm_{_KERNELS[weight.kind]}") if dtype == torch.float32 else None


def direct_rows(weight: QuantizedWeight | PackedWeight, dtype: torch.dtype) -> int:
    """Most rows of `dtype` `direct_kernel(weight, dtype)` takes: any number on a packed weight, `FEW_ROWS`
    float32 rows on the blocks as stored (also in a layer with a dense copy)."""
    return FEW_ROWS if dtype == torch.float32 and not isinstance(weight, PackedWeight) else sys.maxsize


def matmul(x: torch.Tensor, weight: QuantizedWeight | PackedWeight) -> torch.Tensor:
    """`x @ W.T` for `x` `[rows, in_features]`, in x's dtype."""
    lib = library()
    if x.shape[0] == 0:
        return x.new_empty((0, weight.out_features))
    kernel = direct_kernel(weight, x.dtype)
    if kernel is not None and x.shape[0] <= direct_rows(weight, x.dtype):
        x, rows = x.contiguous(), x.shape[0]
        out = torch.empty(rows, weight.out_features, dtype=x.dtype)
        kernel(x.data_ptr(), rows, weight.in_features, weight.data.data_ptr(), weight.out_features, out.data_ptr())
        return out
    if isinstance(weight, PackedWeight):
        assert lib is not None
        return _tiled_product(x, weight, lib)
    if lib is None or weight.kind not in _KERNELS:
        return nn.functional.linear(x, weight.dequantize(x.dtype, native_ok=False))
    if x.dtype == torch.bfloat16 and x.shape[0] <= BF16_ROWS and lib.has_bf16_gemm():
        return _bf16_product(x, weight, lib)
    if x.shape[0] > few_rows(x.dtype):
        return _tiled_product(x, weight, lib)
    x32 = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    kernel = getattr(lib, f"gemm_{_KERNELS[weight.kind]}")
    kernel(x32.data_ptr(), x.shape[0], weight.in_features, weight.data.data_ptr(), weight.out_features, out.data_ptr())
    return out.to(x.dtype)


def _bf16_product(x: torch.Tensor, weight: QuantizedWeight, lib: ctypes.CDLL) -> torch.Tensor:
    """`x @ W.T` for bf16 `x` straight from the blocks with the AVX512-BF16 kernel (float32 sums)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    table = weight.kind in _LUT_KINDS and x.shape[0] <= LUT_ROWS
    kernel = getattr(lib, f"gemm_bf16_{'lut_' if table else ''}{_KERNELS[weight.kind]}")
    kernel(x.data_ptr(), x.shape[0], weight.in_features, weight.data.data_ptr(), weight.out_features, out.data_ptr())
    return out.to(torch.bfloat16)


def _tiled_product(x: torch.Tensor, weight: QuantizedWeight | PackedWeight, lib: ctypes.CDLL) -> torch.Tensor:
    """`x @ W.T` as torch GEMMs over tiles of W's rows, each dequantized into x's dtype just before into one
    reused buffer: a tile stays in the cache between the two, and no whole dequantized matrix is ever held.
    A packed weight's tiles are unpacked first (whole groups of rows)."""
    dtype = x.dtype if x.dtype in _SUFFIXES else torch.float32
    rows = max(PACK_ROWS, TILE_BYTES // (weight.in_features * torch.finfo(dtype).bits // 8)) // PACK_ROWS * PACK_ROWS
    x = x.to(dtype)
    out = torch.empty(x.shape[0], weight.out_features, dtype=dtype)
    buffer = torch.empty(min(rows, weight.out_features), weight.in_features, dtype=dtype)
    kernel = getattr(lib, f"dequant_{_KERNELS[weight.kind]}_{_SUFFIXES[dtype]}")
    for start in range(0, weight.out_features, rows):
        end = min(start + rows, weight.out_features)
        tile = weight.unpacked(start, end) if isinstance(weight, PackedWeight) else weight.slice(start, end)
        kernel(tile.data.data_ptr(), end - start, weight.in_features, buffer.data_ptr())
        out[:, start:end] = nn.functional.linear(x, buffer[: end - start])
    return out


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is one or more `QuantizedWeight`s stacked by output rows (a fused
    q/k/v whose parts a GGUF file quantized differently stays in parts). The blocks are plain attributes,
    not parameters: the state dict read from a checkpoint is the rest of the model's. A bias, where the
    layer has one, stays a parameter and loads like any other. With `pack_for` (the model's dtype, unless its
    integer kernels are declined), parts that dtype's integer kernel takes are repacked for it (`packs`)."""

    def __init__(self, parts: list[QuantizedWeight], bias: bool, pack_for: torch.dtype | None = None) -> None:
        super().__init__()
        merged = _merge_alike(parts)
        self.parts = [pack(p) if pack_for is not None and packs(p, pack_for) else p for p in merged]
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.dense: torch.Tensor | None = None

    def hold_dense(self, dtype: torch.dtype) -> None:
        """Hold the weight dequantized to `dtype` too, prepacked for oneDNN, for products of more than
        `FEW_ROWS` float32 rows or `BLOCK_ROWS` of another dtype (where `loader.holds_dense` says so: no integer
        kernel takes `dtype` here)."""
        values = [part.dequantize(dtype) for part in self.parts]
        self.dense = prepacked(values[0] if len(values) == 1 else torch.cat(values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > (FEW_ROWS if x.dtype == torch.float32 else BLOCK_ROWS):
            return packed_linear(x, self.dense, self.bias)
        outs = [matmul(x, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up from quantized rows: only the rows a step asks for are dequantized, into
    the model's `dtype`. Gemma's `scale` as in `decoder.Embedding`. The table is a tied LM head's weight,
    packed, where the head packed it."""

    def __init__(self, table: QuantizedWeight | PackedWeight, dtype: torch.dtype, scale: float | None) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.scale = scale
        self.vocab_start: int | None = None  # never vocabulary-parallel: tensor parallelism dequantizes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids).dequantize(self.dtype)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)
        return out


def _merge_alike(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Neighbouring parts of one type become one weight, so a fused q/k/v of one type is one kernel call."""
    merged: list[list[QuantizedWeight]] = []
    for part in parts:
        if merged and merged[-1][0].kind == part.kind:
            merged[-1].append(part)
        else:
            merged.append([part])
    return [group[0] if len(group) == 1 else concatenate(group) for group in merged]
