"""Per-sequence state that the scheduler and engine share. One prompt with `n` samples has n sequences."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.outputs import SampleLogprobs
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamState


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)

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
    cache_salt: str | None = None  # an extra key of the first block's hash: different salts never share

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

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling that has produced exactly what this sequence has so far (its KV blocks are shared
        by the cache manager); from here on it draws from its own generator."""
        child = copy.copy(self)
        child.seq_id, child.index, child.generator = seq_id, index, generator
        child.token_ids = list(self.token_ids)
        child.logprobs = [dict(entry) for entry in self.logprobs] if self.logprobs is not None else None
        return child


@dataclass(eq=False, slots=True)
class SequenceGroup:
    """One request: its sequences (n samples, or beams) are scheduled, preempted and swapped together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    pending_forks: int = 0  # parallel samples still to fork from the first sequence at its first token
    beam: BeamState | None = None  # set for beam search requests

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.status.finished]

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(seq.status.finished for seq in self.seqs)
