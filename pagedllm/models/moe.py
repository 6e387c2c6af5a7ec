"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral layers.

A router picks `top_k` of `num_experts` gated-SiLU experts per token; the (token, expert) pairs are
sorted by expert and each expert that got tokens runs its two matmuls once over all of them.

Numerics follow transformers 5's default experts path (`grouped_mm`, what `from_pretrained`
models run) step by step:

- router logits `linear(x, gate.weight)` in x's dtype; softmax in float32; `topk`;
  renormalise the top-k weights when `norm_topk_prob` (Mixtral always does);
- Qwen3-MoE casts the weights back to x's dtype, Mixtral keeps them in float32
  (`float32_routing=True`), so in bf16 Mixtral's weighted expert outputs are float32;
- `silu(gate) * up` with `gate_up = [gate | up]` (gate first), then `down`;
- each pair's output times its weight, then the top-k outputs of a token summed over the
  top-k axis (`[T, k, H].sum(1)`: one rounding in bf16) and cast to x's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import parallel
from pagedllm.models import fused
from pagedllm.models.prepack import can_prepack, packed_linear, prepacked


class _Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class _Experts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """`x [T, hidden] -> [T, hidden]`. State dict: `gate.weight [E, H]`, `experts.gate_up_proj
    [E, 2I, H]`, `experts.down_proj [E, H, I]` (transformers 5's names; see `moe_weights`).

    Qwen3-MoE: `SparseMoeBlock(H, moe_intermediate_size, num_experts, num_experts_per_tok,
    norm_topk_prob)`; Mixtral: `SparseMoeBlock(H, intermediate_size, num_local_experts,
    num_experts_per_tok, True, float32_routing=True)`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        float32_routing: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.float32_routing = float32_routing
        # Under tensor parallelism each rank holds a slice of every expert's channels: its output is a
        # partial sum that the ranks add up.
        self.reduce = False
        self.gate = _Router(hidden_size, num_experts)
        self.experts = _Experts(hidden_size, intermediate_size, num_experts)
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def prepack(self) -> None:
        """Reorder each expert's CPU weights once into oneDNN's blocked layout, as the decoder's
        `Linear.prepack` does (the router stays a plain `linear`, exactly the reference's), and let the
        stacked plain copies go (to the meta device, keeping their shapes), so each weight is in memory
        once. A no-op where oneDNN cannot, and once done."""
        experts = self.experts
        if experts.gate_up_proj.is_meta or not can_prepack(experts.gate_up_proj):
            return
        self.packed = [
            (prepacked(experts.gate_up_proj[e]), prepacked(experts.down_proj[e])) for e in range(self.num_experts)
        ]
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.to("meta"), requires_grad=False)
        experts.down_proj = nn.Parameter(experts.down_proj.to("meta"), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k `(weights, expert ids)`, each `[T, top_k]`, as transformers' router computes them."""
        logits = nn.functional.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.float32_routing:
            weights = weights.to(logits.dtype)
        return weights, ids

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` over the rows of `x`: `down(silu(gate) * up)`, one matmul each."""
        if self.packed is not None:
            gate_up, down = self.packed[e]
            h = packed_linear(x, gate_up)
            return packed_linear(_silu_mul(h), down)
        h = nn.functional.linear(x, self.experts.gate_up_proj[e])
        return nn.functional.linear(_silu_mul(h), self.experts.down_proj[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, k = x.shape[0], self.top_k
        if num_tokens == 0:
            return x.new_empty(0, self.hidden_size)
        x = x.contiguous()
        weights, ids = self.route(x)
        if num_tokens == 1:  # decode of one sequence: its k experts, one row each, in top-k order
            out = torch.cat([self.expert(e, x) for e in ids[0].tolist()])
            weighted = out * weights.view(k, 1)
        else:
            # Pair p is token p // k's (p % k)-th choice; sorted by expert with the reference's own
            # `torch.sort`, so each expert's rows come in the reference's order (a GEMM's rounding
            # can depend on a row's position).
            flat_ids = ids.view(-1)
            order = torch.sort(flat_ids)[1]
            counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
            hidden = x[order // k]
            out = torch.empty_like(hidden)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    out[start : start + n] = self.expert(e, hidden[start : start + n])
                    start += n
            weighted = out.new_empty(out.shape, dtype=torch.promote_types(out.dtype, weights.dtype))
            weighted[order] = out * weights.view(-1)[order, None]
        # float32 for Mixtral in bf16 (its float32 routing weights), summed (over ranks too) before the one
        # rounding.
        summed = weighted.view(num_tokens, k, self.hidden_size).sum(dim=1)
        return (parallel.all_reduce(summed) if self.reduce else summed).to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The C kernel rounds as transformers does in bf16; in float32 its `exp` differs from torch's by an
    ulp or so, so float32 takes torch's own form and stays bit-equal to the reference."""
    if gate_up.dtype == torch.float32:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
    return fused.silu_mul(gate_up)


def moe_weights(raw: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's MoE tensors from a checkpoint as `SparseMoeBlock` state-dict entries.

    `prefix` is the MLP's, e.g. `model.layers.3.mlp.` (Qwen3-MoE, transformers-5 Mixtral) or
    `model.layers.3.block_sparse_moe.` (Mixtral on the Hub). Accepted layouts:
    - fused (transformers 5): `experts.gate_up_proj [E, 2I, H]` (gate rows first), `experts.down_proj [E, H, I]`;
    - per expert, Qwen3-MoE: `experts.{i}.gate_proj.weight`, `up_proj`, `down_proj`;
    - per expert, Mixtral: `experts.{i}.w1.weight` (gate), `w3` (up), `w2` (down);
    and `gate.weight [E, H]` (the router) in all three. A missing tensor raises KeyError naming it."""

    def get(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in raw:
            raise KeyError(f"checkpoint tensor {key!r} is missing")
        return raw[key]

    router = get("gate.weight")
    if prefix + "experts.gate_up_proj" in raw or prefix + "experts.down_proj" in raw:
        gate_up, down = get("experts.gate_up_proj"), get("experts.down_proj")
    else:
        if prefix + "experts.0.w1.weight" in raw:
            names = ("w1", "w3", "w2")
        elif prefix + "experts.0.gate_proj.weight" in raw:
            names = ("gate_proj", "up_proj", "down_proj")
        else:
            raise KeyError(
                f"checkpoint tensor {prefix + 'experts.gate_up_proj'!r} is missing "
                f"(nor per-expert {prefix + 'experts.0.gate_proj.weight'!r} or {prefix + 'experts.0.w1.weight'!r})"
            )
        per_expert = [[get(f"experts.{i}.{name}.weight") for i in range(num_experts)] for name in names]
        gate, up, down_list = per_expert
        gate_up = torch.cat((torch.stack(gate), torch.stack(up)), dim=1)
        down = torch.stack(down_list)
    for name, tensor in (("gate.weight", router), ("experts.gate_up_proj", gate_up), ("experts.down_proj", down)):
        if tensor.shape[0] != num_experts:
            raise ValueError(f"{prefix}{name} has {tensor.shape[0]} experts, expected {num_experts}")
    return {"gate.weight": router, "experts.gate_up_proj": gate_up, "experts.down_proj": down}
