"""Every CPU attention path against the plain reference: shuffled and shared blocks, edge lengths,
mixed prefill and decode, grouped-query ratios, head dims, block sizes, float32 and bfloat16; and the bf16
kernels within a bound from bf16's precision of exact attention, up to 4k positions.

The CPU paths are the C kernel's two implementations (AVX512-BF16 where this machine's compiler targets
it, and the portable C one every other machine runs), torch's SDPA for prefill chunks (here every chunk, the
other rows on the C kernel) and the torch fallback for machines without a compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.attention import AttentionMetadata, cpu, get_backend, paged_attention, write_kv
from pagedllm.attention.reference import gather_sequence
from pagedllm.worker.cache_engine import stored_layout

# (atol, rtol): bf16 keeps 8 bits of mantissa, so beyond magnitude 1 two correct roundings of the same
# float32 result can differ by one ulp (1/64 at magnitude 2..4): its tolerance must be relative too.
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-2, 1e-2)}
# The AVX512-BF16 kernel is compiled only where the CPU has it (test_native_kernel_builds_here... checks
# that it is there exactly then); elsewhere there is nothing of it to run.
IMPLEMENTATIONS = ["sdpa", *(["avx512"] if cpu.has_fast_bf16() else []), "portable", "torch"]
# What cache slots no sequence owns hold: the C kernel never reads them, so NaN there proves it; the torch
# path multiplies the padding of gathered blocks by a weight of 0, which needs them finite (as in the
# engine, whose pool starts zeroed and whose reused blocks hold stale K/V).
UNUSED_SLOTS = {"sdpa": float("nan"), "avx512": float("nan"), "portable": float("nan"), "torch": 7.0}
HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (8, 1, 128), (16, 2, 32)]  # (heads, KV heads, head dim): GQA 1, 3, 8


def cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx512_bf16" in cpuinfo.read_text()


def make_case(
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seq_lens,
    query_lens,
    seed=0,
    share=False,
    unused=0.0,
    layout=stored_layout,
):
    """Random K/V in shuffled blocks, stored by `layout` (the engine's, by default); with `share`, every
    sequence's table starts with the same blocks. Cache slots that belong to no sequence hold `unused`."""
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
        layout(k_cache.to(dtype)),
        layout(v_cache.to(dtype)),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
    )


def use(implementation, monkeypatch):
    """Route the CPU path to one implementation: "sdpa" takes every prefill chunk (in any dtype, on any CPU),
    the C kernel's every chunk."""
    monkeypatch.setattr(cpu, "runs_on_sdpa", lambda *args: implementation == "sdpa")
    if implementation == "torch":
        monkeypatch.setattr(cpu, "supports", lambda *args: False)
    elif implementation == "portable":
        monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)


def check(case, dtype, monkeypatch, implementation, query_scale=1.0, tolerance=None):
    use(implementation, monkeypatch)
    query, k_cache, v_cache, tables, lens, starts = case
    query = (query.float() * query_scale).to(dtype)
    # The C implementations really run on these caches (any strides), rather than falling back to torch.
    assert cpu.supports(query, k_cache, v_cache) == (implementation != "torch")
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
@pytest.mark.parametrize("block_size", [1, 16])
def test_token_major_caches_match_reference_too(monkeypatch, implementation, dtype, block_size):
    """The kernels take the caches' strides: position-major blocks (contiguous tensors) read as well as the
    engine's head-major ones, for decode tokens and prompt chunks."""
    lens, query_lens = [1, block_size + 1, 3 * block_size + 5, 70], [1, 1, 5, 70]
    case = make_case(
        block_size, 9, 3, 64, dtype, lens, query_lens, unused=UNUSED_SLOTS[implementation], layout=lambda c: c
    )
    assert case[1].is_contiguous()
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
    # Too few sequences to keep every thread busy: the kernel splits them by KV head (and one alone along its
    # context too).
    case = make_case(16, 9, 3, 64, dtype, lens, [1] * len(lens), seed=6, unused=UNUSED_SLOTS[implementation])
    check(case, dtype, monkeypatch, implementation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 24, 32])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("length", [300, 1999])
def test_one_decode_sequence_split_along_its_context(monkeypatch, dtype, block_size, softcap, length):
    """The portable kernel walks a lone decode sequence's KV heads in parts of whole blocks (24: parts of 3 chunks of
    16), from several threads, and merges their softmax states: the reference's output, capped or not."""
    case = make_case(block_size, 9, 3, 64, dtype, [length], [1], seed=8, unused=UNUSED_SLOTS["portable"])
    check_options(case, dtype, monkeypatch, "portable", 0, softcap, query_scale=3.0)


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
    monkeypatch.setattr(cpu, "attend", lambda call: calls.append(call) or kernel(call))
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


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("layout", [stored_layout, lambda c: c], ids=["head-major", "token-major"])
def test_write_kv_stores_at_slots_and_skips_padding(monkeypatch, layout, path):
    if path == "torch":  # a machine without a compiler
        monkeypatch.setattr(cpu, "library", lambda: None)
    k_cache = layout(torch.zeros(4, 2, 2, 3))
    v_cache = layout(torch.zeros(4, 2, 2, 3))
    key = torch.arange(18.0).view(3, 2, 3)
    write_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], -key[0])
    assert torch.equal(k_cache[0, 0], key[2])
    assert int((k_cache != 0).sum()) == 11  # key[2] holds one zero; nothing else was written


def test_native_kernel_builds_here_and_leaves_float_state_alone():
    # CI machines have gcc: the fast path must really be exercised, not silently skipped.
    assert cpu.library() is not None
    assert cpu.has_fast_bf16() == cpu_has_avx512_bf16()
    # A library linked with -ffast-math would switch the whole process to flush-to-zero.
    smallest_subnormal = 5e-324
    assert smallest_subnormal * 2 > 0


# Sliding windows and logit soft-capping (Mistral, Gemma 2/3), against the reference: the query at position p
# sees p - window < j <= p, and each scaled logit s becomes softcap * tanh(s / softcap).
# Decode tokens (lengths below, at and past the windows), a chunk after a prefix, a whole prompt, a long chunk.
WINDOW_LENS, WINDOW_QUERY_LENS = [1, 37, 40, 100, 80, 300], [1, 1, 1, 5, 80, 120]
# (window, softcap): window 1, smaller than every context, one sequence's length (37, and 16 = a block), larger
# than every context; soft-capping alone and with windows.
WINDOW_OPTIONS = [(1, 0.0), (5, 0.0), (16, 0.0), (37, 0.0), (1000, 0.0), (0, 5.0), (6, 2.0), (37, 30.0)]


def free_slid_blocks(tables, lens, query_lens, window, block_size, fill=-1):
    """What the engine does to blocks every query of a sequence has slid past: the block-table entries of
    blocks wholly before the window start of each sequence's first query token of the step become `fill`
    (-1, or a stale block id). Returns how many entries were replaced."""
    replaced = 0
    for s, (seq_len, q_len) in enumerate(zip(lens, query_lens, strict=True)):
        window_start = max(0, seq_len - q_len - window + 1) if window > 0 else 0
        tables[s, : window_start // block_size] = fill
        replaced += window_start // block_size
    return replaced


def check_options(case, dtype, monkeypatch, implementation, window, softcap, query_scale=1.0, tolerance=None):
    use(implementation, monkeypatch)
    query, k_cache, v_cache, tables, lens, starts = case
    query = (query.float() * query_scale).to(dtype)
    # The C implementations really run on these caches (any strides), rather than falling back to torch.
    assert cpu.supports(query, k_cache, v_cache) == (implementation != "torch")
    scale = query.shape[-1] ** -0.5
    options = {"window": window, "softcap": softcap}
    expected = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="reference", **options)
    got = paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="cpu", **options)
    atol, rtol = tolerance or TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    return expected


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize(("window", "softcap"), WINDOW_OPTIONS, ids=lambda v: str(v))
def test_windows_and_softcap_match_reference(
    monkeypatch, implementation, dtype, block_size, num_heads, num_kv_heads, head_dim, window, softcap
):
    case = make_case(
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        WINDOW_LENS,
        WINDOW_QUERY_LENS,
        seed=7,
        unused=UNUSED_SLOTS[implementation],
    )
    # Blocks behind every window are freed: their entries hold -1, which no backend may read.
    replaced = free_slid_blocks(case[3], WINDOW_LENS, WINDOW_QUERY_LENS, window, block_size)
    assert (replaced > 0) == (0 < window < 300)
    expected = check_options(case, dtype, monkeypatch, implementation, window, softcap)
    if window == 1:  # a decode token sees itself only: its output is its own value row
        query, k_cache, v_cache, tables, lens, starts = case
        for s in range(3):  # the first three sequences are decode tokens
            position = int(lens[s]) - 1
            own = v_cache[tables[s, position // block_size], position % block_size]
            own = own.float().repeat_interleave(num_heads // num_kv_heads, dim=0)
            torch.testing.assert_close(expected[int(starts[s])].float(), own, atol=1e-6, rtol=0)


def test_reference_agrees_with_transformers():
    # The semantics, from transformers itself: the sliding-window causal mask function (Mistral, Gemma 2/3)
    # and Gemma 2's eager attention with `attn_logit_softcapping`, for a chunk of 7 queries after 30 cached
    # positions, through shuffled blocks.
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    window, softcap, block_size, num_heads, num_kv_heads, head_dim = 5, 2.0, 4, 6, 2, 16
    query, k_cache, v_cache, tables, lens, starts = make_case(
        block_size, num_heads, num_kv_heads, head_dim, torch.float32, [37], [7], seed=10
    )
    scale = head_dim**-0.5
    got = paged_attention(
        query, k_cache, v_cache, tables, lens, starts, scale, backend="reference", window=window, softcap=softcap
    )
    positions = torch.arange(37)
    keys = k_cache[tables[0, positions // block_size].long(), positions % block_size]  # [37, H_kv, D]
    values = v_cache[tables[0, positions // block_size].long(), positions % block_size]
    allowed = sliding_window_causal_mask_function(window)
    mask = allowed(0, 0, torch.arange(30, 37)[:, None], torch.arange(37)[None, :])  # [7 queries, 37 keys]
    additive = torch.zeros(1, 1, 7, 37).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, training=False, head_dim=head_dim)
    expected, _ = eager_attention_forward(
        module,
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        additive,
        scaling=scale,
        softcap=softcap,
    )
    assert int(mask[0].sum()) == window  # the window counts the query's own position
    torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 24])
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (19, 0.0), (50, 0.0), (33, 20.0)], ids=lambda v: str(v))
def test_window_prefill_tiles_and_stale_blocks(monkeypatch, implementation, dtype, block_size, window, softcap):
    # Long prompts and chunks (several query tiles per KV head, each starting its walk at its own first
    # row's window) and decode tokens; the freed entries point at a stale block full of NaN, which a kernel
    # that read it, even masked, would spread (0 x NaN). A block size of 24 is no multiple of a chunk.
    lens, query_lens = [333, 200, 57, 500, 64], [333, 90, 1, 1, 64]
    case = make_case(block_size, 9, 3, 64, dtype, lens, query_lens, seed=8, unused=UNUSED_SLOTS[implementation])
    query, k_cache, v_cache, tables, _, _ = case
    stale = next(b for b in range(1, k_cache.shape[0]) if not bool((tables == b).any()))
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")
    assert free_slid_blocks(tables, lens, query_lens, window, block_size, fill=stale) > 0
    check_options(case, dtype, monkeypatch, implementation, window, softcap)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_freed_entries_far_out_of_range_are_never_read(monkeypatch, implementation, dtype):
    # A block id far past the pool: the C kernels would fault on it, torch's index_select raise.
    lens, query_lens = [300, 150, 81], [1, 40, 81]
    case = make_case(1, 9, 3, 64, dtype, lens, query_lens, seed=11, unused=UNUSED_SLOTS[implementation])
    assert free_slid_blocks(case[3], lens, query_lens, 20, 1, fill=2**31 - 1) > 0
    check_options(case, dtype, monkeypatch, implementation, 20, 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", [[700], [700, 33, 5]], ids=["one", "three"])
def test_a_few_windowed_decode_tokens_alone(monkeypatch, implementation, dtype, lens):
    # Split by KV head (few items), a window that starts mid-block, -1 before it.
    case = make_case(16, 9, 3, 64, dtype, lens, [1] * len(lens), seed=9, unused=UNUSED_SLOTS[implementation])
    free_slid_blocks(case[3], lens, [1] * len(lens), 100, 16)
    check_options(case, dtype, monkeypatch, implementation, 100, 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 24])
def test_softcap_bounds_large_scores(monkeypatch, implementation, dtype, window):
    # Scores in the hundreds are capped at +-softcap: the capped softmax is far from the plain one, and stays
    # exact where tanh saturates.
    case = make_case(16, 9, 3, 64, dtype, [200, 97], [1, 97], seed=5, unused=UNUSED_SLOTS[implementation])
    capped = check_options(case, dtype, monkeypatch, implementation, window, 10.0, query_scale=40.0)
    query, k_cache, v_cache, tables, lens, starts = case
    query = (query.float() * 40.0).to(dtype)
    plain = paged_attention(query, k_cache, v_cache, tables, lens, starts, 0.125, backend="reference", window=window)
    assert (capped.float() - plain.float()).abs().max() > 0.1


def test_kernel_tanh_is_accurate():
    x = torch.cat([torch.linspace(-20, 20, 400_001), torch.logspace(-30, 1, 10_000), -torch.logspace(-30, 1, 10_000)])
    exact = torch.tanh(x.double())
    got = cpu.kernel_tanh(x).double()
    assert float(((got - exact).abs() / exact.abs().clamp_min(1e-38)).max()) < 3e-7
    assert cpu.kernel_tanh(torch.tensor([float("inf"), -float("inf"), 0.0])).tolist() == [1.0, -1.0, 0.0]


def test_window_and_softcap_reach_every_backend_call(monkeypatch):
    # The engine's per-layer call passes them as keywords; the C kernel gets them in one call.
    calls = []
    kernel = cpu.attend
    monkeypatch.setattr(cpu, "attend", lambda call: calls.append((call.window, call.softcap)) or kernel(call))
    case = make_case(16, 9, 3, 64, torch.bfloat16, [50, 9, 30], [50, 1, 4], unused=float("nan"))
    query, k_cache, v_cache, tables, lens, starts = case
    metadata = AttentionMetadata.build(tables, lens, starts, 16, "cpu")
    got = get_backend(None, "cpu")(query, k_cache, v_cache, metadata, 0.125, window=8, softcap=3.0)
    expected = paged_attention(
        query, k_cache, v_cache, tables, lens, starts, 0.125, backend="reference", window=8, softcap=3.0
    )
    assert calls == [(8, 3.0)]
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="window and softcap"):
        paged_attention(query, k_cache, v_cache, tables, lens, starts, 0.125, window=-1)


# The bf16 kernels against exact attention on the same bf16 inputs, with a bound from bf16's precision
# rather than a fixed tolerance. bf16 keeps 8 significant bits: one rounding to nearest moves a value by at
# most half an ulp, 2^-8 of it. The AVX512 kernel rounds twice:
#  - each probability p_j, before P.V (both sums use the rounded ones): out' = sum_j p_j (1 + d_j) v_j /
#    sum_j p_j (1 + d_j), so out' - out = sum_j p_j d_j (v_j - out) / sum_j p_j (1 + d_j), at most 2^-8 of
#    the weighted mean of |v_j - out|, itself at most the weighted standard deviation of v (Jensen);
#  - the output, by at most 2^-8 of it.
# The portable kernel rounds the output only. float32's sums of n terms are good to n 2^-24 of the sum of
# their magnitudes (Higham's gamma_n), here at most spread + |out|; exp2's polynomial (~1e-7) is far below.
# So both stay within (2^-8 + n 2^-24) x (spread + |out|), element by element; P.V accumulated in bf16, or
# an output an ulp or two off, do not. Torch's SDPA sums the unrounded probabilities but multiplies V by the
# rounded ones: out' - out = sum_j p_j d_j v_j / sum_j p_j, at most 2^-8 of the weighted mean of |v_j|, itself
# at most |out| + spread; with the output's rounding, within (2^-8 + n 2^-24) x (spread + 2 |out|).
BF16_ROUNDING = 2.0**-8
FLOAT32_ROUNDING = 2.0**-24
BF16_IMPLEMENTATIONS = [i for i in IMPLEMENTATIONS if i != "torch"]
# (context lengths, query tokens): decode tokens of up to 4k positions (one item each); one 4k decode token
# alone (split by KV head); a 200-token chunk after a 3896-token prefix, a whole 1100-token prompt (tiles of
# query rows) and a decode token in one batch.
LONG_CASES = {
    "decode": ([4096, 3001, 2065, 700, 17, 1], [1] * 6),
    "one_decode": ([4096], [1]),
    "prefill": ([4096, 1100, 2500], [200, 1100, 1]),
}


def exact_attention(query, k_cache, v_cache, tables, lens, starts, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over the inputs as given, and each output element's spread: the standard deviation
    of its value column under the query's attention weights."""
    group = query.shape[1] // k_cache.shape[2]
    out, spread = torch.empty(query.shape, dtype=torch.float64), torch.empty(query.shape, dtype=torch.float64)
    for s, seq_len in enumerate(lens.tolist()):
        start, end = int(starts[s]), int(starts[s + 1])
        keys = gather_sequence(k_cache, tables[s], seq_len).double().repeat_interleave(group, dim=1).transpose(0, 1)
        values = gather_sequence(v_cache, tables[s], seq_len).double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].double().transpose(0, 1)  # [H, queries, D]
        scores = q @ keys.transpose(1, 2) * scale  # [H, queries, positions]
        positions = torch.arange(seq_len - (end - start), seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        mean = weights @ values
        out[start:end] = mean.transpose(0, 1)
        spread[start:end] = (weights @ values.square() - mean.square()).clamp_min(0).sqrt().transpose(0, 1)
    return out, spread


@pytest.mark.parametrize("implementation", BF16_IMPLEMENTATIONS)
@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("case", list(LONG_CASES))
def test_bf16_kernels_within_bf16_precision_of_exact_attention_up_to_4k(
    monkeypatch, implementation, block_size, num_heads, num_kv_heads, head_dim, case
):
    use(implementation, monkeypatch)
    lens, query_lens = LONG_CASES[case]
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(
        block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, lens, query_lens, seed=12, unused=float("nan")
    )
    # Outputs of order 1: every value column has an offset of magnitude 1 to 2 (random noise around it of
    # 0.5), and queries twice as large make the weights neither flat nor one-hot.
    gen = torch.Generator().manual_seed(13)
    sign = torch.randint(0, 2, (num_kv_heads, head_dim), generator=gen) * 2 - 1
    offset = sign * (1 + torch.rand(num_kv_heads, head_dim, generator=gen))
    v_cache = (v_cache.float() * 0.5 + offset).to(torch.bfloat16)
    query = (query.float() * 2).to(torch.bfloat16)
    scale = head_dim**-0.5
    got = paged_attention(query, k_cache, v_cache, tables, seq_lens, starts, scale, backend="cpu").double()
    exact, spread = exact_attention(query, k_cache, v_cache, tables, seq_lens, starts, scale)
    assert float(exact.abs().median()) > 0.5
    magnitude = spread + (2 if implementation == "sdpa" else 1) * exact.abs()
    bound = (BF16_ROUNDING + max(lens) * FLOAT32_ROUNDING) * magnitude
    excess = (got - exact).abs() / bound
    worst = int(excess.argmax())
    assert float(excess.max()) <= 1.0, (
        f"{got.flatten()[worst]:.6f} vs exact {exact.flatten()[worst]:.6f}: {float(excess.max()):.2f}x the bound"
    )


def test_sdpa_takes_only_long_bf16_chunks_on_amx(monkeypatch):
    monkeypatch.setattr(cpu, "has_amx", lambda: True)
    assert cpu.runs_on_sdpa(256, 256, torch.bfloat16)
    assert cpu.runs_on_sdpa(64, 600, torch.bfloat16)
    assert not cpu.runs_on_sdpa(256, 256, torch.float32)
    assert not cpu.runs_on_sdpa(48, 4000, torch.bfloat16)  # too few rows for a tile
    assert not cpu.runs_on_sdpa(128, 128, torch.bfloat16)  # too few scores
    monkeypatch.setattr(cpu, "has_amx", lambda: False)
    assert not cpu.runs_on_sdpa(2048, 2048, torch.bfloat16)
