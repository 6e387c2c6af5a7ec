"""kv_cache_dtype="int8": the row quantization, every attention path reading int8 caches, the pool's size at
equal memory, and the engine's block moves (swap, copy-on-write, prefix hits) on an int8 pool."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.attention import cpu, kv_quant, paged_attention, write_kv
from pagedllm.benchmarks import accuracy
from pagedllm.config import EngineConfig
from pagedllm.models import fused
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import resolve_model_folder
from pagedllm.worker.group import pool_size

# (block_size, (num_heads, num_kv_heads, head_dim)): blocks of 1, not a power of two, and 16; grouped-query
# ratios 1, 3 and 4.
SHAPES = [(1, (2, 2, 16)), (5, (9, 3, 64)), (16, (9, 3, 64)), (16, (8, 2, 128)), (16, (2, 2, 16))]
# The C kernel walks 16 positions a chunk, the Triton decode splits into partitions of this many here.
SMALL_PARTITION = 32
# Attention of the same int8 values in float32 arithmetic, by kernels that sum in different orders (absolute:
# a share of the largest value); bf16 queries and outputs round to 8 bits.
KERNEL_TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-3, 1e-2)}
# A float32 dot product summed in another order differs by a few ulps of the sum of its terms' magnitudes,
# not of its value: with keys spread 30x the logits' terms reach hundreds and the softmax amplifies that.
DOT_ROUNDING = 1e-6


def cpu_backends() -> list[str]:
    return ["reference", "torch", *(["cpu"] if cpu.library() is not None else [])]


def filled_caches(
    k: list[torch.Tensor], v: list[torch.Tensor], block_size: int, cache_dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V `[len, H_kv, D]` per sequence written through `write_kv`, one token at a time (as decode fills a
    block), into scattered blocks of a cache of `cache_dtype`; returns the caches and the block tables."""
    num_kv_heads, head_dim = k[0].shape[1:]
    counts = [-(-len(keys) // block_size) for keys in k]
    width = head_dim + (kv_quant.SCALE_BYTES if cache_dtype == torch.int8 else 0)
    dims = (sum(counts) + 3, block_size, num_kv_heads, width)
    k_cache, v_cache = torch.zeros(dims, dtype=cache_dtype), torch.zeros(dims, dtype=cache_dtype)
    pool = torch.randperm(dims[0], generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(k), max(counts), dtype=torch.int32)
    for s, (keys, values) in enumerate(zip(k, v, strict=True)):
        tables[s, : counts[s]] = torch.tensor([pool.pop() for _ in range(counts[s])])
        for p in range(len(keys)):
            slot = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size])
            write_kv(keys[p : p + 1], values[p : p + 1], k_cache, v_cache, slot)
    return k_cache, v_cache, tables


def random_kv(lens: list[int], num_kv_heads: int, head_dim: int, seed: int) -> tuple[list, list]:
    """K/V whose magnitude varies by position and head (by up to 30x), so that one scale per block or per
    tensor would not do."""
    gen = torch.Generator().manual_seed(seed)

    def one(n: int) -> torch.Tensor:
        spread = torch.exp(torch.rand(n, num_kv_heads, 1, generator=gen) * math.log(30.0))
        return torch.randn(n, num_kv_heads, head_dim, generator=gen) * spread

    return [one(n) for n in lens], [one(n) for n in lens]


def attention_bound(query: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], scale: float) -> float:
    """A bound on |int8 attention - float attention| from the quantization step alone. Each stored value is
    within half its row's step s = absmax / 127, so a logit moves by at most d = scale * |q|_1 * s_k / 2 and
    each softmax weight by a factor within e^(+-2d); the output moves by at most max |v| (e^(2d) - 1) plus
    the values' own half step."""
    half_step_k = max(float(keys.abs().amax(-1).max()) for keys in k) / kv_quant.QMAX / 2
    half_step_v = max(float(values.abs().amax(-1).max()) for values in v) / kv_quant.QMAX / 2
    largest_v = max(float(values.abs().max()) for values in v)
    logit_shift = scale * float(query.float().abs().sum(-1).max()) * half_step_k
    return half_step_v + largest_v * math.expm1(2 * logit_shift)


def largest_logit_terms(query: torch.Tensor, k: list[torch.Tensor]) -> float:
    """The largest sum of |q_i k_i| over any query head and any key, the scale a logit's rounding has."""
    magnitudes = query.float().abs().flatten(0, 1)
    return max(float((magnitudes @ keys.abs().flatten(0, 1).T).max()) for keys in k)


def run_case(backend: str, dtype, block_size, heads, lens, query_lens, *, seed=0, **options) -> None:
    """`backend` on an int8 cache against the reference on the float32 cache of the same dequantized
    values (tight: the kernels' arithmetic) and against float attention of the unquantized K/V (within the
    bound the quantization step gives)."""
    num_heads, num_kv_heads, head_dim = heads
    k, v = random_kv(lens, num_kv_heads, head_dim, seed)
    k_int8, v_int8, tables = filled_caches(k, v, block_size, torch.int8, seed)
    k_float, v_float, _ = filled_caches(k, v, block_size, torch.float32, seed)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    query = query.to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (tables, lens_t, starts, scale)
    if backend == "triton":
        options["partition_size"] = SMALL_PARTITION
    got = paged_attention(query, k_int8, v_int8, *args, backend=backend, **options).float()
    dequantized = paged_attention(
        query.float(), kv_quant.dequantize(k_int8), kv_quant.dequantize(v_int8), *args, backend="reference", **options
    )
    atol, rtol = KERNEL_TOLERANCE[dtype]
    largest_v = max(float(values.abs().max()) for values in v)
    logit_shift = DOT_ROUNDING * scale * largest_logit_terms(query, k)
    torch.testing.assert_close(got, dequantized, atol=largest_v * (atol + math.expm1(2 * logit_shift)), rtol=rtol)
    exact = paged_attention(query.float(), k_float, v_float, *args, backend="reference", **options)
    error = float((dequantized - exact).abs().max())
    assert 0 < error <= attention_bound(query, k, v, scale), error


def test_rows_round_trip_within_half_a_step():
    x = torch.randn(50, 3, 64) * torch.linspace(0.01, 100, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row keeps its zeros (scale 0, no division by it)
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    step = x.abs().amax(-1, keepdim=True) / kv_quant.QMAX
    assert torch.equal(kv_quant.scales(rows), step)
    # Half a step, plus float32's rounding of x / step (|q| <= 127: 127 * 2^-24 steps) and of q * step (as much).
    assert bool(((kv_quant.dequantize(rows) - x).abs() <= step / 2 + 2 * 127 * 2**-24 * step).all())
    assert int(rows[..., :64].abs().amax(-1).min()) in (0, kv_quant.QMAX)  # every row's absmax maps to 127
    assert torch.equal(kv_quant.dequantize(rows[7, 1]), torch.zeros(64))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("block_size", "heads"), SHAPES, ids=lambda x: f"{x}")
def test_int8_attention_is_float_attention_within_the_quantization_step(backend, dtype, block_size, heads):
    # Decode tokens of lengths around a block and across several 16-position chunks, a prompt chunk after
    # a cached prefix, and a whole prompt.
    lens = [1, block_size + 1, 3 * SMALL_PARTITION + 7, 30, 9]
    run_case(backend, dtype, block_size, heads, lens, [1, 1, 1, 9, 9])


@pytest.mark.parametrize("window", [0, 24])
def test_int8_rows_read_in_place_give_the_bits_of_rows_widened_first(window):
    """The C kernel reads 16-position blocks' int8 rows where they lie (on AVX2, the default model's heads) and
    widens 8-position blocks' into float rows first: the same sums in the same order, the same bits. (Any other
    rounding would draw another sample of an int8 cache's noise in every later layer.)"""
    lens, query_lens = [1, 40, 77, 30], [1, 1, 1, 9]
    k, v = random_kv(lens, 3, 64, seed=6)
    query = torch.randn(sum(query_lens), 9, 64, generator=torch.Generator().manual_seed(6))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    outputs = []
    for block_size in (16, 8):
        k_cache, v_cache, tables = filled_caches(k, v, block_size, torch.int8)
        args = (tables, torch.tensor(lens, dtype=torch.int32), starts, 0.125)
        outputs.append(paged_attention(query, k_cache, v_cache, *args, backend="cpu", window=window))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_int8_attention_with_window_and_softcap(backend, softcap):
    lens = [70, 3, 45]
    run_case(backend, torch.float32, 16, (8, 2, 64), lens, [1, 3, 45], seed=3, window=24, softcap=softcap)


def test_int8_attention_in_triton():
    """Decode v2 over partitions and a prompt chunk, in Triton's interpreter on the CPU (or on the GPU)."""
    pytest.importorskip("triton")
    from tests.test_triton_attention import ON_GPU

    if ON_GPU:
        pytest.skip("its cases are CPU tensors, which Triton runs only in the interpreter")
    run_case("triton", torch.float32, 16, (4, 2, 16), [SMALL_PARTITION + 9, 5, 12], [1, 1, 12])


def test_a_block_filled_token_by_token_keeps_each_tokens_scale():
    """Each token ten times larger than the one before it in the same block: a scale taken from the block's
    first token would clip every later one to its range, and attention would miss the large values."""
    block_size, head_dim = 8, 16
    growth = torch.tensor([10.0**p for p in range(block_size)])[:, None, None]
    k = [torch.randn(block_size, 1, head_dim) * growth * 1e-3]
    v = [torch.randn(block_size, 1, head_dim) * growth * 1e-3]
    k_cache, v_cache, _ = filled_caches(k, v, block_size, torch.int8)
    (block,) = (b for b in range(k_cache.shape[0]) if bool(k_cache[b].any()))
    for cache, original in ((k_cache, k[0]), (v_cache, v[0])):
        half_step = original.abs().amax(-1, keepdim=True) / kv_quant.QMAX / 2
        assert bool(((kv_quant.dequantize(cache[block]) - original).abs() <= half_step * 1.001).all())
    for backend in cpu_backends():
        run_case(backend, torch.float32, block_size, (2, 1, head_dim), [block_size, 3], [1, 1])


def test_int8_pool_holds_about_twice_the_blocks_at_equal_memory():
    """On the default model (head dim 64): 64 int8 values and a 4-byte scale per row against 64 bf16 values."""
    model_config = ModelConfig.from_folder(resolve_model_folder(None))
    memory = 1 << 30
    pools = {
        kv: pool_size(EngineConfig(dtype="bfloat16", kv_cache_memory=memory, kv_cache_dtype=kv), model_config)
        for kv in ("auto", "int8")
    }
    assert pools["int8"].bytes_per_block * 64 * 2 == pools["auto"].bytes_per_block * (64 + 4)
    ratio = pools["int8"].num_blocks / pools["auto"].num_blocks
    assert 1.85 < ratio < 1.9, ratio
    assert all(pool.num_blocks * pool.bytes_per_block <= memory for pool in pools.values())


def test_the_engines_int8_pool_fits_its_memory_and_reports_bytes(tiny_llama):
    memory = 1 << 20
    llm = LLM(model=tiny_llama, dtype="float32", kv_cache_memory=memory, kv_cache_dtype="int8")
    caches = llm.engine.worker.cache.kv_caches
    assert all(t.dtype == torch.int8 for pair in caches for t in pair)
    held = sum(t.numel() for pair in caches for t in pair)
    snapshot = llm.kv_snapshot()
    assert held == snapshot.num_blocks * snapshot.bytes_per_block <= memory < held + snapshot.bytes_per_block
    # 2 layers x K, V x 16 tokens x 2 KV heads x (16 values + a 4-byte scale)
    assert snapshot.bytes_per_block == 2 * 2 * 16 * 2 * 20


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
PROMPTS = prompts_of([5, 30, 12, 60, 3, 44, 20, 9], seed=1)


def int8_llm(model, **options) -> LLM:
    return LLM(model=model, dtype="float32", block_size=4, kv_cache_dtype="int8", **options)


@pytest.fixture(scope="module")
def roomy(tiny_llama) -> LLM:
    return int8_llm(tiny_llama)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_swap_and_forks_give_the_same_tokens_on_an_int8_pool(tiny_llama, roomy):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    tight = int8_llm(tiny_llama, num_kv_blocks=40, preemption_mode="swap", swap_space=0.01)
    assert token_ids(tight.generate(PROMPTS, params, use_tqdm=False)) == token_ids(
        roomy.generate(PROMPTS, params, use_tqdm=False)
    )
    stats = tight.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_cow_copies > 0
    assert stats.kv_blocks_used == 0 and stats.num_swapped_out_blocks == 0


def test_forked_samples_equal_separate_requests_on_an_int8_pool(roomy):
    """n=4 shares the prompt's blocks and copies the partly filled last one on first write."""
    prompt = prompts_of([30], seed=14)[0]
    copies = roomy.stats().num_cow_copies
    group = roomy.generate([prompt], SamplingParams(n=4, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert roomy.stats().num_cow_copies > copies
    singles = [SamplingParams(seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(4)]
    separate = roomy.generate([prompt] * 4, singles, use_tqdm=False)
    assert [c.token_ids for c in group[0].outputs] == [out.outputs[0].token_ids for out in separate]


def test_beam_search_survives_swapping_on_an_int8_pool(tiny_llama, roomy):
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:4]
    expected = token_ids(roomy.beam_search(prompts, params))
    tight = int8_llm(tiny_llama, num_kv_blocks=24, preemption_mode="swap", swap_space=0.01)
    assert token_ids(tight.beam_search(prompts, params)) == expected
    assert tight.stats().num_swap_preemptions > 0


def test_a_prefix_hit_reuses_int8_blocks(roomy):
    prompt = prompts_of([41], seed=9)[0]
    first = roomy.generate([prompt], GREEDY, use_tqdm=False)
    hits = roomy.stats().prefix_cache_hits
    again = roomy.generate([prompt], GREEDY, use_tqdm=False)
    assert roomy.stats().prefix_cache_hits > hits
    assert token_ids(again) == token_ids(first)


def kl_from_float32(model, options: dict[str, object]) -> torch.Tensor:
    """Per-position KL(float32 pool || this pool) over teacher-forced windows of random tokens (half prompt
    step, half decoded), with `bench accuracy`'s harness."""
    windows = torch.tensor(prompts_of([48] * 4, seed=21))
    text = accuracy.Text(windows, split=24)
    base = accuracy.Configuration("float32", "pagedllm", torch.float32, {"block_size": 4})
    reference = accuracy.pagedllm_logprobs(model, base, text)
    config = accuracy.Configuration("int8", "pagedllm", torch.float32, {"block_size": 4} | options)
    logprobs = accuracy.pagedllm_logprobs(model, config, text)
    return (reference.exp() * (reference - logprobs)).sum(-1)


# The tiny model's wide random weights make confident, touchy logits: int8 KV measures a mean KL of 1.8e-3
# there (max 0.033), scales stored 2% off 3.3e-3, 5% off 1.0e-2.
MEAN_KL_BOUND = 2.5e-3
MAX_KL_BOUND = 0.05


def test_int8_kv_stays_close_to_float_and_a_corrupt_cache_does_not(tiny_llama, monkeypatch):
    kl = kl_from_float32(tiny_llama, {"kv_cache_dtype": "int8"})
    assert 0 < float(kl.mean()) < MEAN_KL_BOUND and float(kl.max()) < MAX_KL_BOUND, (kl.mean(), kl.max())
    # The same check fails when each row's scale is stored 5% off (its values then read 5% too large).
    quantize = kv_quant.quantize

    def off_by_five_percent(x: torch.Tensor) -> torch.Tensor:
        rows = quantize(x)
        rows[..., -kv_quant.SCALE_BYTES :] = (kv_quant.scales(rows) * 1.05).view(torch.int8)
        return rows

    monkeypatch.setattr(kv_quant, "quantize", off_by_five_percent)
    monkeypatch.setattr(fused, "rope_write_kv", lambda *args: None)  # the separate passes, which call quantize
    corrupt = kl_from_float32(tiny_llama, {"kv_cache_dtype": "int8"})
    assert float(corrupt.mean()) > MEAN_KL_BOUND or float(corrupt.max()) > MAX_KL_BOUND


def test_tensor_parallel_ranks_hold_their_heads_in_int8(tiny_llama, roomy):
    """Each of two ranks holds one of the two KV heads of every int8 block, scales included."""
    expected = token_ids(roomy.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
    llm = int8_llm(tiny_llama, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == expected
        assert [report.kv_heads for report in llm.engine.worker.shard_reports()] == [1, 1]
    finally:
        llm.engine.shutdown()
