"""Tiny random embedding and scoring models, saved as sentence-transformers would save them, for the pooling
tests and the embedding benchmark's test."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.conftest import save_tiny_model

# family -> transformers model_type and the options that make it itself (Gemma 2's soft-capped attention is
# left off: transformers' SDPA path, which sentence-transformers loads, does not apply it)
EMBEDDING_FAMILIES = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "gemma2": (
        "gemma2",
        dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=None),
    ),
}
ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def save_embedding_model(
    folder: Path,
    family: str,
    pooling: str,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    lm_head: bool = False,
    **config,
) -> Path:
    """A bare `*Model` (or with `lm_head` a causal LM, which can also generate) with sentence-transformers'
    modules: Transformer, Pooling (`pooling`), and Normalize when `normalize`; `config` goes into config.json
    (`is_matryoshka`, say)."""
    model_type, options = EMBEDDING_FAMILIES[family]
    save_tiny_model(folder, model_type, model_class=AutoModelForCausalLM if lm_head else AutoModel, **options)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (folder / "1_Pooling").mkdir()
    raw = json.loads((folder / "config.json").read_text())
    settings = {mode: False for mode in ST_MODES.values()} | {ST_MODES[pooling]: True}
    settings["word_embedding_dimension"] = raw["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    if prompts:
        st_config = {"prompts": prompts, "default_prompt_name": default_prompt_name}
        (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    (folder / "config.json").write_text(json.dumps(raw | config))
    return folder


def save_classifier(folder: Path, num_labels: int = 1) -> Path:
    """A tiny `Qwen3ForSequenceClassification` (a cross-encoder reranker's shape)."""
    return save_tiny_model(folder, "qwen3", model_class=AutoModelForSequenceClassification, num_labels=num_labels)


def save_yes_no_reranker(folder: Path, no: str, yes: str) -> Path:
    """A tiny Qwen3 causal LM scored on its `no` and `yes` tokens (Qwen3-Reranker's recipe, as vLLM's
    `classifier_from_token` names it)."""
    save_tiny_model(folder, "qwen3")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"classifier_from_token": [no, yes]}))
    return folder
