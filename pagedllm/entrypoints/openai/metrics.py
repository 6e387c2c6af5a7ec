"""Prometheus metrics of one server, under vLLM-style names with the `pagedllm:` prefix.

Engine gauges are refreshed from `LLMEngine.stats()` by the engine thread after every step (the engine is
not thread-safe, so a scrape never calls into it); request timings are observed when a request ends.
Each server owns its registry, so two servers in one process (tests) never share counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine import EngineStats

# vLLM's buckets, so dashboards built for vLLM read pagedllm the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """When one request arrived, produced its first token and ended (time.perf_counter seconds)."""

    arrival: float
    first_token: float | None
    end: float
    num_output_tokens: int  # of its longest completion: the tokens that arrived one step apart

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.num_output_tokens - 1)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._gauges = {name: Gauge(f"pagedllm:{name}", doc, registry=registry) for name, (_, doc) in _GAUGES.items()}
        # Counters of totals the engine keeps since it started: a Prometheus counter only moves by deltas.
        self._totals = {
            stat: Counter(f"pagedllm:{name}", doc, registry=registry) for name, (stat, doc) in _TOTALS.items()
        }
        self._last_totals = {stat: 0 for stat, _ in _TOTALS.values()}
        self._prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed", registry=registry)
        self._generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated", registry=registry)
        self._finished = Counter(
            "pagedllm:requests_finished",
            "Requests ended, by the finish reason of their first completion ('error' when serving it failed)",
            ["finish_reason"],
            registry=registry,
        )
        self._ttft = Histogram(
            "pagedllm:time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=registry
        )
        self._tpot = Histogram(
            "pagedllm:time_per_output_token_seconds",
            "Time per output token after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self._e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds",
            "Arrival to last token, for requests that finished (stop or length)",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )

    def watch_responses(self, count: Callable[[], float], size: Callable[[], float]) -> None:
        """Gauges read at each scrape: how many /v1/responses are stored, and their bytes."""
        Gauge(
            "pagedllm:responses_stored", "Responses kept for previous_response_id", registry=self.registry
        ).set_function(count)
        Gauge(
            "pagedllm:responses_stored_bytes",
            "Bytes of the stored responses and their conversations",
            registry=self.registry,
        ).set_function(size)

    def observe_engine(self, stats: EngineStats) -> None:
        for name, (stat, _) in _GAUGES.items():
            # getattr: fields that newer engines add (prefix caching, swapping) read as 0 on older ones.
            self._gauges[name].set(getattr(stats, stat, 0.0))
        for stat, counter in self._totals.items():
            total = getattr(stats, stat)
            counter.inc(max(total - self._last_totals[stat], 0))
            self._last_totals[stat] = total

    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft)
        self._prompt_tokens.inc(num_prompt_tokens)

    def observe_generated(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def observe_end(self, finish_reason: str, timing: RequestTiming) -> None:
        self._finished.labels(finish_reason=finish_reason).inc()
        if finish_reason not in ("stop", "length"):
            return
        self._e2e.observe(timing.end - timing.arrival)
        if timing.tpot is not None:
            self._tpot.observe(timing.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Gauge name -> (EngineStats field, help).
_GAUGES = {
    "num_requests_running": ("num_running", "Sequences in the running queue"),
    "num_requests_waiting": ("num_waiting", "Sequences waiting to be scheduled"),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool"),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks referenced by sequences"),
    "kv_blocks_peak": ("kv_blocks_peak", "Most KV cache blocks ever in use at once"),
    "kv_utilization": ("kv_utilization", "Tokens stored over the slots of the blocks that hold them"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache over prompt tokens"),
    "swapped_blocks": ("num_swapped_out_blocks", "KV blocks swapped out to CPU swap space"),
    "spec_decode_acceptance_rate": ("spec_acceptance_rate", "Speculated tokens accepted over those guessed"),
    "spec_decode_mean_accepted_length": (
        "spec_mean_accepted_length",
        "Tokens per checked proposal, the target's own pick after the accepted guesses included",
    ),
    "lora_adapters_resident": ("lora_resident", "LoRA adapters in a slot, ready for a step (at most --max-loras)"),
    "lora_adapters_loaded": ("lora_loaded", "LoRA adapters kept in CPU memory (at most --max-cpu-loras)"),
}
# Counter name -> (EngineStats total, help); vLLM's names for speculative decoding's.
_TOTALS = {
    "num_preemptions": ("num_preemptions", "Sequences preempted"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's counter)"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's counter)"),
    "spec_decode_num_drafts": ("spec_num_drafts", "Speculative proposals checked"),
    "spec_decode_num_draft_tokens": ("spec_num_draft_tokens", "Tokens speculated"),
    "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens", "Speculated tokens the target accepted"),
    "lora_disk_loads": ("lora_disk_loads", "LoRA adapters read from disk (a cold adapter, or one evicted from memory)"),
    "lora_slot_writes": ("lora_slot_writes", "LoRA adapters written into a slot (each one not resident when needed)"),
    "pooling_requests": ("num_pooled_requests", "Pooling requests finished: embeddings, and scores of a pair or text"),
    "pooling_prompt_tokens": ("num_pooled_tokens", "Prompt tokens of the finished pooling requests"),
}
