"""Value objects handed back to callers: one per request, one per sampled sequence, and the engine's numbers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


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
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (None until admitted)


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's name): `data` as computed (float32), read as an `embedding` or as a
    `score` (a one-label model's, or a yes/no reranker's) or `probs` (a classifier's, one per label)."""

    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        if len(self.data) != 1:
            raise ValueError(f"this model gives {len(self.data)} label probabilities (probs), not one score")
        return float(self.data[0])

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()


@dataclass(slots=True)
class PoolingRequestOutput:
    """What a pooling request returns, once: its prompt and its vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence gained in a step, as the engine core sends it: its new token ids (several with
    speculation), their log-probabilities where the request needs them, and the core's own stop (EOS, stop
    token, length, grammar) on the last of them. Text and stop strings are the output processor's."""

    index: int  # which of the request's samples
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None  # one entry per new token, when params.logprobs is set
    token_logprobs: list[float] | None = None  # each new token's own, when the request keeps a cumulative one
    finish_reason: str | None = None  # "stop", "length" or "abort" when the core finished the sequence
    stop_reason: int | str | None = None
    hide_last_token_text: bool = False  # the finishing token adds no text (EOS, a hidden stop token)


@dataclass(slots=True)
class FinishedBeamOutput:
    """One of a finished beam search's ranked beams: output token ids only."""

    token_ids: list[int]
    cumulative_logprob: float
    ended_with_eos: bool


@dataclass(slots=True)
class RequestDelta:
    """One request's change in a step: the engine core's output, whose size depends on what the step
    produced, never on how long the sequences are."""

    request_id: str
    seqs: list[SequenceDelta] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # prompt entries scored this step
    finished: bool = False  # the core holds nothing of the request any more
    beams: list[FinishedBeamOutput] | None = None  # a beam search's result, once finished
    num_cached_tokens: int | None = None  # the prompt tokens the prefix cache held at its admission
    pooled: torch.Tensor | None = None  # a pooling request's vector, on the delta that finishes it


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
    # Speculative decoding: proposals checked, tokens guessed, guesses accepted (vLLM's spec_decode counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Pooling requests (embeddings, scores) finished, and their prompt tokens.
    num_pooled_requests: int = 0
    num_pooled_tokens: int = 0
    # LoRA: adapters in a slot and in CPU memory now; adapters read from disk and written into a slot, in all.
    lora_resident: int = 0
    lora_loaded: int = 0
    lora_disk_loads: int = 0
    lora_slot_writes: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted guesses over guesses: 0 before any."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a checked proposal yields, the pick after the accepted guesses included (vLLM's mean
        acceptance length): 1 is what a step gives without speculation."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


@dataclass(frozen=True, slots=True)
class SequenceKV:
    """One live sequence's hold on the KV pools, in a `KVSnapshot`."""

    request_id: str
    seq_id: int
    status: str  # "running", "waiting" (not admitted yet, or preempted for recompute) or "swapped"
    num_cached_tokens: int  # tokens whose K/V are stored (on the CPU while swapped out)
    block_table: list[int]  # GPU block ids in order; -1 where a sliding window gave a block back; [] when swapped
    swapped_blocks: list[int]  # CPU block ids in order while swapped out, else []


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The KV cache between two steps (`LLM.kv_snapshot()`, the server's `GET /kv/snapshot`): every list is a
    copy, so it stays consistent while the engine goes on."""

    step: int  # steps run so far
    time: float  # when it was taken, Unix seconds
    block_size: int
    num_blocks: int
    kv_utilization: float  # η, as `EngineStats.kv_utilization`
    ref_counts: list[int]  # per GPU block: the block-table entries pointing at it (0 = free)
    cached: list[int]  # GPU blocks the prefix cache can find, held or free (evictable), in no particular order
    num_cpu_blocks: int
    swapped_out_blocks: int  # how many CPU blocks are in use; their ids are in the sequences' `swapped_blocks`
    num_preemptions: int  # since the engine started
    sequences: list[SequenceKV]  # every live sequence, by request arrival
    # Of one block, K and V of every layer (an int8 cache's scales included); the pool is num_blocks of them.
    bytes_per_block: int = 0
    # Speculative decoding since the engine started, as `EngineStats`' counts.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    def as_dict(self) -> dict:
        """A JSON-ready dict; shallow (the lists are shared, not copied) because it can hold 100,000s of ids."""
        return _shallow_dict(self) | {"sequences": [_shallow_dict(seq) for seq in self.sequences]}


def _shallow_dict(value: object) -> dict:
    return {f.name: getattr(value, f.name) for f in fields(value)}
