"""One decoder-only transformer for every supported family, top to bottom: embeddings, decoder layers,
norm, LM head; each family is a set of options in its `ModelConfig` (pagedllm.models.config).

| option | families |
|---|---|
| bias on q, k, v (and o) | Qwen2 (q, k, v); Llama, Qwen3, Gemma with `attention_bias` |
| RMSNorm of each q and k head before RoPE | Qwen3, Qwen3-MoE, Gemma 3 |
| sliding window (per layer) | Mistral, Mixtral, Phi3, Qwen2/3 (`use_sliding_window`), Gemma 2/3 interleaved |
| Gemma: `(1 + w)` norms, norms before and after attention and MLP, embeddings times sqrt(hidden) | Gemma 2, 3 |
| GELU-tanh gating | Gemma 2, 3 |
| attention-logit and final-logit soft-capping | Gemma 2 (final: Gemma 3 when set) |
| a RoPE of its own for sliding layers | Gemma 3 |
| partial rotary embedding | Phi3 |
| sparse mixture-of-experts MLP (`moe.SparseMoeBlock`) | Qwen3-MoE, Mixtral |

The model knows nothing about requests. Each attention layer writes this step's K/V into its paged
cache and attends through the step's `AttentionMetadata` with the step's attention backend (with the
layer's window and soft-cap, when it has them); everything else is a plain transformer over a flat
batch of tokens from many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, Backend, write_kv
from pagedllm.distributed import parallel
from pagedllm.models import fused
from pagedllm.models.config import FULL, SLIDING, ModelConfig
from pagedllm.models.lora import LoRABatch, LoRAStack, add_lora
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.prepack import can_prepack, packed_linear, prepacked


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one step of the flat batch."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    metadata: AttentionMetadata
    attention: Backend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    lora: LoRABatch | None = None  # the rows that run under LoRA adapters, by adapter slot


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [tokens, rotary_dim]


class LayerLoop(Protocol):
    """The decoder layers run another way for the steps it `takes` (`models/lean.py`: one C call): `run` updates
    the residual stream in place and returns the last layer's MLP output, as the layers' loop does."""

    def takes(self, residual: torch.Tensor, rope: Rope, ctx: StepContext) -> bool: ...

    def run(self, residual: torch.Tensor, rope: Rope, ctx: StepContext) -> torch.Tensor: ...


class Linear(nn.Module):
    """`nn.Linear` without random initialisation: the weights always come from a checkpoint, and
    skipping the init saves start-up time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        # Row-parallel under tensor parallelism: each rank holds a slice of the inputs' dimension, so its
        # product is a partial sum that the ranks add up.
        self.reduce = False

    def prepack(self, keep_plain: bool = False) -> None:
        """Reorder a CPU weight once into oneDNN's blocked layout (`prepack.py` says where and why). The plain
        copy is then let go, so each weight is in memory once, unless `keep_plain`: another module reads it
        (a tied LM head's weight is the embedding table). The parameter stays, on the meta device, with
        its shape and dtype."""
        if self.weight.is_meta or not can_prepack(self.weight):
            return
        self.packed = prepacked(self.weight)
        if not keep_plain:
            self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if x.shape[0] == 0:
                out = x.new_empty((0, self.weight.shape[0]))
            else:
                out = packed_linear(x, self.packed, self.bias)
        else:
            out = nn.functional.linear(x, self.weight, self.bias)
        return parallel.all_reduce(out) if self.reduce else out


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
        # Gemma: times sqrt(hidden), a float32 scalar rounded to the weights' dtype, as transformers does.
        self.scale = scale
        # Vocabulary-parallel: this rank holds rows [vocab_start, vocab_start + len(weight)) (zero-padded
        # past the vocabulary); the others' tokens read zeros here and come from their ranks in the sum.
        self.vocab_start: int | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_start is None:
            out = nn.functional.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            mine = (local >= 0) & (local < self.weight.shape[0])
            out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
            out = parallel.all_reduce(out * mine[:, None].to(out.dtype))
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype)
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise in float32 and scale as the reference does (Llama: cast back, then times the
        weight; Gemma's `offset`: times `1 + weight` in float32, then cast); with `residual`, add `x`
        into it first (in place) and normalise the sum."""
        return fused.rms_norm(x, self.weight, self.eps, residual, self.offset)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, rope: dict, layer_type: str) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, rope, layer_type)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, rotary_dim]` in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rope_inv_freq(config: ModelConfig, rope: dict, layer_type: str) -> tuple[torch.Tensor, float]:
    dim = int(config.head_dim * config.partial_rotary_factor)
    if rope["rope_type"] == "default":
        theta = float(rope["rope_theta"])
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    # Scaled variants (linear, llama3, yarn, longrope, ...) come from transformers itself, so they match it
    # exactly ("dynamic" is refused in config.py; longrope's long factors are past the served length).
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(config.folder)
    kwargs = {"layer_type": layer_type} if config.rope_local is not None else {}
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, **kwargs)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.window = config.sliding_windows[layer_index]
        self.softcap = config.attn_softcap
        self.layer_index = layer_index
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.lora_qkv: LoRAStack | None = None  # the adapters' slots, when the engine serves LoRA (lora.py)
        self.lora_o: LoRAStack | None = None
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.gemma)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.gemma)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        add_lora(qkv, x, self.lora_qkv, ctx.lora)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        q = None
        if self.q_norm is None:  # the K/V write rides in the rotary pass where the C kernel can run
            q = fused.rope_write_kv(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, *rope, k_cache, v_cache, ctx.slot_mapping
            )
        if q is None:
            q, k, v = self._rope(qkv, rope)
            write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        options = {}
        if self.window:
            options["window"] = self.window
        if self.softcap:
            options["softcap"] = self.softcap
        out = ctx.attention(q, k_cache, v_cache, ctx.metadata, self.scale, **options).reshape(-1, self.q_size)
        projected = self.o_proj(out)
        add_lora(projected, out, self.lora_o, ctx.lora)
        return projected

    def _rope(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys (after their per-head norms, where the family has them) and the values."""
        cos, sin = rope
        if self.q_norm is None:
            q = fused.rope(qkv, 0, self.num_heads, self.head_dim, cos, sin)
            k = fused.rope(qkv, self.q_size, self.num_kv_heads, self.head_dim, cos, sin)
        else:
            tokens = qkv.shape[0]
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim)).view(tokens, self.q_size)
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_dim))
            q = fused.rope(q, 0, self.num_heads, self.head_dim, cos, sin)
            k = fused.rope(k.view(tokens, self.kv_size), 0, self.num_kv_heads, self.head_dim, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.act = config.hidden_act
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.lora_gate_up: LoRAStack | None = None
        self.lora_down: LoRAStack | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        add_lora(gate_up, x, self.lora_gate_up, lora)
        hidden = fused.act_mul(gate_up, self.act)
        out = self.down_proj(hidden)
        add_lora(out, hidden, self.lora_down, lora)
        return out


def _mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    moe = config.moe
    if moe is None or not moe.layers[layer_index]:
        return MLP(config)
    return SparseMoeBlock(
        config.hidden_size,
        moe.intermediate_size,
        moe.num_experts,
        moe.top_k,
        moe.norm_topk_prob,
        float32_routing=moe.float32_routing,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.gemma
        self.sandwich = config.gemma
        self.rope_key = config.layer_types[layer_index] if config.rope_local is not None else FULL
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.mlp = _mlp(config, layer_index)

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
        if not self.sandwich:
            hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, ctx), residual)
            return self._feed_forward(hidden, ctx)
        # Gemma: residual + post_norm(attention), then residual + post_norm(mlp(pre_norm(residual))).
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, ctx))
        hidden = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self._feed_forward(hidden, ctx))

    def _feed_forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The MLP, with the step's adapters where it is dense (a mixture of experts takes none)."""
        return self.mlp(hidden, ctx.lora) if isinstance(self.mlp, MLP) else self.mlp(hidden)


class CausalLM(nn.Module):
    """The whole model. What the engine reads: `num_layers`, `num_kv_heads`, `head_dim` (the KV shape,
    also on `layers[0].self_attn`) and `sliding_windows` (per layer, 0 = global: a key at position j
    is seen by queries p with p - window < j <= p)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        scale = config.hidden_size**0.5 if config.gemma else None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, scale)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings or not config.has_lm_head:
            self.lm_head.weight = self.embed_tokens.weight
        # A classifier's labels from the last token's hidden state (`*ForSequenceClassification`).
        self.score = Linear(config.hidden_size, config.num_labels, bias=False) if config.num_labels else None
        self.final_softcap = config.final_softcap
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_windows: list[int] = list(config.sliding_windows)
        ropes = {FULL: RotaryEmbedding(config, config.rope, FULL)}
        if config.rope_local is not None:
            ropes[SLIDING] = RotaryEmbedding(config, config.rope_local, SLIDING)
        self.rotary = nn.ModuleDict(ropes)
        self.lean: LayerLoop | None = None  # set by the loader where every layer can run in one C call (lean.py)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        ropes = {key: rotary(ctx.positions, residual.dtype) for key, rotary in self.rotary.items()}
        if self.lean is not None and self.lean.takes(residual, ropes[FULL], ctx):
            return self.norm(self.lean.run(residual, ropes[FULL], ctx), residual)
        x = None
        for layer in self.layers:
            x = layer(x, residual, ropes[layer.rope_key], ctx)
        return self.norm(x, residual)

    @property
    def dense_mlp(self) -> list[bool]:
        """Per layer, whether its MLP is dense (a mixture of experts' is not, and takes no LoRA adapter)."""
        return [isinstance(layer.mlp, MLP) for layer in self.layers]

    def prepack(self) -> None:
        """Prepack every linear weight once, after loading (and sharding): the plain copies go, so this is
        not done twice."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(keep_plain=module.weight is getattr(self.embed_tokens, "weight", None))
            elif isinstance(module, SparseMoeBlock):
                module.prepack()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.embed_tokens.vocab_start is not None:  # each rank scored its vocabulary shard
            logits = parallel.all_gather_last(logits)[:, : self.config.vocab_size]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 label logits of a classifier's rows."""
        assert self.score is not None, "classify() on a model without a classification matrix"
        return self.score(hidden).float()
