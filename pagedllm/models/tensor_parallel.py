"""Megatron-style sharding of a loaded model for one rank of a tensor-parallel group.

- q/k/v and gate/up projections are column-parallel: each rank keeps the rows of its attention heads
  (and their KV heads) and of its slice of the MLP; o and down projections are row-parallel: each rank
  keeps the matching columns, and the ranks sum their partial products (`Linear.reduce`).
- When there are more ranks than KV heads, KV heads are replicated (as vLLM does): rank r keeps KV head
  `r * num_kv_heads // world_size`, the one its query heads read.
- Mixture-of-experts blocks split every expert's channels the same way; the router stays whole.
- The embedding and the LM head are vocabulary-parallel: each rank keeps `ceil(vocab / world_size)` rows
  (the last zero-padded); embeddings are summed over ranks, logits gathered.

Each rank's KV cache then holds its KV heads only: the engine's blocks and block tables are the same on
every rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.distributed.parallel import Shard
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import MLP, Attention, CausalLM, Linear
from pagedllm.models.moe import SparseMoeBlock


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Refuse, before any process starts, a group size the model cannot be split into."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the {heads} attention heads")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} neither divides the {kv_heads} KV heads nor is a multiple of them"
        )
    if config.moe is not None and config.moe.intermediate_size % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the experts' {config.moe.intermediate_size} channels"
        )
    if config.intermediate_size % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the MLP's {config.intermediate_size} channels"
        )


def local_kv_heads(config: ModelConfig, world_size: int) -> int:
    return max(1, config.num_key_value_heads // world_size)


def shard_model(net: CausalLM, shard: Shard) -> None:
    """Keep this rank's slices of every weight of `net` (loaded whole), in place."""
    check_divisible(net.config, shard.world_size)
    for layer in net.layers:
        _shard_attention(layer.self_attn, net.config, shard)
        _shard_mlp(layer.mlp, shard)
    tied = net.lm_head.weight is net.embed_tokens.weight
    rows = math.ceil(net.config.vocab_size / shard.world_size)
    net.embed_tokens.weight = _param(_vocab_rows(net.embed_tokens.weight, shard, rows))
    net.embed_tokens.vocab_start = shard.rank * rows
    net.lm_head.weight = net.embed_tokens.weight if tied else _param(_vocab_rows(net.lm_head.weight, shard, rows))
    net.num_kv_heads = local_kv_heads(net.config, shard.world_size)


def _shard_attention(attn: Attention, config: ModelConfig, shard: Shard) -> None:
    d = attn.head_dim
    first, last = shard.range(attn.num_heads)
    kv_first, kv_last = _kv_range(config.num_key_value_heads, shard)
    q_rows = torch.arange(first * d, last * d)
    k_rows = attn.q_size + torch.arange(kv_first * d, kv_last * d)
    v_rows = attn.q_size + attn.kv_size + torch.arange(kv_first * d, kv_last * d)
    _keep_rows(attn.qkv_proj, torch.cat([q_rows, k_rows, v_rows]))
    _keep_columns(attn.o_proj, q_rows, shard)
    attn.num_heads, attn.num_kv_heads = last - first, kv_last - kv_first
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d


def _kv_range(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    if num_kv_heads >= shard.world_size:
        return shard.range(num_kv_heads)
    head = shard.rank * num_kv_heads // shard.world_size
    return head, head + 1


def _shard_mlp(mlp: nn.Module, shard: Shard) -> None:
    if isinstance(mlp, SparseMoeBlock):
        _shard_experts(mlp, shard)
        return
    if not isinstance(mlp, MLP):
        raise TypeError(f"cannot shard {type(mlp).__name__} across ranks")
    size = mlp.down_proj.weight.shape[1]
    first, last = shard.range(size)
    _keep_rows(mlp.gate_up_proj, torch.cat([torch.arange(first, last), size + torch.arange(first, last)]))
    _keep_columns(mlp.down_proj, torch.arange(first, last), shard)


def _shard_experts(block: SparseMoeBlock, shard: Shard) -> None:
    """Every expert split as a dense MLP is (the router stays whole on every rank): each rank computes
    every routed token's partial output from its slice of the experts' channels."""
    size = block.intermediate_size
    first, last = shard.range(size)
    rows = torch.cat([torch.arange(first, last), size + torch.arange(first, last)])
    block.experts.gate_up_proj = _param(block.experts.gate_up_proj[:, rows])
    block.experts.down_proj = _param(block.experts.down_proj[:, :, first:last])
    block.intermediate_size = last - first
    block.reduce = shard.world_size > 1


def _keep_rows(linear: Linear, rows: torch.Tensor) -> None:
    linear.weight = _param(linear.weight[rows])
    if linear.bias is not None:
        linear.bias = _param(linear.bias[rows])


def _keep_columns(linear: Linear, columns: torch.Tensor, shard: Shard) -> None:
    linear.weight = _param(linear.weight[:, columns])
    linear.reduce = shard.world_size > 1
    # The bias is added once, by rank 0, before the sum.
    if linear.bias is not None and shard.rank > 0:
        linear.bias = None


def _vocab_rows(weight: torch.Tensor, shard: Shard, rows: int) -> torch.Tensor:
    part = weight[shard.rank * rows : (shard.rank + 1) * rows]
    if part.shape[0] == rows:
        return part.contiguous()
    padded = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    padded[: part.shape[0]] = part
    return padded


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous(), requires_grad=False)
