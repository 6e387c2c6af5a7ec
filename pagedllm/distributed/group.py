"""The engine's side of tensor parallelism: start ranks 1 .. N-1, join the group as rank 0, and stop
them. With one rank there is no group and nothing to stop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed import parallel
from pagedllm.distributed.launcher import Followers, FollowerSpec, check_port_free, free_port, threads_per_rank
from pagedllm.models.config import ModelConfig
from pagedllm.models.tensor_parallel import check_divisible

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


class Leader(Protocol):
    """What stopping needs of rank 0's worker: the message that ends the others' loops."""

    def stop_followers(self) -> None: ...


@dataclass
class TensorParallelGroup:
    shard: parallel.Shard | None = None
    followers: Followers | None = None
    stopped: bool = field(default=False)

    @classmethod
    def start(
        cls, config: EngineConfig, model_config: ModelConfig, folder: Path, num_blocks: int, num_cpu_blocks: int
    ) -> TensorParallelGroup:
        world = config.tensor_parallel_size
        if world == 1:
            return cls()
        check_divisible(model_config, world)  # before any process starts
        port = config.master_port
        if port is None:
            port = free_port(config.master_addr)
        else:
            check_port_free(config.master_addr, port)
        threads = threads_per_rank(world, config.threads_per_worker)
        common = dict(
            model=str(folder),
            dtype=str(config.torch_dtype).removeprefix("torch."),
            device=config.device,
            block_size=config.block_size,
            num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            world_size=world,
            master_addr=config.master_addr,
            master_port=port,
            timeout_s=config.distributed_timeout,
            threads=threads,
        )
        followers = Followers([FollowerSpec(rank=rank, **common) for rank in range(1, world)])
        torch.set_num_threads(threads)
        rendezvous = parallel.Rendezvous(config.master_addr, port, config.distributed_timeout)
        try:
            shard = parallel.join(0, world, rendezvous, config.device)
        except RuntimeError:
            followers.stop(0.0)
            raise
        logger.info("tensor parallelism: %d ranks at %s, %d threads each", world, rendezvous.init_method, threads)
        return cls(shard, followers)

    def stop(self, leader: Leader) -> None:
        """Tell the other ranks to leave, wait for them, kill what does not leave; idempotent."""
        if self.followers is None or self.stopped:
            return
        self.stopped = True
        try:
            if not self.followers.dead():
                leader.stop_followers()
        except RuntimeError:
            logger.warning("the other ranks did not take the stop message; stopping their processes")
        self.followers.stop(_STOP_GRACE_S)
        parallel.leave()
