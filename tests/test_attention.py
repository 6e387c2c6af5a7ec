"""Every CPU attention path against the plain reference: shuffled and shared blocks, edge lengths,
mixed prefill and decode, grouped-query ratios, head dims, block sizes, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import native, paged_attention, write_kv

# (atol, rtol): bf16 keeps 8 bits of mantissa, so beyond magnitude 1 two correct roundings of the same
# float32 result can differ by one ulp (1/64 at magnitude 2..4): its tolerance must be relative too.
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-2, 1e-2)}


def make_case(block_size, num_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens, seed=0, share=False):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = torch.tensor(order[:count]) if share else torch.tensor(order[-count:])
        if not share:
            del order[-count:]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def check(case, dtype, monkeypatch, use_native):
    if not use_native:
        monkeypatch.setattr(native, "supports", lambda *args: False)
    query, k_cache, v_cache, tables, lens, starts = case
    scale = query.shape[-1] ** -0.5
    expected = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="reference")
    got = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="cpu")
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 1, 128), (16, 2, 32)])
def test_decode_and_mixed_batches_match_reference(
    monkeypatch, use_native, dtype, block_size, num_heads, num_kv_heads, head_dim
):
    lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 5, 70]
    query_lens = [1, 1, block_size, 1, 5, 70]  # decode tokens, a chunk after a prefix, a whole prompt
    case = make_case(block_size, num_heads, num_kv_heads, head_dim, dtype, lens, query_lens)
    check(case, dtype, monkeypatch, use_native)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_sequences_sharing_blocks_and_long_contexts(monkeypatch, use_native, num_kv_heads):
    lens = [1500, 1300, 17, 900]
    case = make_case(16, 8, num_kv_heads, 64, torch.float32, lens, [1, 1, 1, 1], seed=3, share=True)
    check(case, torch.float32, monkeypatch, use_native)


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
    assert native.library() is not None
    # A library linked with -ffast-math would switch the whole process to flush-to-zero.
    smallest_subnormal = 5e-324
    assert smallest_subnormal * 2 > 0
