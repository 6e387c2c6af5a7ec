"""A BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa) over the engine's flat batch, for pooling only.

Word + absolute position + token-type embeddings and a LayerNorm, then post-LN layers (self-attention with bias,
a GELU MLP), as transformers' `BertModel` / `XLMRobertaModel`; a classifier adds its head on the CLS row
(`classify`). Attention is bidirectional over each sequence's whole prompt, so a sequence is computed in one
step and nothing is cached: the encoder reads no KV cache and writes none (`num_layers`, the KV shape's layer
count, is 0). Each sequence's rows attend among themselves through torch's SDPA, one call per sequence: the flat
batch is never padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import Embedding, Linear

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
    """LayerNorm without initialisation: its weight and bias come from the checkpoint."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
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
        """Each sequence's rows `[start, end)` attend to each other, every one to every one (no causal mask)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.view(tokens, 3, self.num_heads, self.head_dim).transpose(0, 2).unbind(1)  # [heads, T, d]
        out = qkv.new_empty(self.num_heads, tokens, self.head_dim)
        for start, end in spans:
            rows = slice(start, end)
            out[:, rows] = F.scaled_dot_product_attention(q[:, rows], k[:, rows], v[:, rows], scale=self.scale)
        return out.transpose(0, 1).reshape(tokens, -1)


class Encoder(nn.Module):
    """The whole encoder. What the engine reads: `num_layers` (0: no layer keeps K/V), `num_kv_heads`, `head_dim`,
    `sliding_windows` (one 0 per layer: every layer sees the whole prompt); `classify` for a cross-encoder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.encoder is not None, "an Encoder of a decoder's config"
        options = config.encoder
        hidden = config.hidden_size
        self.config = config
        self.position_offset = options.position_offset
        self.embed_tokens = Embedding(config.vocab_size, hidden)
        self.embed_positions = Embedding(options.max_positions, hidden)
        self.embed_types = Embedding(options.type_vocab_size, hidden)
        self.embed_norm = LayerNorm(hidden, options.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.head = options.head
        # BERT's classifier reads its pooler (dense + tanh on CLS); RoBERTa's head has its own dense + tanh.
        self.pooler = Linear(hidden, hidden, bias=True) if options.head == "pooler" else None
        self.classifier_dense = Linear(hidden, hidden, bias=True) if options.head == "roberta" else None
        self.classifier = Linear(hidden, config.num_labels, bias=True) if config.num_labels else None
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
        """The last layer's hidden states of a flat batch of whole prompts (each sequence's positions from 0;
        `token_type_ids` None: every token is type 0)."""
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
        """Float32 label logits of CLS rows' hidden states."""
        assert self.classifier is not None, "classify() on an encoder without a classifier"
        dense = self.pooler if self.pooler is not None else self.classifier_dense
        assert dense is not None
        return self.classifier(torch.tanh(dense(hidden))).float()

    def checkpoint_keys(self, name: str) -> list[str]:
        """The checkpoint keys (transformers' names, without a classifier's `bert.` / `roberta.` prefix) our
        parameter `name` is made of, in order."""
        module, _, leaf = name.rpartition(".")
        if module.startswith("layers."):
            _, index, part = module.split(".")
            return [f"encoder.layer.{index}.{key}.{leaf}" for key in _LAYER_KEYS[part]]
        if module == "classifier":  # BERT's is one matrix; RoBERTa's is `out_proj`, after its dense
            return [f"classifier.out_proj.{leaf}" if self.head == "roberta" else f"classifier.{leaf}"]
        return [f"{_EMBEDDING_KEYS[module]}.{leaf}"]

    def prepack(self) -> None:
        """Prepack every linear weight once, after loading (`Linear.prepack`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
