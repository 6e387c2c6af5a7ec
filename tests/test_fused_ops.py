"""The fused C element-wise ops against their torch forms (which round where transformers does)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.models import fused


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
