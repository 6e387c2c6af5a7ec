"""The sparse MoE block against transformers' own Qwen3-MoE and Mixtral blocks, on both checkpoint layouts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

from pagedllm.models.moe import SparseMoeBlock, moe_weights
from pagedllm.models.prepack import can_prepack

HIDDEN, INTERMEDIATE, EXPERTS = 64, 32, 8
# Qwen3-MoE: top-k and norm_topk_prob both ways; Mixtral always renormalises.
CASES = [("qwen3_moe", 2, True), ("qwen3_moe", 2, False), ("qwen3_moe", 1, True), ("qwen3_moe", 1, False)]
CASES += [("qwen3_moe", 3, False), ("mixtral", 2, True), ("mixtral", 1, True), ("mixtral", 3, True)]
TOKENS = [1, 7, 64]

hf_logging.set_verbosity_error()


def hf_model(family: str, top_k: int, norm_topk_prob: bool, seed: int = 0) -> torch.nn.Module:
    """A one-layer transformers model with random MoE weights (float32)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=32,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=top_k,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            head_dim=32,
            intermediate_size=2 * INTERMEDIATE,
            moe_intermediate_size=INTERMEDIATE,
            num_experts=EXPERTS,
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=[],
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        assert norm_topk_prob
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS))
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate.weight.normal_(0.0, 0.3)
        mlp.experts.gate_up_proj.normal_(0.0, 0.15)
        mlp.experts.down_proj.normal_(0.0, 0.15)
    return model.eval()


def block_for(family: str, top_k: int, norm_topk_prob: bool) -> SparseMoeBlock:
    return SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, top_k, norm_topk_prob, float32_routing=family == "mixtral")


def per_expert_layout(fused: dict[str, torch.Tensor], prefix: str, family: str) -> dict[str, torch.Tensor]:
    """The Hub's per-expert tensors for one layer, split from transformers 5's fused ones (gate rows first)."""
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up, down_proj = fused["experts.gate_up_proj"], fused["experts.down_proj"]
    raw = {f"{prefix}gate.weight": fused["gate.weight"].clone()}
    for i in range(gate_up.shape[0]):
        raw[f"{prefix}experts.{i}.{gate}.weight"] = gate_up[i, :INTERMEDIATE].clone()
        raw[f"{prefix}experts.{i}.{up}.weight"] = gate_up[i, INTERMEDIATE:].clone()
        raw[f"{prefix}experts.{i}.{down}.weight"] = down_proj[i].clone()
    return raw


def reference(model: torch.nn.Module, x: torch.Tensor, implementation: str = "grouped_mm") -> torch.Tensor:
    """transformers' block; "grouped_mm" is what `from_pretrained` models run by default."""
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model.model.layers[0].mlp(x[None])[0]


def inputs(tokens: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(tokens, HIDDEN).to(dtype)


def loaded_blocks(family: str, top_k: int, norm: bool, model: torch.nn.Module) -> list[SparseMoeBlock]:
    """The block loaded through `moe_weights` from the fused layout and from the per-expert layout."""
    state = model.model.layers[0].mlp.state_dict()
    prefix = "model.layers.0.block_sparse_moe." if family == "mixtral" else "model.layers.0.mlp."
    blocks = []
    for raw in ({prefix + k: v for k, v in state.items()}, per_expert_layout(state, prefix, family)):
        block = block_for(family, top_k, norm)
        block.load_state_dict(moe_weights(raw, prefix, EXPERTS))
        blocks.append(block)
    return blocks


@pytest.mark.parametrize(("family", "top_k", "norm"), CASES)
def test_float32_equals_transformers_on_both_layouts(family: str, top_k: int, norm: bool):
    model = hf_model(family, top_k, norm)
    fused_block, per_expert_block = loaded_blocks(family, top_k, norm, model)
    for name, tensor in fused_block.state_dict().items():
        assert torch.equal(tensor, per_expert_block.state_dict()[name]), name
    for tokens in TOKENS:
        x = inputs(tokens)
        expected = reference(model, x)
        with torch.no_grad():
            ours = fused_block(x)
            assert torch.equal(ours, per_expert_block(x))
        assert ours.dtype == torch.float32 and ours.shape == (tokens, HIDDEN)
        # Same routing, the same GEMM per expert over the same rows in the same order, the same sum.
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
        # transformers' per-expert loop ("eager") adds the top-k outputs in expert order instead.
        torch.testing.assert_close(ours, reference(model, x, "eager"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("family", "top_k", "norm"), [("qwen3_moe", 2, True), ("mixtral", 2, True)])
def test_idle_experts_and_one_crowded_expert(family: str, top_k: int, norm: bool):
    """64 copies of one token: every pair goes to the same top-k experts and the rest get nothing."""
    model = hf_model(family, top_k, norm)
    block = loaded_blocks(family, top_k, norm, model)[0]
    x = inputs(1).expand(64, HIDDEN).contiguous()
    with torch.no_grad():
        _, ids = block.route(x)
        assert len(set(ids.view(-1).tolist())) == top_k
        ours = block(x)
    torch.testing.assert_close(ours, reference(model, x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours, ours[:1].expand_as(ours), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("family", "top_k", "norm"), [("qwen3_moe", 2, True), ("qwen3_moe", 2, False), ("mixtral", 2, True)]
)
def test_routing_matches_transformers_router(family: str, top_k: int, norm: bool):
    model = hf_model(family, top_k, norm)
    block = loaded_blocks(family, top_k, norm, model)[0]
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        block.to(dtype)
        x = inputs(64, dtype)
        with torch.no_grad():
            _, ref_weights, ref_ids = model.model.layers[0].mlp.gate(x)
            weights, ids = block.route(x)
        assert torch.equal(ids, ref_ids)
        # Qwen3-MoE casts the weights back to the activations' dtype; Mixtral keeps float32.
        assert weights.dtype == ref_weights.dtype == (torch.float32 if family == "mixtral" else dtype)
        assert torch.equal(weights, ref_weights)


@pytest.mark.parametrize(
    ("family", "top_k", "norm"), [("qwen3_moe", 2, True), ("qwen3_moe", 3, False), ("mixtral", 2, True)]
)
@pytest.mark.parametrize("prepack", [True, False])
def test_bf16_runs_and_is_close(family: str, top_k: int, norm: bool, prepack: bool):
    model = hf_model(family, top_k, norm).to(torch.bfloat16)
    block = loaded_blocks(family, top_k, norm, model)[0].to(torch.bfloat16)
    if prepack:
        packable = can_prepack(block.experts.gate_up_proj)
        block.prepack()
        assert (block.packed is not None) == packable
        assert block.experts.gate_up_proj.is_meta == packable, "packed experts are held once"
    for tokens in TOKENS:
        x = inputs(tokens, torch.bfloat16)
        with torch.no_grad():
            ours = block(x)
        assert ours.dtype == torch.bfloat16 and ours.shape == (tokens, HIDDEN)
        torch.testing.assert_close(ours, reference(model, x), rtol=2e-2, atol=2e-2)


def test_prepack_is_a_no_op_where_onednn_has_no_kernel():
    block = block_for("qwen3_moe", 2, True).to(torch.float64)
    block.prepack()
    assert block.packed is None


def test_prepacked_float32_experts_match_transformers():
    model = hf_model("qwen3_moe", 2, True)
    block = loaded_blocks("qwen3_moe", 2, True, model)[0]
    block.prepack()
    assert block.packed is not None
    for tokens in TOKENS:
        x = inputs(tokens, torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(block(x), reference(model, x), rtol=1e-5, atol=1e-5)


def test_zero_tokens():
    model = hf_model("qwen3_moe", 2, True)
    block = loaded_blocks("qwen3_moe", 2, True, model)[0]
    out = block(torch.empty(0, HIDDEN))
    assert out.shape == (0, HIDDEN)


def test_parameters_are_stacked_frozen_and_named_as_transformers():
    block = block_for("mixtral", 2, True)
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
    assert shapes == {
        "gate.weight": (EXPERTS, HIDDEN),
        "experts.gate_up_proj": (EXPERTS, 2 * INTERMEDIATE, HIDDEN),
        "experts.down_proj": (EXPERTS, HIDDEN, INTERMEDIATE),
    }
    assert not any(p.requires_grad for p in block.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hub_layout_written_by_transformers(family: str, tmp_path):
    """`save_pretrained` writes the Hub's per-expert names (Mixtral under `block_sparse_moe.`); read back
    raw, they give exactly the fused tensors transformers builds, so the gate/up order is transformers' own."""
    model = hf_model(family, 2, True)
    model.save_pretrained(tmp_path)
    raw = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.0.block_sparse_moe." if family == "mixtral" else "model.layers.0.mlp."
    assert f"{prefix}experts.0.{'w1' if family == 'mixtral' else 'gate_proj'}.weight" in raw
    weights = moe_weights(raw, prefix, EXPERTS)
    state = model.model.layers[0].mlp.state_dict()
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


def test_missing_tensors_raise_key_error_naming_them():
    model = hf_model("qwen3_moe", 2, True)
    state = model.model.layers[0].mlp.state_dict()
    prefix = "model.layers.5.mlp."
    per_expert = per_expert_layout(state, prefix, "qwen3_moe")
    del per_expert[f"{prefix}experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.5\.mlp\.experts\.3\.up_proj\.weight"):
        moe_weights(per_expert, prefix, EXPERTS)
    per_expert = per_expert_layout(state, prefix, "mixtral")
    del per_expert[f"{prefix}gate.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.5\.mlp\.gate\.weight"):
        moe_weights(per_expert, prefix, EXPERTS)
    fused = {prefix + k: v for k, v in state.items() if k != "experts.down_proj"}
    with pytest.raises(KeyError, match=r"model\.layers\.5\.mlp\.experts\.down_proj"):
        moe_weights(fused, prefix, EXPERTS)
    with pytest.raises(KeyError, match=r"model\.layers\.5\.mlp\.experts\.gate_up_proj"):
        moe_weights({f"{prefix}gate.weight": state["gate.weight"]}, prefix, EXPERTS)
    # Fewer experts in the checkpoint than the config names.
    with pytest.raises(KeyError, match=r"experts\.8\.gate_proj\.weight"):
        moe_weights(per_expert_layout(state, prefix, "qwen3_moe"), prefix, EXPERTS + 1)
    with pytest.raises(ValueError, match="experts"):
        moe_weights({prefix + k: v for k, v in state.items()}, prefix, EXPERTS + 1)
