"""The model hyperparameters pagedllm needs, read straight from `config.json`.

Reading the JSON ourselves keeps start-up fast: `transformers.AutoConfig` imports about 1.4 s of
modules (torch.distributed among them) that a Llama forward pass never uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    folder: Path
    architectures: tuple[str, ...]
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
    attention_bias: bool
    mlp_bias: bool
    rope: dict  # rope_theta, rope_type and the scaling parameters of that type

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((folder / "config.json").read_text())
        heads = raw["num_attention_heads"]
        return cls(
            folder=folder,
            architectures=tuple(raw.get("architectures") or ("LlamaForCausalLM",)),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=_rope(raw),
        )


def _rope(raw: dict) -> dict:
    """transformers ≥ 5 writes `rope_parameters`; older configs keep `rope_theta` and `rope_scaling` apart."""
    if raw.get("rope_parameters"):
        rope = dict(raw["rope_parameters"])
    else:
        rope = {"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {})}
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    return rope
