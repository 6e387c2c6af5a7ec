"""The Triton kernels against the plain reference. Without a GPU they run in Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors), so shapes stay small: the interpreter runs each program in numpy.

The interpreter converts float32 to bf16 by truncation where the GPU rounds to nearest; the bf16
tolerance (relative 1e-2, more than one bf16 ulp) covers both."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()


def interpret_triton_on_cpu() -> None:
    """`triton.jit` decides at definition time whether a function is interpreted. torch._dynamo imports
    triton as soon as it is installed (conftest's transformers import gets there first), so by now
    triton.language's own jit functions (tl.zeros, tl.max, tl.sum, ...) may be compiled-mode
    functions, which the interpreter refuses to call: wrap them for the interpreter. Compiled-mode
    triton cannot run without a GPU, so nothing else in this process loses anything."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops defines its kernels
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name.startswith("triton.language") and module is not None:
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))


pytest.importorskip("triton")
if not ON_GPU:
    interpret_triton_on_cpu()

from pagedllm.attention import AttentionCall, AttentionMetadata, paged_attention, triton_ops  # noqa: E402
from pagedllm.attention import write_kv as cpu_write_kv  # noqa: E402
from pagedllm.worker.cache_engine import stored_layout  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-2, 1e-2)}
# (num_heads, num_kv_heads, head_dim): grouped-query ratios 1, 3 and 8, head dims 64 and 128.
HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (8, 1, 128)]
SMALL_PARTITION = 32


def make_case(
    block_size: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    seed: int = 0,
    shared_prefix_blocks: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random caches, stored as the engine stores them (head-major blocks), and queries; each sequence's blocks
    are drawn from a shuffled pool (non-contiguous), and the first `shared_prefix_blocks` blocks of every table
    are the same physical blocks (a prefix hit)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    k_cache = stored_layout(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype))
    v_cache = stored_layout(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype))
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [pool.pop() for _ in range(shared_prefix_blocks)]
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        own = [pool.pop() for _ in range(count - min(count, shared_prefix_blocks))]
        tables[s, :count] = torch.tensor(shared[:count] + own)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (query, k_cache, v_cache, tables, lens, starts))


def reference(case: tuple[torch.Tensor, ...], **options: float) -> torch.Tensor:
    """The reference, with the same `window` and `softcap` options if any."""
    query, k_cache, v_cache, tables, lens, starts = (t.cpu() for t in case)
    scale = query.shape[-1] ** -0.5
    return paged_attention(query, k_cache, v_cache, tables, lens, starts, scale, backend="reference", **options)


def triton_attend(
    case: tuple[torch.Tensor, ...], scale: float, window: int = 0, softcap: float = 0.0, **options: int
) -> torch.Tensor:
    """The Triton backend's call, with the layer's `window` and `softcap` and its own options (`partition_size`,
    `version`)."""
    query, k_cache, v_cache, tables, lens, starts = case
    metadata = AttentionMetadata.build(tables, lens, starts, k_cache.shape[1], DEVICE)
    return triton_ops.attend(AttentionCall(query, k_cache, v_cache, metadata, scale, window, softcap), **options)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=atol, rtol=rtol)


def edge_lengths(block_size: int) -> list[int]:
    """1, block_size - 1, block_size, block_size + 1, and one spanning several small partitions."""
    return [1, max(block_size - 1, 1), block_size, block_size + 1, 3 * SMALL_PARTITION + 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_mixed_batch_matches_reference(dtype, block_size, heads):
    # Decode tokens, chunks after cached prefixes (one longer than a q-block of every group size), a whole prompt.
    lens = [*edge_lengths(block_size), 70]
    query_lens = [1, 1, block_size, 1, 70, 70]
    case = make_case(block_size, heads, dtype, lens, query_lens, shared_prefix_blocks=1)
    scale = heads[2] ** -0.5
    got = paged_attention(*case, scale, backend="triton")
    assert_matches(got, reference(case))
    # The whole batch in one mixed launch: several sequences of every kind share its grid.
    query, k_cache, v_cache, tables, lens, starts = case
    one_launch = torch.empty_like(query)
    metadata = AttentionMetadata.build(tables, lens, starts, block_size, DEVICE)
    triton_ops.mixed(AttentionCall(query, k_cache, v_cache, metadata, scale), one_launch)
    assert_matches(one_launch, reference(case))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_decode_kernels_match_reference(version, dtype, block_size, heads):
    lens = edge_lengths(block_size)
    case = make_case(block_size, heads, dtype, lens, [1] * len(lens), seed=1, shared_prefix_blocks=2)
    scale = heads[2] ** -0.5
    got = triton_attend(case, scale, partition_size=SMALL_PARTITION, version=version)
    assert_matches(got, reference(case))


def test_partitioned_decode_equals_one_pass_on_a_long_context():
    # Four default-size partitions of very different maxima: the log-sum-exp merge must be exact.
    lens = [1900, 513, 512, 40]
    case = make_case(16, (8, 2, 64), torch.float32, lens, [1] * len(lens), seed=2)
    query, k_cache = case[0], case[1]
    k_cache *= torch.linspace(0.2, 3.0, k_cache.shape[0], device=DEVICE)[:, None, None, None]  # in place
    scale = query.shape[-1] ** -0.5
    one_pass = triton_attend(case, scale, version=1)
    partitioned = triton_attend(case, scale, version=2)
    torch.testing.assert_close(partitioned, one_pass, atol=2e-6, rtol=2e-6)
    assert_matches(partitioned, reference(case))


def test_public_call_honours_partition_size(monkeypatch):
    chosen = []
    rule = triton_ops.choose_decode_version

    def recording_rule(*args: int) -> int:
        chosen.append((args, rule(*args)))
        return chosen[-1][1]

    monkeypatch.setattr(triton_ops, "choose_decode_version", recording_rule)
    case = make_case(16, (4, 2, 64), torch.float32, [300, 17], [1, 1], seed=3)
    got = paged_attention(*case, 0.125, backend="triton", partition_size=SMALL_PARTITION)
    # Few sequences and heads, a context of several partitions: partitioned.
    assert chosen == [((300, 2, 4, SMALL_PARTITION), 2)]
    assert_matches(got, reference(case))


def test_block_size_that_is_not_a_power_of_two():
    lens, query_lens = [1, 23, 24, 25, 100], [1, 1, 24, 1, 30]
    case = make_case(24, (9, 3, 64), torch.float32, lens, query_lens, seed=6, shared_prefix_blocks=1)
    got = paged_attention(*case, 0.125, backend="triton")
    assert_matches(got, reference(case))


def free_slid_blocks(case: tuple[torch.Tensor, ...], window: int, fill: int = -1) -> int:
    """What the engine does to the blocks every query of a sequence has slid past: the block-table entries
    of blocks wholly before the window start of each sequence's first query token become `fill` (-1, or a
    stale block id). Returns how many entries were replaced."""
    _, k_cache, _, tables, lens, starts = case
    block_size, replaced = k_cache.shape[1], 0
    for s, seq_len in enumerate(lens.tolist()):
        first_position = seq_len - int(starts[s + 1] - starts[s])
        freed = max(0, first_position - window + 1) // block_size if window > 0 else 0
        tables[s, :freed] = fill
        replaced += freed
    return replaced


# (window, softcap): window 1, smaller than every context, one sequence's length (17), larger than every
# context; soft-capping alone and with a window.
WINDOW_OPTIONS = [(1, 0.0), (6, 0.0), (17, 0.0), (1000, 0.0), (0, 5.0), (6, 2.0)]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize(("window", "softcap"), WINDOW_OPTIONS, ids=lambda v: str(v))
def test_windows_and_softcap_match_reference(block_size, heads, window, softcap):
    # Decode tokens, a chunk after a prefix that spans two q-blocks of group 3 (the second walks from its own
    # first row's window), a whole prompt; the blocks behind every window are freed (-1 in the table).
    lens, query_lens = [1, 17, 45, 60, 24], [1, 1, 1, 30, 24]
    case = make_case(block_size, heads, torch.float32, lens, query_lens, seed=7)
    assert (free_slid_blocks(case, window) > 0) == (0 < window < max(lens))
    options = {"window": window, "softcap": softcap}
    expected = reference(case, **options)
    scale = heads[2] ** -0.5
    assert_matches(paged_attention(*case, scale, backend="triton", **options), expected)
    query, k_cache, v_cache, tables, seq_lens, starts = case
    one_launch = torch.empty_like(query)
    metadata = AttentionMetadata.build(tables, seq_lens, starts, block_size, DEVICE)
    triton_ops.mixed(AttentionCall(query, k_cache, v_cache, metadata, scale, **options), one_launch)
    assert_matches(one_launch, expected)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (40, 0.0), (1000, 0.0), (40, 3.0)], ids=lambda v: str(v))
def test_windowed_decode_kernels_match_reference(version, dtype, block_size, window, softcap):
    # v2 counts its partitions from each sequence's window start: a window of 40 over partitions of 32
    # positions makes two of them, the second partial; freed entries point at a stale block full of NaN,
    # which a kernel that read it, even masked, would spread (0 x NaN).
    lens = edge_lengths(block_size)
    case = make_case(block_size, (9, 3, 64), dtype, lens, [1] * len(lens), seed=1)
    k_cache, v_cache, tables = case[1], case[2], case[3]
    stale = next(b for b in range(k_cache.shape[0]) if not bool((tables == b).any()))
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")
    assert (free_slid_blocks(case, window, fill=stale) > 0) == (window < 100)
    options = {"window": window, "softcap": softcap}
    got = triton_attend(case, 0.125, partition_size=SMALL_PARTITION, version=version, **options)
    expected = paged_attention(*(t.cpu() for t in case), 0.125, backend="reference", **options)
    assert_matches(got, expected)


def test_windowed_decode_version_counts_the_window_only(monkeypatch):
    # A window of one partition: one pass, however long the context.
    chosen = []
    rule = triton_ops.choose_decode_version
    monkeypatch.setattr(triton_ops, "choose_decode_version", lambda *args: chosen.append(args) or rule(*args))
    case = make_case(16, (4, 2, 64), torch.float32, [300, 17], [1, 1], seed=3)
    free_slid_blocks(case, SMALL_PARTITION)
    got = triton_attend(case, 0.125, partition_size=SMALL_PARTITION, window=SMALL_PARTITION)
    assert chosen == [(SMALL_PARTITION, 2, 4, SMALL_PARTITION)]
    assert_matches(got, paged_attention(*case, 0.125, backend="reference", window=SMALL_PARTITION))


@pytest.mark.parametrize(
    ("max_seq_len", "num_seqs", "num_heads", "version"),
    [
        (512, 1, 32, 1),  # one partition suffices
        (4096, 17, 32, 1),  # 544 (sequence, head) pairs already fill the GPU
        (4096, 16, 32, 2),  # 512 pairs are not more than 512
        (8193, 256, 32, 2),  # past 8192 always partitioned
    ],
)
def test_decode_version_rule(max_seq_len, num_seqs, num_heads, version):
    assert triton_ops.choose_decode_version(max_seq_len, num_seqs, num_heads, 512) == version


def test_engine_route_matches_reference():
    # The engine's step: metadata built from CPU tensors and moved to the device once, then the per-layer
    # call puts decode rows in one launch and each prefill chunk in its own.
    lens, query_lens = [40, 17, 33, 5], [1, 17, 9, 1]
    case = make_case(16, (6, 2, 64), torch.float32, lens, query_lens, seed=4, shared_prefix_blocks=1)
    query, k_cache, v_cache, tables, seq_lens, starts = case
    metadata = AttentionMetadata.build(tables.cpu(), seq_lens.cpu(), starts.cpu(), 16, DEVICE)
    assert metadata.decode is not None and metadata.decode.rows.device == query.device
    assert all(chunk.query_start_loc.device == query.device for chunk in metadata.prefills)
    got = triton_ops.attend(AttentionCall(query, k_cache, v_cache, metadata, 0.125))
    expected = paged_attention(*(t.cpu() for t in case), 0.125, backend="reference")
    assert_matches(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_kernel_stores_at_slots_and_skips_negative(dtype, block_size):
    num_blocks, num_kv_heads, head_dim, num_tokens = 10, 3, 64, 9
    gen = torch.Generator().manual_seed(5)
    # Keys and values as strided views of one projection output, as the model produces them.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 0], fused[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 4]] = -1
    expected_k = stored_layout(torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype))
    expected_v = torch.zeros_like(expected_k)
    cpu_write_kv(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = torch.zeros_like(expected_k, device=DEVICE), torch.zeros_like(expected_v, device=DEVICE)
    triton_ops.write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)
    assert int((k_cache != 0).any(dim=-1).sum()) == (num_tokens - 2) * num_kv_heads  # padding wrote nothing


# Compiles every kernel for sm_90 (Hopper) in a process where triton is not interpreted: the interpreter
# runs Python, so it never meets what only the compiler checks (types carried through loops, constexpr
# use, tl.dot's shape rules). Needs no GPU: triton ships the compiler and ptxas.
HOPPER_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.attention import triton_ops as T

dtype, precision = sys.argv[1], sys.argv[2]
geometry = T.Geometry(group=4, head_dim=128, block_size=16, dot_precision=precision, int8_kv=False)
decode = {"GROUP": 4, "GROUP_PAD": geometry.group_pad, **geometry.constexprs()}
mixed = {"GROUP": 4, "BLOCK_M": T.MIXED_BLOCK_M, "BLOCK_Q": T.MIXED_BLOCK_M // 4, **geometry.constexprs()}
merge = {"PARTITION": 512, "PARTS_PAD": 16, "HEAD_DIM": 128, "HEAD_PAD": 128}
write = {"NUM_KV_HEADS": 8, "HEADS_PAD": 8, "HEAD_DIM": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16}
kernels = [(T._write_kv_kernel, write, 4)]
# Plain, windowed, soft-capped, both.
for windowed, softcap in ((False, False), (True, False), (False, True), (True, True)):
    options = {"WINDOWED": windowed, "SOFTCAP": softcap}
    kernels += [
        (T._decode_kernel, {"PARTITIONED": False, "PARTITION": 512, **decode, **options}, geometry.decode_num_warps),
        (T._decode_kernel, {"PARTITIONED": True, "PARTITION": 512, **decode, **options}, geometry.decode_num_warps),
        (T._mixed_kernel, {**mixed, **options}, T.MIXED_NUM_WARPS),
    ]
    if not softcap:
        kernels.append((T._merge_partitions_kernel, {**merge, "WINDOWED": windowed}, 4))
DATA = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"}
STATS = {"m_out_ptr", "l_out_ptr", "acc_out_ptr", "m_ptr", "l_ptr", "acc_ptr"}


def arg_type(name):
    if name in DATA:
        return "*" + dtype
    if name in STATS:
        return "*fp32"
    if name.endswith("_ptr"):
        return "*i64" if name == "slots_ptr" else "*i32"
    return "fp32" if name in ("qk_scale", "cap_in", "cap_out") else "i32"


for kernel, constants, warps in kernels:
    signature = {p.name: "constexpr" if p.is_constexpr else arg_type(p.name) for p in kernel.params}
    source = ASTSource(kernel, signature, constexprs=constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
"""


@pytest.mark.parametrize(("dtype", "precision"), [("bf16", "tf32"), ("fp32", "ieee")])
def test_kernels_compile_for_hopper(dtype, precision):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", HOPPER_COMPILE, dtype, precision]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
