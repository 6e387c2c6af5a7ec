"""The model hyperparameters pagedllm needs, read straight from `config.json`, per model family.

Reading the JSON ourselves keeps start-up fast: `transformers.AutoConfig` imports about 1.4 s of
modules (torch.distributed among them) that a forward pass never uses. Each family reads the fields
its transformers (5.24) implementation reads, with the same defaults where its config class has
them; a field it cannot do without, or an option transformers treats in a way pagedllm cannot follow
exactly, is a `ValueError` here, before any weight is read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# architecture -> family; one decoder (pagedllm.models.decoder) with the family's options.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# The same decoders as embedding models (no LM head: a sentence-transformers checkpoint's `*Model`) and as
# classifiers (a `score` matrix on the last token's hidden state), which pooling engines run.
_HEADLESS = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma2", "Gemma3")
ARCHITECTURES |= {f"{base}Model": ARCHITECTURES[f"{base}ForCausalLM"] for base in _HEADLESS}
ARCHITECTURES |= {f"{base}ForSequenceClassification": ARCHITECTURES[f"{base}ForCausalLM"] for base in _HEADLESS}
ARCHITECTURES["Gemma3TextModel"] = "gemma3"
# BERT-style encoders (pagedllm.models.encoder): bidirectional attention over a whole prompt, for pooling only; bare
# (embeddings) or with their classification heads (cross-encoders).
ENCODERS = {
    "BertModel": "bert",
    "RobertaModel": "roberta",
    "XLMRobertaModel": "xlm-roberta",
    "ModernBertModel": "modernbert",
}
ENCODERS |= {name.replace("Model", "ForSequenceClassification"): family for name, family in ENCODERS.items()}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES) | frozenset(ENCODERS)
# `model_type` -> architecture, for a config.json without `architectures`.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "modernbert": "ModernBertModel",
}
_REFUSED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (vision tower + text) is not supported; "
    "a text-only Gemma 3 checkpoint (Gemma3ForCausalLM, model_type gemma3_text) is",
}

# Defaults of transformers' config classes for the optional fields each family reads.
_DEFAULTS: dict[str, dict] = {
    "llama": dict(num_key_value_heads=None, rms_norm_eps=1e-6, max_position_embeddings=2048, theta=10000.0),
    "mistral": dict(num_key_value_heads=8, rms_norm_eps=1e-6, max_position_embeddings=131072, theta=10000.0),
    "qwen2": dict(num_key_value_heads=32, rms_norm_eps=1e-6, max_position_embeddings=32768, theta=10000.0),
    "qwen3": dict(num_key_value_heads=32, rms_norm_eps=1e-6, max_position_embeddings=32768, theta=10000.0),
    "gemma2": dict(num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=8192, theta=10000.0),
    "gemma3": dict(num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=131072, theta=1e6),
    "phi3": dict(num_key_value_heads=None, rms_norm_eps=1e-5, max_position_embeddings=4096, theta=10000.0),
    "qwen3_moe": dict(num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=32768, theta=10000.0),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, theta=1e6),
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_REQUIRED_BY_FAMILY = {
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "mixtral": ("intermediate_size", "num_local_experts", "num_experts_per_tok"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# An encoder's MLP activation (transformers' names): GELU exact, or its tanh approximation.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse MLP (`pagedllm.models.moe.SparseMoeBlock`) on the layers where `layers[i]` is true."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    float32_routing: bool  # Mixtral keeps the routing weights in float32
    layers: tuple[bool, ...]
    checkpoint_prefixes: tuple[str, ...]  # "model.layers.{i}.mlp." etc., the first present wins


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """What a BERT-style encoder adds to the shape a decoder shares with it (`ModelConfig`)."""

    layer_norm_eps: float
    # Token types (BERT: 2, a pair's segments; RoBERTa, XLM-R: 1, all 0; ModernBERT: 0, it takes none).
    type_vocab_size: int
    max_positions: int  # position-embedding rows
    # RoBERTa and XLM-R number positions from pad_token_id + 1 (the pad token's row is its own); BERT from 0.
    position_offset: int | None  # pad_token_id for those; None for BERT
    head: str  # a classifier's head: "pooler" (BERT: dense + tanh on CLS, then the classifier), "roberta"
    # (dense + tanh + out_proj on CLS), "modernbert" (dense, activation, norm), "none" (a bare encoder)
    checkpoint_prefix: str  # what transformers' *ForSequenceClassification puts before the encoder's keys
    # ModernBERT: pre-LN layers with RoPE (`rope` / `rope_local` of the ModelConfig), GeGLU MLPs, sliding layers
    # seeing `sliding_windows[i]` positions either side, LayerNorms with bias where `norm_bias`.
    modern: bool = False
    norm_bias: bool = True
    classifier_pooling: str = "cls"  # the row(s) a classifier reads: "cls" or "mean" (ModernBERT's option)
    classifier_act: str = "gelu"  # ModernBERT's head: its activation, and whether its dense has a bias
    classifier_bias: bool = False


@dataclass(frozen=True, slots=True)
class ModelConfig:
    folder: Path
    architectures: tuple[str, ...]
    architecture: str  # the one pagedllm runs
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k and v
    o_proj_bias: bool
    mlp_bias: bool
    hidden_act: str  # one of ACTIVATIONS
    qk_norm: bool  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    gemma: bool  # (1 + w) norms, pre- and post-norms around attention and MLP, embedding times sqrt(hidden)
    attention_scale: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    sliding_windows: tuple[int, ...]  # per layer, 0 = global
    rope: dict  # rope_theta, rope_type and that type's scaling parameters (full-attention layers)
    rope_local: dict | None  # sliding layers' own RoPE (Gemma 3), None when they share `rope`
    partial_rotary_factor: float
    moe: MoEConfig | None
    num_labels: int = 0  # a *ForSequenceClassification checkpoint's `score` rows; 0: none
    has_lm_head: bool = True  # False for a bare `*Model` or a classifier: their checkpoints hold none
    notes: tuple[str, ...] = field(default=())  # what the loader logs (e.g. a shortened context)
    encoder: EncoderConfig | None = None  # a BERT-style encoder's options; None for a decoder

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        return parse_config(json.loads(path.read_text()), Path(folder), str(path))

    def layer_rope(self, layer: int) -> dict:
        if self.rope_local is not None and self.layer_types[layer] == SLIDING:
            return self.rope_local
        return self.rope


def pick_architecture(raw: dict, where: str = "config.json") -> str:
    names = tuple(raw.get("architectures") or ())
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    for name in names:
        if name in _REFUSED:
            raise ValueError(f"{where}: architecture {name} is not supported: {_REFUSED[name]}")
    if not names:
        model_type = raw.get("model_type")
        if model_type is None:
            return "LlamaForCausalLM"  # a bare Llama config, as older tools write
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
    named = list(names) or [f"model_type {raw.get('model_type')!r}"]
    raise ValueError(f"{where}: unsupported architecture {named}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def parse_config(raw: dict, folder: Path, where: str = "config.json") -> ModelConfig:
    architecture = pick_architecture(raw, where)
    if architecture in ENCODERS:
        return parse_encoder_config(raw, folder, architecture, where)
    family = ARCHITECTURES[architecture]
    defaults = _DEFAULTS[family]
    raw = dict(raw)
    if family in ("qwen3_moe", "mixtral"):
        # transformers aliases the two names (and saves Qwen3-MoE's as num_local_experts); the Hub uses both.
        for name, alias in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
            if raw.get(name) is None and raw.get(alias) is not None:
                raw[name] = raw[alias]

    def need(name: str):
        if raw.get(name) is None:
            raise ValueError(f"{where} lacks the field {name!r}, which {architecture} needs")
        return raw[name]

    for name in _REQUIRED + _REQUIRED_BY_FAMILY.get(family, ()):
        need(name)
    hidden, heads, num_layers = raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    gemma = family in ("gemma2", "gemma3")
    kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
    head_dim = raw.get("head_dim", 256 if gemma else 128 if family == "qwen3" else None) or hidden // heads
    if family == "qwen3_moe":
        intermediate = raw.get("intermediate_size", 6144)
    elif family == "mixtral":
        intermediate = raw["intermediate_size"]
    else:
        intermediate = need("intermediate_size")
    act = raw.get("hidden_activation", "gelu_pytorch_tanh") if gemma else raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS or (family in ("qwen3_moe", "mixtral") and act != "silu"):
        supported = "silu" if family in ("qwen3_moe", "mixtral") else ", ".join(ACTIVATIONS)
        raise ValueError(f"{where}: activation {act!r} is not supported for {architecture} (supported: {supported})")
    max_pos = raw.get("max_position_embeddings", defaults["max_position_embeddings"])
    layer_types, window = _layer_types(raw, family, num_layers, where)
    rope, rope_local, partial = _rope(raw, family, defaults["theta"], where)
    notes: list[str] = []
    limit = max(_longrope_limit(raw, family, r, max_pos) for r in (rope, rope_local) if r is not None)
    if limit < max_pos:
        notes.append(
            f"{where}: longrope switches from its short to its long factors once a sequence passes "
            f"{limit} tokens (transformers re-ropes only new tokens then, which a paged KV cache cannot "
            f"reproduce), so pagedllm serves this model up to {limit} tokens, not {max_pos}"
        )
        max_pos = limit
    # A window that covers every position the model serves is no window.
    window = 0 if window >= max_pos else window
    # Llama, Qwen3 and Gemma put `attention_bias` on q, k, v and o; Qwen2 always biases q, k, v only.
    bias = bool(raw.get("attention_bias", False)) and family in ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3")
    return ModelConfig(
        folder=folder,
        architectures=tuple(raw.get("architectures") or (architecture,)),
        architecture=architecture,
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", defaults["rms_norm_eps"]),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=bias or family == "qwen2",
        o_proj_bias=bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
        hidden_act=act,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        gemma=gemma,
        attention_scale=(raw.get("query_pre_attn_scalar", 256) if gemma else head_dim) ** -0.5,
        # Gemma 3's attention never passes its config's attn_logit_softcapping on (transformers 5.24).
        attn_softcap=float(raw.get("attn_logit_softcapping", 50.0) or 0.0) if family == "gemma2" else 0.0,
        final_softcap=_final_softcap(raw, family),
        layer_types=layer_types,
        sliding_windows=tuple(window if t == SLIDING else 0 for t in layer_types),
        rope=rope,
        rope_local=rope_local,
        partial_rotary_factor=partial,
        moe=_moe(raw, family, num_layers, intermediate),
        num_labels=_num_labels(raw) if architecture.endswith("ForSequenceClassification") else 0,
        has_lm_head=architecture.endswith("ForCausalLM"),
        notes=tuple(notes),
    )


def _num_labels(raw: dict) -> int:
    labels = raw.get("id2label")
    return len(labels) if labels else int(raw.get("num_labels", 2))


def _final_softcap(raw: dict, family: str) -> float:
    if family not in ("gemma2", "gemma3"):
        return 0.0
    return float(raw.get("final_logit_softcapping", 30.0 if family == "gemma2" else None) or 0.0)


def _layer_types(raw: dict, family: str, num_layers: int, where: str) -> tuple[tuple[str, ...], int]:
    """Each layer's attention type and the sliding layers' window, as transformers 5.24 derives them."""
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # `sliding_window` counts only with `use_sliding_window`; Qwen2/3 then slide layers >= max_window_layers
        # (unless `layer_types` says otherwise), Qwen3-MoE every layer.
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        if family == "qwen3_moe":
            types = [SLIDING if window is not None else FULL] * num_layers
        else:
            first = raw.get("max_window_layers", 28)
            types = raw.get("layer_types") or [
                SLIDING if window is not None and i >= first else FULL for i in range(num_layers)
            ]
    elif family in ("gemma2", "gemma3"):
        window = raw.get("sliding_window", 4096)
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention (an encoder) is not supported")
        pattern = 2 if family == "gemma2" else raw.get("sliding_window_pattern", 6)
        types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    else:
        # Mistral's config class defaults the window to 4096; Phi3's and Mixtral's to none. Every layer slides.
        window = raw.get("sliding_window", 4096 if family == "mistral" else None)
        types = [SLIDING if window is not None else FULL] * num_layers
    types = tuple(types)
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"{where}: layer_types must be {num_layers} of {FULL!r}/{SLIDING!r}, got {list(types)}")
    if SLIDING in types and not window:
        # transformers refuses to build the sliding-window mask without a window, too.
        raise ValueError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    return types, int(window or 0)


def _rope(raw: dict, family: str, theta: float, where: str) -> tuple[dict, dict | None, float]:
    """The full layers' RoPE parameters, the sliding layers' own (Gemma 3) and the rotary fraction
    of the head (Phi3's partial_rotary_factor; the other families rotate the whole head)."""
    params = raw.get("rope_parameters")
    if family == "gemma3":
        nested = params if isinstance(params, dict) and (FULL in params or SLIDING in params) else {}
        full = dict(nested.get(FULL) or {"rope_type": "default"})
        local = dict(nested.get(SLIDING) or {"rope_type": "default"})
        if raw.get("rope_scaling"):
            full.update(raw["rope_scaling"])
        full.setdefault("rope_theta", raw.get("rope_theta", 1e6))
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
        ropes = [full, local]
    else:
        if family == "phi3":
            rope = dict(raw.get("rope_scaling") or params or {})
        elif params:
            rope = dict(params)
        else:
            rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", raw.get("rope_theta", theta))
        ropes = [rope]
    for rope in ropes:
        rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
        if family == "phi3" and rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"  # as Phi3Config renames them
        if "dynamic" in rope["rope_type"]:
            raise ValueError(
                f"{where}: rope_type {rope['rope_type']!r} rescales with each batch's length and is not supported"
            )
    partial = 1.0
    if family == "phi3":
        partial = float(ropes[0].get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    return ropes[0], (ropes[1] if family == "gemma3" else None), partial


def _longrope_limit(raw: dict, family: str, rope: dict, max_pos: int) -> int:
    """transformers' longrope picks its short factors while `max(position) + 1 <=
    original_max_position_embeddings` in a forward call and its long ones beyond, for that call's new
    tokens only: the tokens served up to that length match it exactly, longer ones cannot."""
    if rope["rope_type"] != "longrope" or rope.get("short_factor") == rope.get("long_factor"):
        return max_pos
    if family == "phi3":
        original = raw.get("original_max_position_embeddings", 4096)
    elif "original_max_position_embeddings" in raw:
        original = raw["original_max_position_embeddings"]
    else:
        original = rope.get("original_max_position_embeddings", max_pos)
    return min(max_pos, original)


def _moe(raw: dict, family: str, num_layers: int, intermediate: int) -> MoEConfig | None:
    if family == "qwen3_moe":
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        experts = raw["num_experts"]
        return MoEConfig(
            num_experts=experts,
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["moe_intermediate_size"],
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            float32_routing=False,
            layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
            checkpoint_prefixes=("model.layers.{i}.mlp.",),
        )
    if family == "mixtral":
        return MoEConfig(
            num_experts=raw["num_local_experts"],
            top_k=raw["num_experts_per_tok"],
            intermediate_size=intermediate,
            norm_topk_prob=True,
            float32_routing=True,
            layers=(True,) * num_layers,
            checkpoint_prefixes=("model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."),
        )
    return None


def parse_encoder_config(raw: dict, folder: Path, architecture: str, where: str) -> ModelConfig:
    """A BERT, RoBERTa or XLM-RoBERTa config as transformers 5 reads it; the decoder-only fields get what an encoder
    means by them (every layer global, no RoPE, no LM head)."""
    family = ENCODERS[architecture]
    if family == "modernbert":
        return _modernbert_config(raw, folder, architecture, where)
    _require_encoder_fields(raw, architecture, where)
    act = raw.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"{where}: activation {act!r} is not supported for {architecture} ({ENCODER_ACTIVATIONS})")
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"{where}: position_embedding_type {position_type!r} is not supported (absolute is)")
    num_layers = raw["num_hidden_layers"]
    max_positions = raw.get("max_position_embeddings", 512)
    offset = None if family == "bert" else raw.get("pad_token_id", 1)
    classifier = architecture.endswith("ForSequenceClassification")
    encoder = EncoderConfig(
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        type_vocab_size=raw.get("type_vocab_size", 2),
        max_positions=max_positions,
        position_offset=offset,
        head=("pooler" if family == "bert" else "roberta") if classifier else "none",
        checkpoint_prefix="bert." if family == "bert" else "roberta.",
    )
    return _encoder_model_config(
        raw,
        folder,
        architecture,
        family,
        encoder,
        rms_norm_eps=encoder.layer_norm_eps,
        # The positions past the offset are the tokens a prompt may have (XLM-R: 514 rows, 512 tokens).
        max_position_embeddings=max_positions - (0 if offset is None else offset + 1),
        attention_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        hidden_act=act,
        layer_types=(FULL,) * num_layers,
        sliding_windows=(0,) * num_layers,
        rope={},
        rope_local=None,
    )


def _modernbert_config(raw: dict, folder: Path, architecture: str, where: str) -> ModelConfig:
    """ModernBERT as transformers 5 reads it: every `global_attn_every_n_layers`-th layer global (RoPE theta
    `global_rope_theta`), the others sliding over `local_attention // 2` positions either side (`local_rope_theta`),
    unless `layer_types` and `rope_parameters` say so themselves."""
    _require_encoder_fields(raw, architecture, where)
    num_layers = raw["num_hidden_layers"]
    every = raw.get("global_attn_every_n_layers") or 3
    types = tuple(raw.get("layer_types") or [FULL if i % every == 0 else SLIDING for i in range(num_layers)])
    params = raw.get("rope_parameters") or {}
    thetas = {FULL: raw.get("global_rope_theta") or 160000.0, SLIDING: raw.get("local_rope_theta") or 10000.0}
    ropes = {
        kind: dict(params.get(kind) or {"rope_type": "default", "rope_theta": theta}) for kind, theta in thetas.items()
    }
    acts = {name: raw.get(name, "gelu") for name in ("hidden_activation", "classifier_activation")}
    refused = [
        f"rope_type {rope.get('rope_type')!r}"
        for rope in ropes.values()
        if rope.get("rope_type", "default") != "default"
    ]
    refused += [f"{name} {act!r}" for name, act in acts.items() if act not in ENCODER_ACTIVATIONS]
    if raw.get("classifier_pooling", "cls") not in ("cls", "mean"):
        refused.append(f"classifier_pooling {raw['classifier_pooling']!r}")
    if refused:
        raise ValueError(f"{where}: {refused[0]} is not supported for {architecture}")
    classifier = architecture.endswith("ForSequenceClassification")
    eps = raw.get("norm_eps", 1e-5)
    encoder = EncoderConfig(
        layer_norm_eps=eps,
        type_vocab_size=0,
        max_positions=0,
        position_offset=None,
        head="modernbert" if classifier else "none",
        checkpoint_prefix="model.",
        modern=True,
        norm_bias=bool(raw.get("norm_bias", False)),
        classifier_pooling=raw.get("classifier_pooling", "cls"),
        classifier_act=acts["classifier_activation"],
        classifier_bias=bool(raw.get("classifier_bias", False)),
    )
    bias = bool(raw.get("attention_bias", False))
    return _encoder_model_config(
        raw,
        folder,
        architecture,
        "modernbert",
        encoder,
        rms_norm_eps=eps,
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=acts["hidden_activation"],
        layer_types=types,
        sliding_windows=tuple(raw.get("local_attention", 128) // 2 if t == SLIDING else 0 for t in types),
        rope=ropes[FULL],
        rope_local=ropes[SLIDING],
    )


def _require_encoder_fields(raw: dict, architecture: str, where: str) -> None:
    for name in _REQUIRED + ("intermediate_size",):
        if raw.get(name) is None:
            raise ValueError(f"{where} lacks the field {name!r}, which {architecture} needs")


def _encoder_model_config(
    raw: dict, folder: Path, architecture: str, family: str, encoder: EncoderConfig, **family_fields: Any
) -> ModelConfig:
    """The fields every encoder's config shares (its sizes from `raw`, full multi-head attention, none of a decoder's
    q/k norm, soft-caps, experts or LM head), with those its family sets."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return ModelConfig(
        folder=folder,
        architectures=tuple(raw.get("architectures") or (architecture,)),
        architecture=architecture,
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        qk_norm=False,
        gemma=False,
        attention_scale=(hidden // heads) ** -0.5,
        attn_softcap=0.0,
        final_softcap=0.0,
        partial_rotary_factor=1.0,
        moe=None,
        num_labels=_num_labels(raw) if architecture.endswith("ForSequenceClassification") else 0,
        has_lm_head=False,
        encoder=encoder,
        **family_fields,
    )
