"""The path that ships and is benchmarked — bf16, prepacked oneDNN weights, the AVX512-BF16 attention
kernel — against `transformers` bf16, on models whose head dims (64, 128) take that kernel. On a CPU
without AVX512 the same comparison runs the path that CPU gets (`F.linear`, the portable C kernel).

bf16 rounds differently in every implementation, so greedy sequences may part: each pair must agree up
to a first divergence, and that divergence must be a near-tie of the float32 reference (its log-probs of
the two tokens within `tests.reference.NEAR_TIE`). A minimum share of the sequences must agree exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.attention import cpu
from pagedllm.models.prepack import can_prepack
from tests.conftest import save_tiny_model
from tests.reference import compare_sequences, float32_logprobs

NUM_PROMPTS = 12
MIN_EXACT = NUM_PROMPTS // 2
NEW_TOKENS = 24


def bf16_model(folder: Path, head_dim: int) -> Path:
    heads = 256 // head_dim
    return save_tiny_model(
        folder,
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        # Narrower than the other tiny models: bf16 hidden states of wide random weights overflow precision.
        initializer_range=0.05,
    )


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    # 3 .. 384 is the tiny tokenizer's ordinary vocabulary; lengths cross several 16-token blocks.
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 70))] for _ in range(NUM_PROMPTS)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_greedy_matches_transformers_bf16_up_to_near_ties(tmp_path, head_dim):
    folder = bf16_model(tmp_path / f"hd{head_dim}", head_dim)
    llm = LLM(model=folder, dtype="bfloat16", num_kv_blocks=256)
    qkv = llm.engine.loaded.model.layers[0].self_attn.qkv_proj
    packable = can_prepack(torch.empty(1, 1, dtype=torch.bfloat16))
    assert (qkv.packed is not None) == packable, "bf16 weights are prepacked wherever oneDNN can"
    assert qkv.weight.is_meta == packable, "and then held once, packed, not beside their plain copy"
    fast = cpu.has_fast_bf16()
    assert (cpu.kernel_name(torch.bfloat16, head_dim) == "paged_attention_bf16_avx512") == fast
    batch = prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    ]

    model16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model16.generation_config.eos_token_id = None
    theirs = [hf_greedy(model16, prompt) for prompt in batch]
    result = compare_sequences(
        list(zip(ours, theirs, strict=True)), lambda i, at: float32_logprobs(model32, batch[i] + ours[i][:at])
    )
    print(f"{result.exact}/{len(batch)} sequences agree exactly, {result.near_ties} near-ties")
    result.require(MIN_EXACT)
