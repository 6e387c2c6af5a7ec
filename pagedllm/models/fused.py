"""The decoder layer's element-wise ops: a fused C kernel (pagedllm/csrc/fused_ops.c) for CPU tensors in bf16
or float32, the plain torch form otherwise (other devices, no compiler, PAGEDLLM_NATIVE=0). Both
round where transformers rounds (its Llama; its Gemma for the `(1 + w)` norm). GELU gating and partial
rotary embeddings have only the torch form."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from pagedllm import native
from pagedllm.attention import kv_quant
from pagedllm.attention.cpu import takes_caches

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "rms_norm_offset": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "silu_mul": [_PTR, _PTR, _I64, _I64],
    "add_bias": [_PTR, _PTR, _I64, _I64],
    "rope": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "rope_write_kv": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, *[_I64] * 8],
    "rope_write_kv_int8": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, *[_I64] * 8],
}
MAX_INT8_ROW = 256  # fused_ops.c's: the widest head it quantizes into an int8 cache


@cache
def library() -> ctypes.CDLL | None:
    lib = native.load("fused_ops.c")
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            kernel = getattr(lib, f"{name}_{suffix}")
            kernel.argtypes = argtypes
            kernel.restype = None
    return lib


def _kernel(name: str, *tensors: torch.Tensor):
    """The C kernel for these tensors, or None where the torch form must run."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _SUFFIX or any(t.dtype != first.dtype for t in tensors):
        return None
    lib = library()
    return None if lib is None else getattr(lib, f"{name}_{_SUFFIX[first.dtype]}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: bool = False,
) -> torch.Tensor:
    """RMSNorm of `x`, or with `residual`: `residual += x` in place (rounded to the dtype) and the
    norm of the sum. `x` and `residual` are `[tokens, hidden]`. Llama's form rounds the normalised
    value to the dtype and then multiplies by `weight`; with `offset`, Gemma's multiplies by
    `1 + weight` in float32 and rounds once."""
    # The kernel reads `residual` with x's element type and row layout, so it must match both.
    tensors = (x, weight) if residual is None else (x, weight, residual)
    name = "rms_norm_offset" if offset else "rms_norm"
    kernel = _kernel(name, *tensors) if residual is None or residual.is_contiguous() else None
    if kernel is None:
        if residual is not None:
            residual.add_(x)
            x = residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if offset:
            return (x32 * (1.0 + weight.float())).to(x.dtype)
        return weight * x32.to(x.dtype)
    x = x.contiguous()
    out = torch.empty_like(x)
    res_ptr = residual.data_ptr() if residual is not None else None
    kernel(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = [gate | up]` of shape `[tokens, 2 * intermediate]`."""
    dim = gate_up.shape[-1] // 2
    kernel = _kernel("silu_mul", gate_up)
    if kernel is None:
        gate, up = gate_up.split(dim, dim=-1)
        return torch.nn.functional.silu(gate) * up
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], dim)
    kernel(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], dim)
    return out


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` for `gate_up = [gate | up]`: "silu" (fused), "gelu_pytorch_tanh" or "gelu"."""
    if act == "silu":
        return silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


def rope(qkv: torch.Tensor, col: int, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the `heads` heads starting at column `col` of `qkv` `[tokens, width]`,
    as a new `[tokens, heads, head_dim]`; `cos`/`sin` are `[tokens, rotary_dim]` in qkv's dtype. A
    `rotary_dim` below `head_dim` rotates each head's first `rotary_dim` values only (Phi3's partial
    rotary factor) and passes the rest through."""
    rotary_dim = cos.shape[-1]
    kernel = _kernel("rope", qkv, cos, sin) if qkv.stride(-1) == 1 and rotary_dim == head_dim else None
    if kernel is None:
        x = qkv[:, col : col + heads * head_dim].view(-1, heads, head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        half = rotary_dim // 2
        rot = x[..., :rotary_dim]
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        if rotary_dim == head_dim:
            return rot * c + rotated * s
        return torch.cat((rot * c + rotated * s, x[..., rotary_dim:]), dim=-1)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = qkv.new_empty(qkv.shape[0], heads, head_dim)
    kernel(
        qkv.data_ptr(),
        qkv.stride(0),
        col,
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        qkv.shape[0],
        heads,
        head_dim,
    )
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """An attention layer's rotary embedding and K/V write in one pass over its fused projection `qkv`
    `[tokens, (heads + 2 kv_heads) head_dim]`: returns the rotated queries `[tokens, heads, head_dim]`, and
    writes the rotated keys and the values into the caches `[blocks, block_size, kv_heads, head_dim]` (any
    block, position and head strides, the same for both; contiguous rows) at each token's slot (negative:
    padding, not written); into an int8 cache as `kv_quant.quantize` would. None where the C kernel cannot
    run (another device or dtype, a partial rotary, a cache not laid out so): the caller then ropes and
    writes separately."""
    int8 = kv_quant.is_int8(k_cache)
    if (
        qkv.stride(-1) != 1
        or cos.shape[-1] != head_dim
        or not takes_caches(k_cache, v_cache)
        or slot_mapping.dtype != torch.int64
        or slot_mapping.device.type != "cpu"
        or (int8 and (v_cache.dtype != torch.int8 or head_dim > MAX_INT8_ROW))
    ):
        return None
    if int8:
        kernel = _kernel("rope_write_kv_int8", qkv, cos, sin)
    else:
        kernel = _kernel("rope_write_kv", qkv, cos, sin, k_cache, v_cache)
    if kernel is None:
        return None
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    q = qkv.new_empty(qkv.shape[0], heads, head_dim)
    kernel(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        qkv.shape[0],
        heads,
        kv_heads,
        head_dim,
        k_cache.shape[1],
        *k_cache.stride()[:3],
    )
    return q
