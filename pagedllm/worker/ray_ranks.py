"""Tensor-parallel ranks 1 .. N-1 as Ray actors (`--distributed-executor-backend ray`).

Rank 0 is the engine's own process (a Ray replica's engine core, or the process of an offline `LLM`), which
joins the cluster as a driver; ranks 1 .. N-1 are `RankActor`s, one bundle each of a placement group spread over
the cluster's nodes as it allows. torch.distributed still carries the tensors: the actors meet rank 0 at its
node's address. The actors belong to rank 0's job, so they go when rank 0 goes; one that dies breaks the group's
collectives, and the engine fails (a replica is then replaced by Serve).
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedllm.worker import follower
from pagedllm.worker.launcher import FollowerSpec

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


class RankActor:
    """One tensor-parallel rank: `follower.main` in a Ray actor's process."""

    def run(self, spec: str) -> int:
        return follower.main([spec])


def node_address() -> str:
    """This node's address as the cluster knows it: where the other ranks meet rank 0."""
    connect()
    return ray.util.get_node_ip_address()


def connect() -> None:
    """Join the cluster at RAY_ADDRESS (a replica's engine core is told its cluster there), or the one `ray start`
    runs on this machine, or a local one."""
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING, log_to_driver=False)


class RayFollowers:
    """Ranks 1 .. N-1 of one engine, started as Ray actors in a placement group of their own."""

    def __init__(self, specs: list[FollowerSpec]) -> None:
        connect()
        self.group: PlacementGroup = placement_group([{"CPU": spec.threads} for spec in specs], strategy="SPREAD")
        if not self.group.wait(_PLACEMENT_TIMEOUT_S):
            remove_placement_group(self.group)
            raise RuntimeError(
                f"the Ray cluster has no room for {len(specs)} more tensor-parallel ranks of "
                f"{specs[0].threads} CPUs each (waited {_PLACEMENT_TIMEOUT_S:.0f} s)"
            )
        self.actors = [
            ray.remote(RankActor)
            .options(
                num_cpus=spec.threads,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
            )
            .remote()
            for index, spec in enumerate(specs)
        ]
        self.runs = [actor.run.remote(spec.to_json()) for actor, spec in zip(self.actors, specs, strict=True)]

    def dead(self) -> list[int]:
        """Exit codes of ranks that have stopped (1 for one that raised or whose actor died, and for every one once
        this process has left the cluster, which ended its actors)."""
        if not ray.is_initialized():
            return [1] * len(self.runs)
        finished, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [self._code(run) for run in finished]

    def _code(self, run: ray.ObjectRef) -> int:
        try:
            return ray.get(run)
        except ray.exceptions.RayError:
            return 1

    def stop(self, grace_s: float) -> None:
        """Wait `grace_s` for the ranks to leave after the stop message, then kill the actors and free the group."""
        if not ray.is_initialized():
            return  # the actors and the group went with this process's job
        ray.wait(self.runs, num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)
