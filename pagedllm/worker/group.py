"""The processes of tensor parallelism: on node 0 the engine starts its node's other ranks, joins the
group as rank 0 and stops them; on nodes 1 .. `pagedllm worker` starts that node's ranks. With the ray
backend, ranks 1 .. are Ray actors wherever the cluster places them (`ray_ranks.py`). With one rank
there is no group and nothing to stop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from pagedllm.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagedllm.distributed import parallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import resolve_model_folder
from pagedllm.models.tensor_parallel import check_divisible
from pagedllm.worker.cache_engine import KVShape
from pagedllm.worker.launcher import Followers, FollowerSpec, check_port_free, free_port, threads_per_rank

if TYPE_CHECKING:
    from pagedllm.worker.ray_ranks import RayFollowers

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolSize:
    """Blocks of the KV pool and of the CPU swap space: the same on every rank (each holds its KV heads
    of every block) and as many as one process would have."""

    num_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int  # of a whole block, every rank's KV heads together (scales included)


def step_budget(config: EngineConfig, model_config: ModelConfig) -> int:
    """Most tokens a step runs. An encoder computes each prompt whole in one step (its attention is bidirectional:
    no chunked prefill), so, as vLLM does for a model without chunked prefill, its budget is at least its longest
    prompt by default, and a smaller one asked for is refused."""
    asked = config.max_num_batched_tokens
    if model_config.encoder is None:
        return asked or DEFAULT_MAX_NUM_BATCHED_TOKENS
    longest = config.max_model_len or model_config.max_position_embeddings
    if asked is not None and asked < longest:
        raise ValueError(
            f"max_num_batched_tokens {asked} is smaller than max_model_len {longest}: {model_config.architecture} is "
            "an encoder, which computes each prompt whole in one step (no chunked prefill); raise "
            "max_num_batched_tokens or lower max_model_len"
        )
    return asked or max(longest, DEFAULT_MAX_NUM_BATCHED_TOKENS)


def pool_size(config: EngineConfig, model_config: ModelConfig, draft_config: ModelConfig | None = None) -> PoolSize:
    """From the options and the model's shape alone, so that every node computes the same pool. A draft model's
    pool has the same blocks (indexed alike), so a block's bytes are both models' and the memory is shared.
    An encoder caches nothing: its blocks hold no memory, and are only the scheduler's count of a step's tokens
    (allocated when a prompt is scheduled, freed when it is pooled, in the same step); by default enough for any
    step, each sequence with a block of headroom."""
    if model_config.encoder is not None:
        per_step = -(-step_budget(config, model_config) // config.block_size) + 2 * config.max_num_seqs + 1
        return PoolSize(config.num_kv_blocks or per_step, 0, 0)
    bytes_per_block = sum(
        KVShape.of(
            shape.num_hidden_layers,
            shape.num_key_value_heads,
            shape.head_dim,
            config.block_size,
            config.torch_dtype,
            config.kv_cache_dtype,
        ).bytes_per_block
        for shape in ([model_config] if draft_config is None else [model_config, draft_config])
    )
    num_blocks = config.num_kv_blocks or (config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory is too small for one block of {bytes_per_block} bytes")
    swap_bytes = int(config.swap_space * (1 << 30)) if config.preemption_mode == "swap" else 0
    return PoolSize(num_blocks, swap_bytes // bytes_per_block, bytes_per_block)


def follower_specs(config: EngineConfig, folder: Path, pool: PoolSize, port: int) -> list[FollowerSpec]:
    """The specs of this node's ranks, in order (node 0's first one is the engine itself)."""
    world = config.tensor_parallel_size
    per_node = world // config.nnodes
    threads = threads_per_rank(per_node, config.threads_per_worker)
    first = config.node_rank * per_node
    return [
        FollowerSpec(
            model=str(folder),
            dtype=str(config.torch_dtype).removeprefix("torch."),
            kv_cache_dtype=config.kv_cache_dtype,
            device=config.device,
            block_size=config.block_size,
            num_blocks=pool.num_blocks,
            num_cpu_blocks=pool.num_cpu_blocks,
            rank=rank,
            world_size=world,
            master_addr=config.master_addr,
            master_port=port,
            timeout_s=config.distributed_timeout,
            threads=threads,
        )
        for rank in range(first, first + per_node)
    ]


def run_node(config: EngineConfig) -> int:
    """`pagedllm worker` on nodes 1 ..: start this node's ranks and wait for them (the engine on node 0
    stops them when it stops). Returns the first non-zero exit code, or 0."""
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine itself (`pagedllm serve`/`generate`); workers run on nodes 1 ..")
    folder = resolve_model_folder(config.model)
    model_config = ModelConfig.from_folder(folder)
    check_divisible(model_config, config.tensor_parallel_size)
    assert config.master_port is not None  # EngineConfig requires it with nnodes > 1
    followers = Followers(follower_specs(config, folder, pool_size(config, model_config), config.master_port))
    codes = [process.wait() for process in followers.processes]
    return next((code for code in codes if code), 0)


_STOP_GRACE_S = 10.0


class Leader(Protocol):
    """What stopping needs of rank 0's worker: the message that ends the others' loops."""

    def stop_followers(self) -> None: ...


@dataclass
class TensorParallelGroup:
    shard: parallel.Shard | None = None
    followers: Followers | RayFollowers | None = None
    stopped: bool = field(default=False)
    broken: bool = field(default=False)  # a step failed: the ranks may be mid-collective, no stop message

    @classmethod
    def start(
        cls, config: EngineConfig, model_config: ModelConfig, folder: Path, pool: PoolSize
    ) -> TensorParallelGroup:
        """Node 0's side: its other ranks start here, then this process joins as rank 0."""
        world = config.tensor_parallel_size
        if world == 1:
            return cls()
        if config.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run `pagedllm worker --node-rank K`")
        check_divisible(model_config, world)  # before any process starts
        on_ray = config.distributed_executor_backend == "ray"
        if on_ray:  # the actors may run on other nodes: they meet rank 0 at its node's address
            from pagedllm.worker.ray_ranks import RayFollowers, node_address

            config = replace(config, master_addr=node_address())
        port = config.master_port if config.master_port is not None else free_port(config.master_addr)
        if config.nnodes == 1:  # on several nodes the port is the one every node was given
            check_port_free(config.master_addr, port)
        specs = follower_specs(config, folder, pool, port)
        followers = RayFollowers(specs[1:]) if on_ray else Followers(specs[1:])
        torch.set_num_threads(specs[0].threads)
        rendezvous = parallel.Rendezvous(config.master_addr, port, config.distributed_timeout)
        try:
            shard = parallel.join(0, world, rendezvous, config.device)
        except RuntimeError:
            followers.stop(0.0)
            raise
        logger.info("tensor parallelism: %d ranks at %s on %d nodes", world, rendezvous.init_method, config.nnodes)
        return cls(shard, followers)

    def stop(self, leader: Leader) -> None:
        """Tell the other ranks to leave, wait for them, kill what does not leave; idempotent."""
        if self.followers is None or self.stopped:
            return
        self.stopped = True
        try:
            if not self.followers.dead() and not self.broken:
                leader.stop_followers()
                parallel.leave(synchronize=True)
        except RuntimeError:
            logger.warning("the other ranks did not take the stop message; stopping their processes")
        self.followers.stop(_STOP_GRACE_S)
        parallel.leave()
