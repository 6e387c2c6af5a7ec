"""BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa; ModernBERT) over the engine's flat batch, for pooling only.

`BertEncoder`: word + absolute position + token-type embeddings and a LayerNorm, then post-LN layers (self-attention
with bias, a GELU MLP), as transformers' `BertModel` / `XLMRobertaModel`. `ModernBertEncoder`: token embeddings and
a norm, then pre-LN layers (RoPE, every few layers global and the others sliding over a window either side, a GeGLU
MLP) and a final norm, as `ModernBertModel`. A classifier adds its head on the CLS row, or on the mean row
(`classify`). Attention is bidirectional over each sequence's whole prompt, so a sequence is computed in one step
and nothing is cached: the encoder reads no KV cache and writes none (`num_layers`, the KV shape's layer count, is
0). Each sequence's rows attend among themselves through torch's SDPA, one call per sequence: the flat batch is
never padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.config import FULL, SLIDING, ModelConfig
from pagedllm.models.decoder import Embedding, Linear, rope_inv_freq

# Our parameters' names in transformers' checkpoints (without the `bert.` / `roberta.` prefix a classifier's
# encoder keys carry); a fused projection is its parts' concatenation, in order.
_EMBEDDING_KEYS = {
    "embed_tokens": "embeddings.word_embeddings",
    "embed_positions": "embeddings.position_embeddings",
    "embed_types": "embeddings.token_type_embeddings",
    "embed_norm": "embeddings.LayerNorm",
    "pooler": "pooler.dense",
    "classifier_dense": "classifier.dense",
}
_LAYER_KEYS = {
    "qkv_proj": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "o_proj": ("attention.output.dense",),
    "attention_norm": ("attention.output.LayerNorm",),
    "up_proj": ("intermediate.dense",),
    "down_proj": ("output.dense",),
    "mlp_norm": ("output.LayerNorm",),
}


class LayerNorm(nn.Module):
    """LayerNorm without initialisation: its weight and bias (unless `bias` is False) come from the checkpoint."""

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.scale = config.attention_scale
        self.qkv_proj = Linear(hidden, 3 * hidden, bias=True)
        self.o_proj = Linear(hidden, hidden, bias=True)
        self.attention_norm = LayerNorm(hidden, eps)
        self.up_proj = Linear(hidden, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=True)
        self.mlp_norm = LayerNorm(hidden, eps)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Post-LN, as BERT: norm(x + attention(x)), then norm(h + mlp(h))."""
        h = self.attention_norm(x + self.o_proj(self._attend(self.qkv_proj(x), spans)))
        return self.mlp_norm(h + self.down_proj(F.gelu(self.up_proj(h), approximate=self.approximate)))

    def _attend(self, qkv: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        tokens = qkv.shape[0]
        q, k, v = qkv.view(tokens, 3, self.num_heads, self.head_dim).transpose(0, 2).unbind(1)  # [heads, T, d]
        return _attend_spans(q, k, v, spans, self.scale)


def _attend_spans(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], scale: float, window: int = 0
) -> torch.Tensor:
    """`q`, `k`, `v` `[heads, T, d]`: each sequence's rows `[start, end)` attend to each other, every one to every
    one (no causal mask), or with a `window` to those within it either side; `[T, heads * d]`."""
    heads, tokens, head_dim = q.shape
    out = q.new_empty(heads, tokens, head_dim)
    for start, end in spans:
        rows = slice(start, end)
        mask = None
        if window and end - start > window + 1:
            offsets = torch.arange(end - start, device=q.device)
            mask = (offsets[:, None] - offsets[None, :]).abs() <= window
        out[:, rows] = F.scaled_dot_product_attention(q[:, rows], k[:, rows], v[:, rows], mask, scale=scale)
    return out.transpose(0, 1).reshape(tokens, -1)


class Encoder(nn.Module):
    """A whole encoder. What the engine reads: `num_layers` (0: no layer keeps K/V), `num_kv_heads`, `head_dim`,
    `sliding_windows` (one 0 per layer: no layer's window frees blocks); `forward` over whole prompts; `classify`
    for a cross-encoder; `checkpoint_keys`, what the loader reads each parameter from."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.encoder is not None, "an Encoder of a decoder's config"
        self.config = config
        self.num_layers = 0
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_windows = [0] * config.num_hidden_layers
        self.lean = None  # the decoder's one-C-call layers never take an encoder

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        query_start_loc: list[int],
    ) -> torch.Tensor:
        """The last hidden states of a flat batch of whole prompts (each sequence's positions from 0;
        `token_type_ids` None: every token is type 0)."""
        raise NotImplementedError

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 label logits of pooled rows' hidden states (CLS rows, or means)."""
        raise NotImplementedError

    def checkpoint_keys(self, name: str) -> list[str]:
        """The checkpoint keys (transformers' names, without a classifier's prefix) our parameter `name` is made
        of, in order."""
        raise NotImplementedError

    def prepack(self) -> None:
        """Prepack every linear weight once, after loading (`Linear.prepack`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()


def encoder_of(config: ModelConfig) -> Encoder:
    """The encoder of this architecture, its parameters uninitialised."""
    assert config.encoder is not None
    return ModernBertEncoder(config) if config.encoder.modern else BertEncoder(config)


class BertEncoder(Encoder):
    """BERT, RoBERTa and XLM-RoBERTa."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        options = config.encoder
        assert options is not None
        hidden = config.hidden_size
        self.position_offset = options.position_offset
        self.embed_tokens = Embedding(config.vocab_size, hidden)
        self.embed_positions = Embedding(options.max_positions, hidden)
        self.embed_types = Embedding(options.type_vocab_size, hidden)
        self.embed_norm = LayerNorm(hidden, options.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.head_kind = options.head
        # BERT's classifier reads its pooler (dense + tanh on CLS); RoBERTa's head has its own dense + tanh.
        self.pooler = Linear(hidden, hidden, bias=True) if options.head == "pooler" else None
        self.classifier_dense = Linear(hidden, hidden, bias=True) if options.head == "roberta" else None
        self.classifier = Linear(hidden, config.num_labels, bias=True) if config.num_labels else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        query_start_loc: list[int],
    ) -> torch.Tensor:
        spans = list(zip(query_start_loc[:-1], query_start_loc[1:], strict=True))
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.embed_tokens(input_ids) + self.embed_types(types)
        x = self.embed_norm(x + self.embed_positions(self._position_ids(input_ids, positions, spans)))
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def _position_ids(
        self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """BERT's rows are the positions; RoBERTa's count a sequence's non-pad tokens from pad_token_id + 1 and give
        a pad token the pad row (transformers' `create_position_ids_from_input_ids`)."""
        if self.position_offset is None:
            return positions
        real = (input_ids != self.position_offset).long()
        counted = torch.cumsum(real, 0)
        before = (counted - real)[[start for start, _ in spans]]
        lengths = torch.tensor([end - start for start, end in spans], device=input_ids.device)
        counted = counted - torch.repeat_interleave(before, lengths)
        return counted * real + self.position_offset

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.classifier is not None, "classify() on an encoder without a classifier"
        dense = self.pooler if self.pooler is not None else self.classifier_dense
        assert dense is not None
        return self.classifier(torch.tanh(dense(hidden))).float()

    def checkpoint_keys(self, name: str) -> list[str]:
        module, _, leaf = name.rpartition(".")
        if module.startswith("layers."):
            _, index, part = module.split(".")
            return [f"encoder.layer.{index}.{key}.{leaf}" for key in _LAYER_KEYS[part]]
        if module == "classifier":  # BERT's is one matrix; RoBERTa's is `out_proj`, after its dense
            return [f"classifier.out_proj.{leaf}" if self.head_kind == "roberta" else f"classifier.{leaf}"]
        return [f"{_EMBEDDING_KEYS[module]}.{leaf}"]


class ModernBertLayer(nn.Module):
    """Pre-LN: x + attention(norm(x)), then h + mlp(norm(h)); the first layer's attention reads x itself."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        assert config.encoder is not None
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, config.encoder.norm_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.scale = config.attention_scale
        self.window = config.sliding_windows[index]  # positions seen either side; 0: all
        self.kind = config.layer_types[index]
        self.attn_norm = LayerNorm(hidden, eps, bias) if index else None
        self.attn = nn.Module()
        self.attn.Wqkv = Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.attn.Wo = Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = LayerNorm(hidden, eps, bias)
        self.mlp = nn.Module()
        self.mlp.Wi = Linear(hidden, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.mlp.Wo = Linear(config.intermediate_size, hidden, bias=config.mlp_bias)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        normed = x if self.attn_norm is None else self.attn_norm(x)
        h = x + self.attn.Wo(self._attend(self.attn.Wqkv(normed), rope, spans))
        gate_in, gate = self.mlp.Wi(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.mlp.Wo(F.gelu(gate_in, approximate=self.approximate) * gate)

    def _attend(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Each sequence's rows attend to each other (a sliding layer's to those within its window either side)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.view(tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, heads, d]
        cos, sin = (part[:, None] for part in rope)
        q, k = (_rotate(t, cos, sin).transpose(0, 1) for t in (q, k))
        return _attend_spans(q, k, v.transpose(0, 1), spans, self.scale, self.window)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: the head's halves rotated (`rotate_half`)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class ModernBertEncoder(Encoder):
    """ModernBERT, its parameters named as transformers' `ModernBertModel` names them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        options = config.encoder
        assert options is not None
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, options.norm_bias
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = Embedding(config.vocab_size, hidden)
        self.embeddings.norm = LayerNorm(hidden, eps, bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = LayerNorm(hidden, eps, bias)
        for kind, rope in ((FULL, config.rope), (SLIDING, config.rope_local)):
            assert rope is not None
            self.register_buffer(f"{kind}_inv_freq", rope_inv_freq(config, rope, kind)[0], persistent=False)
        self.head = self.classifier = None
        if config.num_labels:
            self.head = nn.Module()
            self.head.dense = Linear(hidden, hidden, bias=options.classifier_bias)
            self.head.norm = LayerNorm(hidden, eps, bias)
            self.classifier = Linear(hidden, config.num_labels, bias=True)
        self.head_approximate = "none" if options.classifier_act == "gelu" else "tanh"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        query_start_loc: list[int],
    ) -> torch.Tensor:
        spans = list(zip(query_start_loc[:-1], query_start_loc[1:], strict=True))
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        ropes = {kind: self._rope(positions, getattr(self, f"{kind}_inv_freq"), x.dtype) for kind in (FULL, SLIDING)}
        for layer in self.layers:
            x = layer(x, ropes[layer.kind], spans)
        return self.final_norm(x)

    @staticmethod
    def _rope(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.classifier is not None, "classify() on an encoder without a classifier"
        features = F.gelu(self.head.dense(hidden), approximate=self.head_approximate)
        return self.classifier(self.head.norm(features)).float()

    def checkpoint_keys(self, name: str) -> list[str]:
        return [name]
