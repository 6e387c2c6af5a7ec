"""The Llama family, top to bottom: embeddings, decoder layers, norm, LM head.

The model knows nothing about requests. Each attention layer writes this step's K/V into its
paged cache and attends through the step's `AttentionMetadata` with the step's attention backend;
everything else is a plain transformer over a flat batch of tokens from many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, Backend, write_kv
from pagedllm.models import fused
from pagedllm.models.config import ModelConfig


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one step of the flat batch."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    metadata: AttentionMetadata
    attention: Backend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


class Linear(nn.Module):
    """`nn.Linear` without random initialisation: the weights always come from a checkpoint, and
    skipping the init saves start-up time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Reorder a bf16 CPU weight once into oneDNN's blocked layout: `linear` otherwise repacks it
        on every call, a large share of the product at decode batch sizes (docs/PERFORMANCE.md)."""
        if (
            self.weight.device.type == "cpu"
            and self.weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
        ):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise in float32 and cast back before the weight, exactly as the reference does; with
        `residual`, add `x` into it first (in place) and normalise the sum."""
        return fused.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, head_dim]` in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rope_inv_freq(config: ModelConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    rope_type = config.rope["rope_type"]
    if rope_type == "default":
        theta = float(config.rope["rope_theta"])
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' depends on the batch's length and is not supported")
    # Scaled variants (linear, llama3, yarn, ...) come from transformers itself, so they match it exactly.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.from_pretrained(config.folder))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.layer_index = layer_index
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        cos, sin = rope
        q = fused.rope(qkv, 0, self.num_heads, self.head_dim, cos, sin)
        k = fused.rope(qkv, self.q_size, self.num_kv_heads, self.head_dim, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = ctx.attention(q, k_cache, v_cache, ctx.metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
    ) -> torch.Tensor:
        """`residual` is the stream the reference calls `hidden_states`, updated in place; `x` is the
        previous layer's MLP output, still to be added to it (None before the first layer). The adds
        ride in the fused norms. Returns this layer's MLP output."""
        hidden = self.input_layernorm(residual) if x is None else self.input_layernorm(x, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, ctx), residual)
        return self.mlp(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, self.layers[0].self_attn.head_dim)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        rope = self.rotary(ctx.positions, residual.dtype)
        x = None
        for layer in self.layers:
            x = layer(x, residual, rope, ctx)
        return self.norm(x, residual)

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
