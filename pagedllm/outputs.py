"""Value objects handed back to callers: one per request, one per sampled sequence, and the engine's numbers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one generated position (from the model's raw logits)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated position: token id -> its Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position: None for the first token (nothing predicts it), then the prompt's own
# token and the top-k of the distribution that predicted it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None  # when asked for, once the whole prompt is computed


@dataclass(slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_peak: int
    kv_utilization: float
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_swapped_out_blocks: int
    num_swap_preemptions: int
    num_cow_copies: int
    blocks_saved_by_sharing: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_steps: int
    step_seconds: dict[str, float] = field(default_factory=dict)
