"""pagedllm on Ray Serve: `--data-parallel-size` engine replicas behind one OpenAI-compatible endpoint.

`pagedllm serve --distributed-executor-backend ray` deploys `engines(...)`, the `EngineReplica` deployment (one
engine and pagedllm's whole server app per replica) routed by `PrefixAwareRouter`, and serves HTTP from its own
process through `FrontApp` (every request hashed for the router); with `--min-replicas`/`--max-replicas`,
Serve's autoscaler keeps `--target-ongoing-requests` in flight per replica. `build_application` is the same
application for Serve's own config files (a KubeRay `RayService`: `import_path:
pagedllm.entrypoints.ray_serve:build_application`), the front a Serve ingress there, behind Serve's proxy.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

import ray
import uvicorn
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from pagedllm.config import EngineConfig, ServeOptions
from pagedllm.entrypoints.openai.api_server import UvicornServer
from pagedllm.entrypoints.ray_serve.front import ENGINE_DEPLOYMENT, Front, FrontApp
from pagedllm.entrypoints.ray_serve.replica import EngineReplica
from pagedllm.entrypoints.ray_serve.router import PrefixAwareRouter

APP_NAME = "pagedllm"
_STATS_PERIOD_S = 0.5  # how often replicas report their cached prefixes and queue to the router
_HEALTH_PERIOD_S = 2.0
_HEALTH_TIMEOUT_S = 20.0
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))
_SERVE_FIELDS = frozenset(f.name for f in fields(ServeOptions))


def build_application(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are pagedllm's option names (engine and server together). The front
    is a Serve ingress here, behind Serve's proxy."""
    unknown = sorted(set(args) - _ENGINE_FIELDS - _SERVE_FIELDS)
    if unknown:
        raise ValueError(f"unknown pagedllm options: {', '.join(unknown)}")
    # A config file's lists are the options' tuples.
    values = {name: tuple(value) if isinstance(value, list) else value for name, value in args.items()}
    engine_options = {name: value for name, value in values.items() if name in _ENGINE_FIELDS}
    options = ServeOptions(**{name: value for name, value in values.items() if name in _SERVE_FIELDS})
    front = serve.deployment(
        Front, name="PagedLLMFront", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1 << 16
    )
    return front.bind(engines(engine_options, options), EngineConfig(**engine_options).block_size)


def engines(engine_options: dict[str, Any], options: ServeOptions) -> Application:
    """The engine deployment: `--data-parallel-size` replicas (or autoscaled), routed by `PrefixAwareRouter`."""
    config = EngineConfig(**engine_options)  # bad options fail here, before any replica starts
    check_replica_options(config, options)
    threads = config.threads_per_worker or threads_per_replica(options, config.tensor_parallel_size)
    engine_options = {**engine_options, "threads_per_worker": threads}
    return serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": threads},  # rank 0's: ranks 1.. are actors with their own (ray_ranks.py)
        max_ongoing_requests=options.max_waiting_requests,
        health_check_period_s=_HEALTH_PERIOD_S,
        health_check_timeout_s=_HEALTH_TIMEOUT_S,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_routing_stats_period_s=_STATS_PERIOD_S,
            request_routing_stats_timeout_s=_HEALTH_TIMEOUT_S,
        ),
        **scaling(options),
    ).bind(engine_options, options)


def check_replica_options(config: EngineConfig, options: ServeOptions) -> None:
    if (options.min_replicas is None) != (options.max_replicas is None):
        raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
    if options.min_replicas is not None and options.min_replicas > options.max_replicas:
        raise ValueError(f"--min-replicas ({options.min_replicas}) is above --max-replicas ({options.max_replicas})")


def scaling(options: ServeOptions) -> dict[str, Any]:
    """A fixed number of replicas, or Serve's autoscaler between the bounds on requests in flight per replica."""
    if options.min_replicas is None:
        return {"num_replicas": options.data_parallel_size}
    initial = min(max(options.data_parallel_size, options.min_replicas), options.max_replicas)
    return {
        "autoscaling_config": {
            "min_replicas": options.min_replicas,
            "max_replicas": options.max_replicas,
            "initial_replicas": initial,
            "target_ongoing_requests": options.target_ongoing_requests,
        }
    }


def threads_per_replica(options: ServeOptions, tensor_parallel_size: int) -> int:
    """This machine's cores divided among the most replicas (times their ranks) it may hold."""
    replicas = options.max_replicas or options.data_parallel_size
    return max(1, (os.cpu_count() or 1) // (replicas * tensor_parallel_size))


def serve_on_ray(engine_options: dict[str, Any], options: ServeOptions) -> int:
    """`pagedllm serve --distributed-executor-backend ray`: deploy the engine replicas on the cluster at
    `--ray-address` (or a local one started here) and serve HTTP from this process (the front and its router here,
    no Serve proxy in between) until SIGTERM or SIGINT; then delete the application and stop what was started
    here. Returns the exit status."""
    replicas = engines(engine_options, options)
    block_size = EngineConfig(**engine_options).block_size
    local = options.ray_address is None
    ray.init(
        address="local" if local else options.ray_address,
        num_cpus=os.cpu_count() if local else None,
        include_dashboard=False,
        logging_level=options.log_level.upper(),
    )
    try:
        serve.start(proxy_location="Disabled")
        serve.run(replicas, name=APP_NAME, route_prefix=None)
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        # The first call also starts this process's router, which the aggregated routes list replicas through.
        front = FrontApp(handle, block_size, handle.describe.remote().result())
        banner = f"pagedllm: serving on Ray at http://{options.host}:{options.port}"
        config = uvicorn.Config(front.app, host=options.host, port=options.port, log_level=options.log_level.lower())
        # It takes SIGINT and SIGTERM over from ray.init's handler while it runs.
        UvicornServer(config, on_exit=lambda: None, banner=banner).run()
    finally:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
