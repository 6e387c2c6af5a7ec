"""Which attention backend runs where, and the calls the rest of the project makes.

Backends, each a module whose `attend` takes one `AttentionCall` (its semantics, window and soft-cap
included, are documented there), wrapped by `get_backend` in the public `Backend` call: "triton" (the
GPU default, imported on first use because triton is optional on the CPU), "cpu" (the C kernel; tensors or
machines it cannot take go to torch), "torch" (the fallback without a compiler) and "reference" (for
tests)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.attention import cpu, kv_quant, reference, torch_ops
from pagedllm.attention.metadata import AttentionCall, AttentionMetadata, Backend

Attend = Callable[[AttentionCall], torch.Tensor]


def _c_kernel_or_torch(call: AttentionCall) -> torch.Tensor:
    return (cpu.attend if cpu.supports(call.query, call.k_cache, call.v_cache) else torch_ops.attend)(call)


def _public(attend: Attend) -> Backend:
    """`attend` called as a `Backend`: the fields of its `AttentionCall` in order, window and softcap by name."""

    def backend(*fields: Any, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return attend(AttentionCall(*fields, window=window, softcap=softcap))

    return backend


# The CPU default, one object so that a caller can tell it apart (models/lean.py calls its C kernel directly).
CPU_BACKEND = _public(_c_kernel_or_torch)


def get_backend(name: str | None, device: torch.device | str, *, partition_size: int | None = None) -> Backend:
    """The backend called `name`, or the device's default: "triton" on CUDA, "cpu" elsewhere.
    `partition_size` belongs to the Triton decode kernels (the context length of one v2 partition, and an
    input of the v1/v2 choice); the CPU backends attend to the whole context at once and ignore it."""
    name = name or ("triton" if torch.device(device).type == "cuda" else "cpu")
    if name == "triton":
        from pagedllm.attention import triton_ops

        if partition_size is None:
            return _public(triton_ops.attend)
        return _public(functools.partial(triton_ops.attend, partition_size=partition_size))
    if name == "cpu":
        return CPU_BACKEND
    backends: dict[str, Attend] = {"torch": torch_ops.attend, "reference": reference.attend}
    if name not in backends:
        raise ValueError(f"backend must be 'reference', 'torch', 'cpu' or 'triton', got {name!r}")
    return _public(backends[name])


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V at its slot (`block * block_size + offset`); a negative slot is padding. An
    int8 cache gets each row quantized with its scale (`kv_quant`), on any device."""
    if k_cache.is_cuda and not kv_quant.is_int8(k_cache):
        from pagedllm.attention import triton_ops

        triton_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    if kv_quant.is_int8(k_cache):
        key, value = kv_quant.quantize(key), kv_quant.quantize(value)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    if cpu.write_kv(key, value, k_cache, v_cache, slot_mapping):
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # Indexed by (block, offset), not through a view of the slots: the cache's storage need not be slot-major.
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    partition_size: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of a flat batch of S sequences through their block tables (see DESIGN.md), in one call:
    the metadata the engine builds once per step, then the backend's `attend`. `window` and `softcap` as
    in `AttentionCall` (0: off)."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0 (0 is off), got {window!r} and {softcap!r}")
    metadata = AttentionMetadata.build(block_tables, seq_lens, query_start_loc, k_cache.shape[1], query.device)
    attend = get_backend(backend, query.device, partition_size=partition_size)
    return attend(query, k_cache, v_cache, metadata, scale, window=window, softcap=softcap)
