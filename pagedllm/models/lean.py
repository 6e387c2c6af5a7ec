"""A Llama-style model's decoder layers in one C call (`csrc/decoder_layers.c`), where every op of a step is one
of the project's C kernels: GGUF blocks multiplied by `quantized.direct_kernel` (float32 on the blocks up to
`FEW_ROWS` rows, bf16 on packed blocks), the fused norms, SiLU·up and rotary K/V write, and the paged-attention
kernel. The C loop calls those kernels with the Python layers' arguments in their order, so the result is the
same bit for bit; what it saves is the Python around them (module calls, a tensor allocated per op, ctypes'
argument conversion), which dominates a step of a small model at few rows.

`LeanLayers.of(model, dtype)` says at load whether the model can run so (a dense MLP with SiLU, Llama's norms,
no per-head q/k norms, full rotary, quantized projections whose parts all have a direct kernel, biases or not);
`takes` says it per step (the CPU attention backend on caches its kernel reads, in the dtype or int8, no LoRA
rows, no chunk for SDPA, few enough rows)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from pagedllm import native
from pagedllm.attention import cpu
from pagedllm.attention.dispatch import CPU_BACKEND
from pagedllm.models import fused, quantized
from pagedllm.models.config import FULL
from pagedllm.models.decoder import MLP, CausalLM, Rope, StepContext
from pagedllm.models.quantized import QuantizedLinear

_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


MAX_PARTS = 3  # decoder_layers.c's: q, k and v of three types


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("num_parts", _I64),
        ("kernel", _PTR * MAX_PARTS),
        ("weight", _PTR * MAX_PARTS),
        ("out_features", _I64 * MAX_PARTS),
        ("bias", _PTR),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_attention_norm", _PTR),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("window", _I64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("element_size", _I64),
        *((name, _F32) for name in ("eps", "scale", "softcap")),
        *((name, _PTR) for name in ("norm", "act_mul", "add_bias", "rope_write_kv", "attend")),
    ]


_STEP_SIZES = ("rows", "num_seqs", "table_stride", "block_size", "block_stride", "position_stride", "head_stride")
_STEP_INPUTS = ("cos", "sin", "slots", "block_tables", "seq_lens", "query_start_loc", "k_caches", "v_caches")
_BUFFERS = ("residual", "hidden", "qkv", "q", "attention", "projected", "gate_up", "activated", "out", "part")


class _Step(ctypes.Structure):
    _fields_ = [*((name, _I64) for name in _STEP_SIZES), *((name, _PTR) for name in _STEP_INPUTS + _BUFFERS)]


@cache
def library() -> ctypes.CDLL | None:
    lib = native.load("decoder_layers.c")
    if lib is not None:
        lib.decoder_layers.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), ctypes.POINTER(_Step)]
        lib.decoder_layers.restype = None
    return lib


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, _PTR).value


def _matrix(linear: torch.nn.Module, dtype: torch.dtype) -> _Matrix | None:
    """A projection the C loop can multiply: quantized parts that each have a direct kernel, and its bias if any."""
    if not isinstance(linear, QuantizedLinear) or len(linear.parts) > MAX_PARTS:
        return None
    kernels = [quantized.direct_kernel(part, dtype) for part in linear.parts]
    bias = linear.bias
    if any(kernel is None for kernel in kernels):
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return _Matrix(
        len(kernels),
        (_PTR * MAX_PARTS)(*(_address(kernel) for kernel in kernels)),
        (_PTR * MAX_PARTS)(*(part.data.data_ptr() for part in linear.parts)),
        (_I64 * MAX_PARTS)(*(part.out_features for part in linear.parts)),
        None if bias is None else bias.data_ptr(),
    )


def _part_width(layers: ctypes.Array) -> int:
    """The widest part of any projection of several parts (0 where none has several)."""
    matrices = [matrix for layer in layers for matrix in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return max((max(m.out_features[: m.num_parts]) for m in matrices if m.num_parts > 1), default=0)


@dataclass(slots=True)
class LeanLayers:
    """The C loop's view of one model in one dtype: the shape and shared kernels (`models`, one for each KV cache
    dtype) and each layer's weights (`layers`), as addresses into the model's tensors: the model holds it
    (`CausalLM.lean`), never the other way round, so it lives no longer than they do."""

    dtype: torch.dtype
    models: dict[torch.dtype, _Model]  # by the KV cache's dtype: the dtype's own or int8
    layers: ctypes.Array
    part_width: int  # see `_part_width`
    run_layers: ctypes._CFuncPtr
    rows: int  # most rows every projection's kernel takes (`quantized.direct_rows`)

    @classmethod
    def of(cls, model: CausalLM, dtype: torch.dtype) -> LeanLayers | None:
        """The lean path for `model` in `dtype`, or None where a layer needs the Python one."""
        config, libs = model.config, (library(), fused.library(), cpu.library(), quantized.library())
        if dtype not in _SUFFIX or any(lib is None for lib in libs) or config.partial_rotary_factor != 1:
            return None
        layers = [_layer(layer, dtype) for layer in model.layers]
        eps = {n.eps for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        if any(layer is None for layer in layers) or len(eps) != 1:
            return None
        table = (_Layer * len(layers))(*layers)
        models = {cache: _model(model, len(layers), dtype, cache) for cache in (dtype, torch.int8)}
        parts = [part for layer in model.layers for linear in _projections(layer) for part in linear.parts]
        rows = min(quantized.direct_rows(part, dtype) for part in parts)
        return cls(dtype, models, table, _part_width(table), libs[0].decoder_layers, rows)

    def takes(self, residual: torch.Tensor, rope: Rope, ctx: StepContext) -> bool:
        """Whether this step runs here: the Python layers would run exactly these kernels."""
        k_cache, v_cache = ctx.kv_caches[0]
        prefills = ctx.metadata.prefills
        model = self.models.get(k_cache.dtype)
        return (
            model is not None
            and residual.dtype == self.dtype
            and residual.device.type == "cpu"
            and residual.is_contiguous()
            and residual.shape[0] <= self.rows
            and ctx.lora is None
            and ctx.attention is CPU_BACKEND
            and cpu.takes_shape(self.dtype, model.heads, model.head_dim, k_cache, v_cache)
            and all(k.stride() == k_cache.stride() and v.stride() == k_cache.stride() for k, v in ctx.kv_caches)
            and ctx.slot_mapping.dtype == torch.int64
            and not any(cpu.runs_on_sdpa(c.rows.stop - c.rows.start, c.seq_len, self.dtype) for c in prefills)
        )

    def run(self, residual: torch.Tensor, rope: Rope, ctx: StepContext) -> torch.Tensor:
        """Every layer over the step (`residual`, the embeddings, is updated in place as the Python layers update
        it); returns the last layer's MLP output, still to be added to `residual`."""
        k_cache, rows, metadata = ctx.kv_caches[0][0], residual.shape[0], ctx.metadata
        m = self.models[k_cache.dtype]
        cos, sin = (t.contiguous() for t in rope)
        slots = ctx.slot_mapping.contiguous()
        q_size = m.heads * m.head_dim
        widths = {
            "hidden": m.hidden,
            "qkv": q_size + 2 * m.kv_heads * m.head_dim,
            "q": q_size,
            "attention": q_size,
            "projected": m.hidden,
            "gate_up": 2 * m.intermediate,
            "activated": m.intermediate,
            "out": m.hidden,
            "part": self.part_width,
        }
        buffers = {name: torch.empty(rows, width, dtype=self.dtype) for name, width in widths.items()}
        k_caches = (_PTR * m.num_layers)(*(k.data_ptr() for k, _ in ctx.kv_caches))
        v_caches = (_PTR * m.num_layers)(*(v.data_ptr() for _, v in ctx.kv_caches))
        step = _Step(
            rows,
            metadata.seq_lens.numel(),
            metadata.block_tables.stride(0),
            k_cache.shape[1],
            *k_cache.stride()[:3],
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            metadata.block_tables.data_ptr(),
            metadata.seq_lens.data_ptr(),
            metadata.query_start_loc.data_ptr(),
            ctypes.cast(k_caches, _PTR),
            ctypes.cast(v_caches, _PTR),
            residual.data_ptr(),
            *(buffers[name].data_ptr() for name in _BUFFERS[1:]),
        )
        self.run_layers(ctypes.byref(m), self.layers, ctypes.byref(step))
        return buffers["out"]


def _model(model: CausalLM, num_layers: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> _Model:
    """The shape and the shared kernels of `model`'s layers in `dtype` on a KV cache of `cache_dtype`."""
    first = model.layers[0]
    attention, mlp = first.self_attn, first.mlp
    fused_lib, suffix = fused.library(), _SUFFIX[dtype]
    int8 = "_int8" if cache_dtype == torch.int8 else ""
    return _Model(
        num_layers,
        model.config.hidden_size,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        mlp.down_proj.in_features,
        torch.empty((), dtype=dtype).element_size(),
        first.input_layernorm.eps,
        attention.scale,
        attention.softcap or 0.0,
        _address(getattr(fused_lib, f"rms_norm_{suffix}")),
        _address(getattr(fused_lib, f"silu_mul_{suffix}")),
        _address(getattr(fused_lib, f"add_bias_{suffix}")),
        _address(getattr(fused_lib, f"rope_write_kv{int8}_{suffix}")),
        _address(getattr(cpu.library(), cpu.kernel_name(dtype, attention.head_dim, cache_dtype))),
    )


def _projections(layer: torch.nn.Module) -> tuple[QuantizedLinear, ...]:
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer(layer: torch.nn.Module, dtype: torch.dtype) -> _Layer | None:
    """One decoder layer for the C loop, or None where it needs the Python one."""
    attention, mlp = layer.self_attn, layer.mlp
    if layer.sandwich or layer.rope_key != FULL or attention.q_norm is not None:
        return None
    if not isinstance(mlp, MLP) or mlp.act != "silu":
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.offset or n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
        return None
    matrices = [_matrix(m, dtype) for m in _projections(layer)]
    if any(m is None for m in matrices):
        return None
    return _Layer(
        layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
        *matrices,
        attention.window or 0,
    )
