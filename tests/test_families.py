"""Every supported model family, float32 greedy, token for token against transformers' own `generate`:
a tiny random model of each with its distinguishing options on (biases, q/k norms, soft-capping,
windows smaller than the prompts, interleaved sliding and global layers, per-layer-type RoPE, partial
and longrope RoPE, experts with top-2 routing), through batching, block sizes 1 and 16, chunked
prefill, preemption and prefix-cache hits. Then the configs pagedllm refuses, and why."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.config import FULL, SLIDING, SUPPORTED_ARCHITECTURES, ModelConfig
from pagedllm.models.loader import load_model
from tests.conftest import save_tiny_model
from tests.reference import compare_greedy, reference_greedy

MAX_NEW = 16
LENGTHS = [1, 5, 9, 17, 26, 40]  # windows below are 8-12 tokens

# family -> (transformers model_type, options on, expected per-layer sliding windows)
FAMILIES: dict[str, tuple[str, dict, list[int]]] = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True), [0, 0]),
    "mistral": ("mistral", dict(sliding_window=10), [10, 10]),
    "qwen2": (
        "qwen2",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=9, max_window_layers=1),
        [0, 9, 9],
    ),
    "qwen3": (
        "qwen3",
        dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
        [0, 0],
    ),
    "gemma2": (
        "gemma2",
        dict(
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0,
            tie_word_embeddings=False,  # tied, these tiny models echo their input token
        ),
        [8, 0, 8],
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            num_hidden_layers=3,
            sliding_window=8,
            sliding_window_pattern=2,
            query_pre_attn_scalar=24,
            final_logit_softcapping=6.0,
            attn_logit_softcapping=3.0,  # set, and ignored by Gemma 3's attention in transformers
            tie_word_embeddings=False,  # tied, these tiny models echo their input token
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 300.0},
            },
        ),
        [8, 0, 8],
    ),
    "phi3": (
        "phi3",
        dict(
            sliding_window=12,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.9, 2.5],
                "long_factor": [1.5, 2.0, 4.0, 8.0],
            },
        ),
        [12, 12],
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=11,
        ),
        [11, 11, 11],
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=12), [12, 12]),
}


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    model_type, options, _ = FAMILIES[family]
    folder = save_tiny_model(tmp_path_factory.mktemp(family), model_type, seed=len(family), **options)
    prompts = prompts_for(380, seed=len(family))
    return family, folder, prompts, reference_greedy(folder, prompts, MAX_NEW)


def generate(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params, use_tqdm=False)


def assert_matches(outputs, refs) -> None:
    result = compare_greedy(outputs, refs)
    print(f"{result.exact}/{len(refs)} sequences matched exactly, {result.near_ties} near-ties")
    # The rule allows near-ties, but float32 on both sides and these models' wide logits leave none.
    result.require(len(refs))


def test_batch_and_prefix_cache_hits_match_transformers(case):
    """Block size 16, all prompts at once; then the same prompts again, now hitting the prefix cache."""
    family, folder, prompts, refs = case
    llm = LLM(model=folder, dtype="float32", block_size=16)
    assert_matches(generate(llm, prompts), refs)
    assert llm.stats().prefix_cache_hits == 0
    assert_matches(generate(llm, prompts), refs)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0
    model = llm.engine.loaded.model
    assert model.sliding_windows == FAMILIES[family][2]
    assert model.num_layers == len(model.layers) == llm.engine.loaded.config.num_hidden_layers
    assert model.num_kv_heads == model.layers[0].self_attn.num_kv_heads == 2
    assert model.head_dim == model.layers[0].self_attn.head_dim == 16


def test_block_size_1_with_chunked_prefill_matches_transformers(case):
    _, folder, prompts, refs = case
    llm = LLM(model=folder, dtype="float32", block_size=1, max_num_batched_tokens=12)
    assert_matches(generate(llm, prompts), refs)
    assert llm.stats().kv_blocks_used == 0


def test_preemption_matches_transformers(case):
    family, folder, prompts, refs = case
    # The prompts and their outputs need 52 blocks of 4; 20 hold the longest but not all at once. Where
    # every layer slides, sequences give back what their windows passed: 12 blocks, in chunks of 16, are short.
    pool = dict(num_kv_blocks=12, max_num_batched_tokens=16) if min(FAMILIES[family][2]) else dict(num_kv_blocks=20)
    llm = LLM(model=folder, dtype="float32", block_size=4, **pool)
    assert_matches(generate(llm, prompts), refs)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0


def test_generation_config_eos_ids_stop(case, tmp_path):
    """Several EOS ids in generation_config.json: greedy output stops at the first of them."""
    _, folder, prompts, refs = case
    tokenizer_eos = 2  # <|im_end|>, also an EOS id
    row, stop_at = next(
        (row, i)
        for row in reversed(range(len(refs)))
        for i in range(2, MAX_NEW)
        if tokenizer_eos not in refs[row].token_ids[: i + 1] and refs[row].token_ids[i] not in refs[row].token_ids[:i]
    )
    ours = refs[row].token_ids
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    generation = json.loads((copy / "generation_config.json").read_text())
    generation["eos_token_id"] = [tokenizer_eos, ours[stop_at]]
    (copy / "generation_config.json").write_text(json.dumps(generation))
    llm = LLM(model=copy, dtype="float32")
    out = llm.generate([prompts[row]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ours[: stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"


# ---- options as read from config.json --------------------------------------------------------------


@pytest.mark.parametrize("case", ["phi3"], indirect=True)
def test_phi3_longrope_serves_up_to_the_original_length(case):
    _, folder, _, _ = case
    config = ModelConfig.from_folder(folder)
    # Past 64 tokens transformers switches to the long factors for new tokens only: not reproducible.
    assert config.max_position_embeddings == 64
    assert config.notes and "longrope" in config.notes[0]
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=folder, dtype="float32", max_model_len=65)


def write_config(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


LLAMA_RAW = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def test_unsupported_architecture_is_named_before_any_weight_is_read(tmp_path):
    folder = write_config(tmp_path, {**LLAMA_RAW, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_model(folder, torch.float32)  # no weights in the folder: the config alone decides
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(error.value)


def test_multimodal_gemma3_is_refused_clearly(tmp_path):
    folder = write_config(tmp_path, {**LLAMA_RAW, "architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        load_model(folder, torch.float32)


@pytest.mark.parametrize(
    ("architecture", "field"),
    [
        ("LlamaForCausalLM", "hidden_size"),
        ("Qwen3ForCausalLM", "num_attention_heads"),
        ("Gemma2ForCausalLM", "intermediate_size"),
        ("MixtralForCausalLM", "num_local_experts"),
        ("Qwen3MoeForCausalLM", "moe_intermediate_size"),
    ],
)
def test_missing_field_names_file_and_field(tmp_path, architecture, field):
    raw = {
        **LLAMA_RAW,
        "architectures": [architecture],
        "num_local_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    for name in (field, {"num_local_experts": "num_experts"}.get(field)):
        raw.pop(name, None)  # and its alias
    folder = write_config(tmp_path, raw)
    with pytest.raises(ValueError, match=f"config.json lacks the field '{field}'"):
        load_model(folder, torch.float32)


def test_architecture_from_model_type_when_config_has_none(tmp_path):
    raw = {**LLAMA_RAW, "model_type": "gemma3_text"}
    del raw["architectures"]
    config = ModelConfig.from_folder(write_config(tmp_path, raw))
    assert config.architecture == "Gemma3ForCausalLM"
    # transformers' defaults: every 6th layer global, window 4096, local RoPE base 10000, global 1e6.
    assert config.layer_types == (SLIDING,) * 2
    assert config.rope_local["rope_theta"] == 10000.0 and config.rope["rope_theta"] == 1e6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # Qwen2 sliding layers without a window: transformers cannot build their mask either.
        (dict(architectures=["Qwen2ForCausalLM"], layer_types=[SLIDING, FULL]), "sliding_window"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        (dict(hidden_act="relu2"), "relu2"),
        (dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True), "bidirectional"),
    ],
)
def test_options_pagedllm_cannot_follow_exactly_are_refused(tmp_path, changes, message):
    folder = write_config(tmp_path, {**LLAMA_RAW, **changes})
    with pytest.raises(ValueError, match=message):
        load_model(folder, torch.float32)


def test_qwen2_window_needs_use_sliding_window(tmp_path):
    """transformers ignores `sliding_window` unless `use_sliding_window`; then layers >= max_window_layers slide."""
    raw = {**LLAMA_RAW, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 1}
    assert ModelConfig.from_folder(write_config(tmp_path / "a", raw)).sliding_windows == (0, 0)
    raw["use_sliding_window"] = True
    assert ModelConfig.from_folder(write_config(tmp_path / "b", raw)).sliding_windows == (0, 8)


@pytest.mark.parametrize("case", ["qwen2", "mixtral"], indirect=True)  # one dense, one MoE family
def test_sharded_checkpoint_with_index(tmp_path, case):
    """A checkpoint split over shards named by model.safetensors.index.json loads like the single file."""
    _, folder, prompts, refs = case
    from safetensors.torch import load_file, save_file

    sharded = Path(shutil.copytree(folder, tmp_path / "sharded"))
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    # A stray file the index does not name is not read.
    save_file({"junk": torch.zeros(1)}, sharded / "consolidated.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    llm = LLM(model=sharded, dtype="float32")
    assert_matches(generate(llm, prompts), refs)


@pytest.mark.parametrize("native", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_norm_rounds_as_transformers(dtype, with_residual, native, monkeypatch):
    """Gemma's `(1 + w)` RMSNorm, C kernel and torch form, against transformers' Gemma2RMSNorm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from pagedllm.models import fused

    assert fused.library() is not None
    if not native:
        monkeypatch.setattr(fused, "library", lambda: None)
    torch.manual_seed(0)
    x, residual = torch.randn(9, 96).to(dtype), torch.randn(9, 96).to(dtype)
    norm = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
        expected = norm(residual + x if with_residual else x)
    ours_residual = residual.clone()
    out = fused.rms_norm(x, norm.weight.detach(), 1e-6, ours_residual if with_residual else None, offset=True)
    if with_residual:
        assert torch.equal(ours_residual, residual + x)
    if dtype == torch.bfloat16:
        # Only the float32 sum order differs: at most one bf16 rounding apart, almost always none.
        ulps = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.98
    else:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["mistral"], indirect=True)
def test_sliding_window_request_of_10x_the_window_holds_a_bounded_number_of_blocks(case):
    """Window 10, blocks of 4: a request that runs to 10x the window holds at most the blocks its next
    query can see (10 / 4 rounded up, plus the one being written) at every step, and still answers
    as transformers does."""
    _, folder, prompts, _ = case
    prompt, max_tokens = prompts[2], 100
    (ref,) = reference_greedy(folder, [prompt], max_tokens)
    llm = LLM(model=folder, dtype="float32", block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    held, outputs = [], []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
        held.append(engine.stats().kv_blocks_used)
    assert len(prompt) + max_tokens >= 10 * 10
    assert max(held) <= -(-10 // 4) + 1
    compare_greedy(outputs, [ref]).require(1)
    assert engine.stats().kv_blocks_used == 0
