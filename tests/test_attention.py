"""Every CPU attention path against the plain reference: shuffled and shared blocks, edge lengths,
mixed prefill and decode, grouped-query ratios, head dims, block sizes, float32 and bfloat16.

The CPU paths are the C kernel's two implementations (AVX512-BF16 where this machine's compiler targets
it, and the portable C one every other machine runs) and the torch fallback for machines without a
compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.attention import AttentionMetadata, cpu, get_backend, paged_attention, write_kv

# (atol, rtol): bf16 keeps 8 bits of mantissa, so beyond magnitude 1 two correct roundings of the same
# float32 result can differ by one ulp (1/64 at magnitude 2..4): its tolerance must be relative too.
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-2, 1e-2)}
IMPLEMENTATIONS = ["avx512", "portable", "torch"]
# What cache slots no sequence owns hold: the C kernel never reads them, so NaN there proves it; the torch
# path multiplies the padding of gathered blocks by a weight of 0, which needs them finite (as in the
# engine, whose pool starts zeroed and whose reused blocks hold stale K/V).
UNUSED_SLOTS = {"avx512": float("nan"), "portable": float("nan"), "torch": 7.0}
HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (8, 1, 128), (16, 2, 32)]  # (heads, KV heads, head dim): GQA 1, 3, 8


def cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx512_bf16" in cpuinfo.read_text()


def make_case(
    block_size, num_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens, seed=0, share=False, unused=0.0
):
    """Random K/V in shuffled blocks; with `share`, every sequence's table starts with the same blocks.
    Cache slots that belong to no sequence hold `unused`."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), unused)
    v_cache = torch.full_like(k_cache, unused)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = torch.tensor(order[:count]) if share else torch.tensor(order[-count:])
        if not share:
            del order[-count:]
        blocks = tables[s, :count].long()
        for cache in (k_cache, v_cache):
            written = cache[blocks].view(-1, num_kv_heads, head_dim)
            written[: seq_lens[s]] = torch.randn(seq_lens[s], num_kv_heads, head_dim, generator=gen)
            cache[blocks] = written.view(count, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen)
    return (
        query.to(dtype),
        k_cache.to(dtype),
        v_cache.to(dtype),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
    )


def use(implementation, monkeypatch):
    """Route the CPU path to one implementation."""
    if implementation == "torch":
        monkeypatch.setattr(cpu, "supports", lambda *args: False)
    elif implementation == "portable":
        monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    elif not cpu.has_fast_bf16():
        pytest.skip("the compiler does not target AVX512-BF16 here")


def check(case, dtype, monkeypatch, implementation, query_scale=1.0, tolerance=None):
    use(implementation, monkeypatch)
    query, k_cache, v_cache, tables, lens, starts = case
    query = (query.float() * query_scale).to(dtype)
    scale = query.shape[-1] ** -0.5
    expected = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="reference")
    got = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="cpu")
    atol, rtol = tolerance or TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_SHAPES)
def test_decode_and_mixed_batches_match_reference(
    monkeypatch, implementation, dtype, block_size, num_heads, num_kv_heads, head_dim
):
    lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 5, 70]
    query_lens = [1, 1, block_size, 1, 5, 70]  # decode tokens, a chunk after a prefix, a whole prompt
    case = make_case(
        block_size, num_heads, num_kv_heads, head_dim, dtype, lens, query_lens, unused=UNUSED_SLOTS[implementation]
    )
    check(case, dtype, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_SHAPES)
def test_prefill_chunks_match_reference(
    monkeypatch, implementation, dtype, block_size, num_heads, num_kv_heads, head_dim
):
    # Whole prompts of edge and long lengths (several query tiles, a partial last one), and chunks of those
    # lengths after cached prefixes that end mid-block and on a block boundary, all in one batch.
    lens = [2, block_size + 1, 333, block_size + 7, 2 * block_size + 40, 300]
    query_lens = [2, block_size + 1, 333, max(block_size - 1, 2), block_size + 1, 100]
    case = make_case(
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        lens,
        query_lens,
        seed=1,
        unused=UNUSED_SLOTS[implementation],
    )
    check(case, dtype, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 48), (4, 2, 96), (16, 1, 64)])
def test_other_head_dims_and_wide_groups(monkeypatch, implementation, dtype, num_heads, num_kv_heads, head_dim):
    # 48 is no multiple of 32 (the portable kernel runs it whatever is asked); 96 takes the AVX512 kernel's
    # generic head dim; 16 query heads per KV head make 3-token prefill tiles and a 16-row decode item.
    lens, query_lens = [1, 40, 120, 37], [1, 40, 9, 1]
    case = make_case(
        16, num_heads, num_kv_heads, head_dim, dtype, lens, query_lens, seed=2, unused=UNUSED_SLOTS[implementation]
    )
    check(case, dtype, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_sequences_sharing_blocks_and_long_contexts(monkeypatch, implementation, num_kv_heads):
    lens = [1500, 1300, 17, 900]
    case = make_case(
        16, 8, num_kv_heads, 64, torch.float32, lens, [1] * 4, seed=3, share=True, unused=UNUSED_SLOTS[implementation]
    )
    check(case, torch.float32, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", [[700], [700, 33, 5]], ids=["one", "three"])
def test_a_few_decode_tokens_alone(monkeypatch, implementation, dtype, lens):
    # Too few sequences to keep every thread busy: the kernel splits them by KV head.
    case = make_case(16, 9, 3, 64, dtype, lens, [1] * len(lens), seed=6, unused=UNUSED_SLOTS[implementation])
    check(case, dtype, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_shared_prefix_chunks_in_bf16(monkeypatch, implementation):
    # Two sequences reading the same cached blocks, each with its own chunk after them.
    case = make_case(
        16, 9, 3, 64, torch.bfloat16, [420, 400], [60, 1], seed=4, share=True, unused=UNUSED_SLOTS[implementation]
    )
    check(case, torch.bfloat16, monkeypatch, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_large_scores_stay_finite_and_exact(monkeypatch, implementation, dtype):
    # Scores in the hundreds: the running maximum moves by far more than exp can take unshifted, and a
    # decode token's weights concentrate on a few positions. A float32 score of 150 is only good to about
    # 2e-5, and so are the weights, hence float32's wider tolerance here.
    case = make_case(16, 9, 3, 64, dtype, [200, 97], [1, 97], seed=5, unused=UNUSED_SLOTS[implementation])
    tolerance = (1e-4, 1e-4) if dtype == torch.float32 else None
    check(case, dtype, monkeypatch, implementation, query_scale=40.0, tolerance=tolerance)


def test_engine_call_runs_the_kernel_for_prefill_and_decode(monkeypatch):
    # The engine's per-layer call (the CPU's default backend on the step's metadata) must reach the C kernel
    # once for the whole batch, whole prompts included, rather than torch's attention.
    calls = []
    kernel = cpu.attend
    monkeypatch.setattr(cpu, "attend", lambda *args: calls.append(args) or kernel(*args))
    case = make_case(16, 9, 3, 64, torch.bfloat16, [50, 9, 30], [50, 1, 4], unused=float("nan"))
    query, k_cache, v_cache, tables, lens, starts = case
    metadata = AttentionMetadata.build(tables, lens, starts, 16, "cpu")
    got = get_backend(None, "cpu")(query, k_cache, v_cache, metadata, 0.125)
    expected = paged_attention(query, k_cache, v_cache, tables, lens, starts, 0.125, backend="reference")
    assert len(calls) == 1
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_metadata_splits_decode_rows_from_prefill_chunks():
    tables = torch.tensor([[4, 5, 0], [7, 0, 0], [1, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 3, 40], dtype=torch.int32)
    starts = torch.tensor([0, 1, 4, 5], dtype=torch.int32)  # a decode token, a 3-token chunk, a decode token
    metadata = AttentionMetadata.build(tables, lens, starts, 16, "cpu")
    assert metadata.decode is not None
    assert metadata.decode.rows.tolist() == [0, 4] and metadata.decode.max_seq_len == 40
    assert metadata.decode.block_tables.tolist() == [[4, 5, 0], [1, 2, 3]]
    (chunk,) = metadata.prefills
    assert chunk.rows == slice(1, 4) and chunk.seq_len == 3
    assert chunk.block_tables.tolist() == [[7, 0, 0]] and chunk.query_start_loc.tolist() == [0, 3]


def test_write_kv_stores_at_slots_and_skips_padding():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    write_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1, 0], key[0, 0]) and torch.equal(v_cache[2, 1, 0], -key[0, 0])
    assert torch.equal(k_cache[0, 0, 0], key[2, 0])
    assert int((k_cache != 0).sum()) == 5  # key[2] holds one zero; nothing else was written


def test_native_kernel_builds_here_and_leaves_float_state_alone():
    # CI machines have gcc: the fast path must really be exercised, not silently skipped.
    assert cpu.library() is not None
    assert cpu.has_fast_bf16() == cpu_has_avx512_bf16()
    # A library linked with -ffast-math would switch the whole process to flush-to-zero.
    smallest_subnormal = 5e-324
    assert smallest_subnormal * 2 > 0
