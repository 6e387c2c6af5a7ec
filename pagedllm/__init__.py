"""pagedllm: an LLM inference and serving engine built on PagedAttention."""

from pagedllm.heap import collection_paused

with collection_paused():  # torch's and transformers' imports: see pagedllm/heap.py
    from pagedllm.beam_search import BeamSearchParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora_request import LoRARequest
    from pagedllm.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
