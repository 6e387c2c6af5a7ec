"""The fused C element-wise ops against their torch forms (which round where transformers does)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.models import fused
from pagedllm.worker.cache_engine import stored_layout


@pytest.fixture
def torch_forms(monkeypatch: pytest.MonkeyPatch):
    """Run a function of `fused` with the C library hidden, i.e. through its torch form."""

    def call(name: str, *args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(fused, "library", lambda: None)
            return getattr(fused, name)(*args, **kwargs)

    return call


def test_the_library_builds_here():
    assert fused.library() is not None


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same sign assumed where they differ by one)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        # The float32 sum order and exp differ by ~1e-7, which can move a rounding by one bf16 ulp.
        ulps = bf16_ulps(out, expected)
        assert int(ulps.max()) <= 1
        assert float((ulps == 0).float().mean()) > 0.99
    else:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm(dtype, rows, torch_forms):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    weight = torch.randn(576).to(dtype)
    assert_matches(fused.rms_norm(x, weight, 1e-5), torch_forms("rms_norm", x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_adds_the_residual_in_place_first(dtype, torch_forms):
    torch.manual_seed(1)
    x, stream = torch.randn(33, 64).to(dtype), torch.randn(33, 64).to(dtype)
    weight = torch.randn(64).to(dtype)
    residual_c, residual_torch = stream.clone(), stream.clone()
    out = fused.rms_norm(x, weight, 1e-6, residual_c)
    expected = torch_forms("rms_norm", x, weight, 1e-6, residual_torch)
    # The add rounds once in both: the updated streams are identical, bit for bit.
    assert torch.equal(residual_c, residual_torch) and torch.equal(residual_c, stream + x)
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype, torch_forms):
    torch.manual_seed(2)
    gate_up = (torch.randn(50, 2 * 1536) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # saturated and zero gates
    out = fused.silu_mul(gate_up)
    assert out.shape == (50, 1536)
    assert_matches(out, torch_forms("silu_mul", gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "col"), [(9, 64, 0), (3, 64, 576), (2, 128, 256)])
def test_rope_reads_its_heads_from_the_fused_projection(dtype, heads, head_dim, col, torch_forms):
    torch.manual_seed(3)
    qkv = torch.randn(17, col + heads * head_dim + 64).to(dtype)  # other heads around the slice
    angles = torch.rand(17, head_dim // 2) * 10
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    out = fused.rope(qkv, col, heads, head_dim, cos, sin)
    expected = torch_forms("rope", qkv, col, heads, head_dim, cos, sin)
    assert out.shape == (17, heads, head_dim)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)  # products and the sum each round once, in both
    else:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 16)])
def test_rope_write_kv_equals_rope_then_write_kv(dtype, heads, kv_heads, head_dim, head_major, torch_forms):
    """The fused rotary pass with its K/V write leaves the caches and returns the queries exactly as the
    separate passes do, skips padding slots (negative) and touches no other slot; in the engine's head-major
    cache layout and in the token-major one."""
    from pagedllm.attention import write_kv

    torch.manual_seed(4)
    tokens, blocks, block_size = 21, 6, 4
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8).to(dtype)[:, :width]  # a row stride wider than the heads
    angles = torch.rand(tokens, head_dim // 2) * 10
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[[2, 9]] = -1
    shape = (blocks, block_size, kv_heads, head_dim)
    k_fused, v_fused = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    if head_major:
        k_fused, v_fused = stored_layout(k_fused), stored_layout(v_fused)
    k_apart, v_apart = k_fused.clone(), v_fused.clone()

    q = fused.rope_write_kv(qkv, heads, kv_heads, head_dim, cos, sin, k_fused, v_fused, slots)
    q_apart = torch_forms("rope", qkv, 0, heads, head_dim, cos, sin)
    k_rot = torch_forms("rope", qkv, heads * head_dim, kv_heads, head_dim, cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    write_kv(k_rot, v, k_apart, v_apart, slots)

    assert q is not None and q.shape == (tokens, heads, head_dim)
    assert k_fused.stride(1) == (head_dim if head_major else kv_heads * head_dim)
    if dtype == torch.bfloat16:  # products and the sum each round once, in both
        assert torch.equal(q, q_apart) and torch.equal(k_fused, k_apart)
    else:
        torch.testing.assert_close(q, q_apart, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_fused, k_apart, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_fused, v_apart)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((k_fused.reshape(-1, kv_heads, head_dim)[untouched] == 7.0).all())


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128)])
def test_rope_write_kv_into_int8_equals_rope_then_quantize(dtype, heads, kv_heads, head_dim, head_major):
    """Into an int8 cache the fused pass writes, bit for bit, the rows the separate passes write (the C rotary
    kernel, then `kv_quant.quantize`): ties rounded to even, an all-zero row, a row below the smallest normal
    scale, padding slots skipped."""
    from pagedllm.attention import kv_quant, write_kv

    torch.manual_seed(5)
    tokens, blocks, block_size = 13, 5, 4
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(tokens, width) * torch.logspace(-2, 2, tokens)[:, None]).to(dtype)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    v[0, 0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -126.5] * (head_dim // 8))  # scale 1: ties
    v[1, 0] = 0.0
    v[2, 0] = 1e-39 if dtype == torch.float32 else 0.0  # a subnormal absmax: the scale's divisor is clamped
    angles = torch.rand(tokens, head_dim // 2) * 10
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[5] = -1
    shape = (blocks, block_size, kv_heads, head_dim + kv_quant.SCALE_BYTES)
    k_fused, v_fused = torch.full(shape, 7, dtype=torch.int8), torch.full(shape, 7, dtype=torch.int8)
    if head_major:
        k_fused, v_fused = stored_layout(k_fused), stored_layout(v_fused)
    k_apart, v_apart = k_fused.clone(), v_fused.clone()

    q = fused.rope_write_kv(qkv, heads, kv_heads, head_dim, cos, sin, k_fused, v_fused, slots)
    k_rot = fused.rope(qkv, heads * head_dim, kv_heads, head_dim, cos, sin)
    write_kv(k_rot, v, k_apart, v_apart, slots)

    assert q is not None
    assert torch.equal(q, fused.rope(qkv, 0, heads, head_dim, cos, sin))
    assert torch.equal(k_fused, k_apart) and torch.equal(v_fused, v_apart)
    row = v_fused.reshape(-1, kv_heads, head_dim + 4)[slots[0], 0]
    assert row[:8].tolist() == [127, 0, 2, 2, 0, -2, 4, -126]  # half to even, as torch.round
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((k_fused.reshape(-1, kv_heads, head_dim + 4)[untouched] == 7).all())


def test_rope_write_kv_leaves_partial_rotary_to_the_separate_passes():
    qkv = torch.randn(3, 4 * 64, dtype=torch.bfloat16)
    cos = sin = torch.ones(3, 32, dtype=torch.bfloat16)  # rotary_dim 32 < head_dim 64 (Phi3)
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    assert fused.rope_write_kv(qkv, 2, 1, 64, cos, sin, cache, cache.clone(), torch.arange(3)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_bias_rounds_as_torch_adds(dtype):
    """The decoder layers' C loop (models/lean.py) adds a projection's bias with it: bit for bit torch's `y + b`."""
    torch.manual_seed(2)
    y, bias = torch.randn(5, 200).to(dtype) * 7, torch.randn(200).to(dtype)
    expected = y + bias
    getattr(fused.library(), f"add_bias_{fused._SUFFIX[dtype]}")(y.data_ptr(), bias.data_ptr(), 5, 200)
    assert torch.equal(y, expected)
