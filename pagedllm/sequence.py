"""Per-sequence state that the scheduler and engine share. One prompt with `n` samples has n sequences."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pagedllm.outputs import SampleLogprobs
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True)
class Sequence:
    """A token stream being generated. `num_computed_tokens` catches up with `len(token_ids)`:
    prefill, chunked prefill, recompute after preemption and decode are the same motion."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: SampleLogprobs | None = None
    text: str = ""
    stop_reason: int | str | None = None
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    checked_text_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
