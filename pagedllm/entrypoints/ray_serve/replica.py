"""`EngineReplica`: one Ray Serve replica holding one engine and pagedllm's whole server app over it.

Its engine core is a process of its own, as under `pagedllm serve` (spawned, since a Ray actor runs threads
already). Requests arrive from the front as `ForwardedRequest`s and run through the app in-process. For the
router it reports (`record_routing_stats`) its queue and the leading blocks its prefix cache holds, kept from
its engine's KV events; for Serve's health check it fails when the engine died or stopped answering, so that
Serve replaces it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from pagedllm.config import ServeOptions
from pagedllm.entrypoints.openai.api_server import build_server
from pagedllm.entrypoints.ray_serve.forward import ForwardedRequest, ResponseEnd, ResponseStart, run_asgi
from pagedllm.entrypoints.ray_serve.router import PrefixIndex

logger = logging.getLogger(__name__)

_RESPONSIVE_S = 10.0  # an engine core that does not answer a stats request this long has stalled
STREAM_BATCH_S = 0.05  # a stream's chunks after its first travel together at most this often


class EngineReplica:
    async def __init__(self, engine_options: dict[str, Any], options: ServeOptions) -> None:
        # The core's tensor-parallel ranks 1.. (Ray actors) join this replica's cluster.
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        self.server = build_server(engine_options, options, start_method="spawn")
        self.engine = self.server.engine
        self.name = serve.get_replica_context().replica_id.unique_id
        self._fatal = False
        self.engine.on_fatal = self._on_fatal
        self._lifespan = self.server.app.router.lifespan_context(self.server.app)
        await self._lifespan.__aenter__()  # starts the threads that talk to the core, on this replica's loop
        self._index = PrefixIndex()
        self._events = self.engine.kv_monitor.open_stream()

    def _on_fatal(self) -> None:
        self._fatal = True

    async def handle(
        self, request: ForwardedRequest, prefix: list[int] | None = None, **routing: Any
    ) -> AsyncIterator[ResponseStart | bytes | ResponseEnd]:
        """Answer one HTTP request through the app, then say whether the engine still runs. `prefix` and `routing`
        (`replica`, `avoid`) are the router's."""
        async for item in run_asgi(self.server.app, request, self.name, STREAM_BATCH_S):
            yield item
        yield ResponseEnd(engine_alive=not self._fatal and self.engine.is_running)

    def describe(self) -> dict[str, Any]:
        """What the front needs to hash prompts as this engine does, and to list the models."""
        return {
            "tokenizer": self.engine.tokenizer,
            "served_model_names": self.server.options.served_model_names,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        while True:
            events, _ = self._events.take()
            if not events:
                break
            for event in events:
                self._index.apply(event)
        return {"prefix": self._index.hashes(), "queue": self.engine.num_unfinished}

    async def check_health(self) -> None:
        """Raise (and Serve replaces this replica) when the engine died, or its core stopped answering."""
        if self._fatal or not self.engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine core is not running")
        if not await self.engine.responsive(_RESPONSIVE_S):
            raise RuntimeError(f"replica {self.name}: the engine core has not answered for {_RESPONSIVE_S:.0f} s")

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)
