"""Shared fixtures: tiny random Llama models saved as HF folders, with a small real BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "A block table maps logical blocks to physical blocks in the pool.",
    "Continuous batching admits new requests at every iteration.",
    "Copy on write keeps shared blocks safe when sequences fork.",
    "Hello world! Numbers like 12345 and symbols #@$ also appear.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.pad_token = "<|endoftext|>"
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    tokenizer = build_tokenizer()
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # Wide random weights give confident logits, so greedy choices are rarely near-ties.
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_tied_gqa8(tmp_path_factory) -> Path:
    """Tied embeddings, 8 query heads per KV head, and llama3-style RoPE scaling."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_llama_tied"),
        seed=1,
        num_attention_heads=8,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )


def save_tiny_model(folder: Path, model_type: str, seed: int = 0, model_class=None, **overrides) -> Path:
    """A tiny random model of any transformers `model_type` (e.g. "qwen3", "gemma2") saved as an HF
    folder with the small BPE tokenizer: 2 layers, hidden 64, GQA 4/2, wide random weights; `overrides`
    set the family's options (window, soft-caps, experts ...). `model_class` is the transformers auto class
    (default AutoModelForCausalLM; AutoModel for a bare embedding model, AutoModelForSequenceClassification)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM

    tokenizer = build_tokenizer()
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class.from_config(AutoConfig.for_model(model_type, **settings), dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at 1 (or 0 for Gemma's `1 + w`); random ones tell the norms apart.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
