"""The tensor-parallel group on torch.distributed: who this process is, and the three collectives the
model needs (sum of partial products, gather of vocabulary shards, the step's inputs from rank 0), with a
count of the first two, and a gather of an object from every rank (`Worker.shard_reports`).

gloo joins CPU processes (one machine or several over TCP), NCCL GPUs. A process that never joins a
group is rank 0 of a group of one, and every collective is then the identity: the single-process
engine pays nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet: rank 0's address and port (torch.distributed's TCP store)."""

    master_addr: str
    master_port: int
    timeout_s: float

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place in the group."""

    rank: int = 0
    world_size: int = 1

    def range(self, total: int) -> tuple[int, int]:
        """This rank's contiguous slice of `total` items split evenly (the caller checks divisibility)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size


@dataclass(slots=True)
class CollectiveCounts:
    """How many of the model's collectives this rank has run since it joined: they show that the work
    was really split (a model left whole on every rank runs none), and the ranks of a group that stays in
    step have run the same numbers."""

    all_reduce: int = 0
    all_gather: int = 0


_shard = Shard()
_counts = CollectiveCounts()


def counts() -> CollectiveCounts:
    """A copy of this rank's counts."""
    return dataclasses.replace(_counts)


def current() -> Shard:
    return _shard


def join(rank: int, world_size: int, rendezvous: Rendezvous, device: str) -> Shard:
    """Join the group (gloo on CPU, NCCL on CUDA); returns this rank's shard. Fails within the timeout,
    naming the address, when the other ranks never come."""
    global _shard, _counts
    if dist.is_initialized():
        raise RuntimeError("this process already holds a tensor-parallel engine: one per process")
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=rendezvous.init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=rendezvous.timeout_s),
        )
    except (RuntimeError, dist.DistStoreError) as error:
        # torch counts the default group's attempts, failed ones too, and names its rendezvous keys by
        # that count; destroying a group resets it. A failed join would otherwise leave this process
        # looking for keys the next group's fresh ranks never write.
        dist.distributed_c10d._world.group_count = 0
        raise RuntimeError(
            f"rank {rank} of {world_size} could not join the tensor-parallel group at {rendezvous.init_method} "
            f"within {rendezvous.timeout_s:.0f} s: {error}"
        ) from error
    _shard = Shard(rank, world_size)
    _counts = CollectiveCounts()
    return _shard


def leave(synchronize: bool = False) -> None:
    """Leave the group. `synchronize`, the ordinary end of a healthy group: every rank first meets the
    others at a barrier, so that none tears its connections down while another may still be reading the
    stop message from them (without it, a follower on another node was seen to abort at the group's end).
    The ranks of a broken group cannot meet, and leave at once."""
    global _shard, _counts
    if dist.is_initialized():
        if synchronize and _shard.world_size > 1:
            dist.barrier()
        dist.destroy_process_group()
    _shard = Shard()
    _counts = CollectiveCounts()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's partial `x`, in place."""
    if _shard.world_size > 1:
        dist.all_reduce(x)
        _counts.all_reduce += 1
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, in rank order."""
    if _shard.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_shard.world_size)]
    dist.all_gather(parts, x.contiguous())
    _counts.all_gather += 1
    return torch.cat(parts, dim=-1)


def broadcast_from_first(value: object) -> object:
    """Rank 0's `value` on every rank (others pass None): once per step, the step's inputs."""
    if _shard.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: T) -> list[T]:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if _shard.world_size == 1:
        return [value]
    box: list[T | None] = [None] * _shard.world_size
    dist.all_gather_object(box, value)
    return cast(list[T], box)
