"""Prefix-aware routing of requests among engine replicas, on Ray Serve's public `RequestRouter` API.

The front hashes a prompt's first `PREFIX_BLOCKS` full blocks with the prefix cache's own chain
(`kv/prefix_hash`, salted as the engine salts them) and passes the hashes with the request. Each replica reports,
in its routing stats, the hashes of the blocks its prefix cache holds among the first `PREFIX_BLOCKS` of their
chain (from its engine's KV events, `PrefixIndex`) and its queue. The router sends a request to the replica
whose cache holds the longest run of its leading hashes, or that it sent the same prefix to in the last
`memory_s` seconds (the reports lag by a stats period); when the loads are uneven (more than
`imbalanced_threshold` requests apart), or nothing matches, it falls back to the power of two choices.

A call may also name one replica (`replica=`, the per-replica paths and the aggregated /metrics) or ask to
avoid some (`avoid=`, a retry after a failure); replicas the front saw fail are avoided until Serve replaces
them (`state.FAILED`).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.entrypoints.ray_serve import state
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedllm.kv.prefix_hash import ROOT_HASH, hash_blocks

PREFIX_BLOCKS = 4  # leading blocks a prompt is routed by: its system prompt, typically
_MEMORY_ENTRIES = 65536


def short_hash(block_hash: bytes) -> int:
    """The 8 bytes of a block hash that routing compares: a probable match is all routing needs, and a replica's
    report stays small."""
    return int.from_bytes(block_hash[:8], "little")


def prompt_prefix(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """The short hashes of the prompt's first full blocks, as the replica's prefix cache would chain them."""
    full = min(len(token_ids) // block_size, PREFIX_BLOCKS)
    return [short_hash(h) for h in hash_blocks(token_ids, block_size, salt, 0, full, ROOT_HASH)]


class PrefixIndex:
    """A replica's side: which blocks among the first `PREFIX_BLOCKS` of their chain its prefix cache holds,
    kept from the engine's KV events."""

    def __init__(self) -> None:
        self._depth: dict[bytes, int] = {}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._depth.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            self._depth.clear()

    def _stored(self, event: BlockStored) -> None:
        parent = event.parent_block_hash
        depth = -1 if parent is None else self._depth.get(parent)
        if depth is None:
            return  # the chain began deeper than the routed prefix (or before this index)
        for offset, block_hash in enumerate(event.block_hashes, start=depth + 1):
            if offset >= PREFIX_BLOCKS:
                return
            self._depth[block_hash] = offset

    def hashes(self) -> list[int]:
        return [short_hash(block_hash) for block_hash in self._depth]


def _avoided(replica: str, avoid: set[str]) -> bool:
    return replica in avoid or replica in state.FAILED


@dataclass(slots=True)
class _Sent:
    replica: str
    at: float


@dataclass(slots=True)
class RoutingCounts:
    """How the router decided, for /metrics."""

    decisions: dict[str, int] = field(default_factory=lambda: {"prefix": 0, "load": 0, "replica": 0})
    per_replica: dict[str, int] = field(default_factory=dict)

    def record(self, how: str, replica: str) -> None:
        self.decisions[how] += 1
        if how != "replica":  # the front's own calls (metrics, health, per-replica paths) are not traffic
            self.per_replica[replica] = self.per_replica.get(replica, 0) + 1


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = 8, memory_s: float = 10.0) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.memory_s = memory_s
        self.counts = RoutingCounts()
        self._sent: OrderedDict[int, _Sent] = OrderedDict()
        self._decisions: OrderedDict[str, str] = OrderedDict()  # by request: how its replica was chosen
        self._reports: dict[str, tuple[list[int], frozenset[int]]] = {}
        state.ROUTERS[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        """The running replicas' ids, sorted (the per-replica paths number them in this order)."""
        return sorted(replica_id.unique_id for replica_id in list(self.curr_replicas))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {replica.replica_id.unique_id for replica in replicas}
        state.FAILED.keep_only(live)
        self._reports = {name: report for name, report in self._reports.items() if name in live}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        state.FAILED.add(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        # Serve retries a choice whose replicas all refused at once unless told to back off; no choice here gets
        # better by retrying sooner.
        pending_request.routing_context.should_backoff = True
        kwargs = pending_request.kwargs
        pinned = kwargs.get("replica")
        if pinned is not None:
            return self._decided(
                pending_request, "replica", [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
            )
        avoid = set(kwargs.get("avoid", ()))
        healthy = [r for r in candidate_replicas if not _avoided(r.replica_id.unique_id, avoid)]
        candidates = healthy or candidate_replicas  # with none left, a failed one answers fast rather than none
        chosen = self._by_prefix(candidates, kwargs.get("prefix") or [])
        if chosen:
            return self._decided(pending_request, "prefix", [chosen, [r for r in candidates if r not in chosen]])
        return self._decided(pending_request, "load", [random.sample(candidates, min(2, len(candidates)))])

    def _decided(
        self, pending_request: PendingRequest, how: str, ranks: list[list[RunningReplica]]
    ) -> list[list[RunningReplica]]:
        self._decisions[pending_request.metadata.internal_request_id] = how
        while len(self._decisions) > _MEMORY_ENTRIES:
            self._decisions.popitem(last=False)
        return ranks

    def _by_prefix(self, candidates: list[RunningReplica], prefix: list[int]) -> list[RunningReplica]:
        """The replicas holding the longest run of the prompt's leading blocks, unless loads are uneven."""
        if not prefix or len(candidates) < 2 or self._imbalanced(candidates):
            return []
        matched = {r.replica_id.unique_id: self._matched(r, prefix) for r in candidates}
        best = max(matched.values())
        return [r for r in candidates if best and matched[r.replica_id.unique_id] == best]

    def _matched(self, replica: RunningReplica, prefix: list[int]) -> int:
        now, name = time.monotonic(), replica.replica_id.unique_id
        cached = self._reported(name, replica.routing_stats.get("prefix", []))
        run = 0
        for block in prefix:
            sent = self._sent.get(block)
            recent = sent is not None and sent.replica == name and now - sent.at < self.memory_s
            if block not in cached and not recent:
                break
            run += 1
        return run

    def _reported(self, replica: str, hashes: list[int]) -> frozenset[int]:
        """A replica's reported hashes as a set, built once per report rather than once per request."""
        known = self._reports.get(replica)
        if known is None or known[0] is not hashes:
            known = self._reports[replica] = (hashes, frozenset(hashes))
        return known[1]

    def _imbalanced(self, candidates: list[RunningReplica]) -> bool:
        loads = [self._load(r) for r in candidates]
        return max(loads) - min(loads) > self.imbalanced_threshold

    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return queued if queued is not None else int(replica.routing_stats.get("queue", 0))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        name = replica_id.unique_id
        self.counts.record(self._decisions.pop(pending_request.metadata.internal_request_id, "load"), name)
        now = time.monotonic()
        for block in pending_request.kwargs.get("prefix") or []:
            self._sent[block] = _Sent(name, now)
            self._sent.move_to_end(block)
        while len(self._sent) > _MEMORY_ENTRIES:
            self._sent.popitem(last=False)
