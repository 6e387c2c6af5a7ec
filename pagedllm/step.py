"""The values that travel along one step, and so the contracts between its rooms: the scheduler's
`SchedulerOutput` goes to the worker, the worker's `ModelOutput` back to the scheduler, and the
scheduler's `StepUpdate` on to the output processor."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.kv.kv_cache_manager import BlockPair
from pagedllm.outputs import Logprob
from pagedllm.request import SequenceGroup
from pagedllm.sequence import Sequence
from pagedllm.stopping import StopDecision


@dataclass(slots=True)
class ScheduledSeq:
    """Tokens `start .. start + num_new_tokens` of the sequence run this step; with speculation the last
    `num_drafts` of them are guesses that follow the sequence's tokens (each gets logits too). The n-gram
    proposer's guesses are known when scheduled; a draft model's are picked by the worker before the forward
    pass, into this same list (which the sample row shares)."""

    seq: Sequence
    num_new_tokens: int
    block_table: list[int] = field(default_factory=list)  # filled in once the step's allocations are final
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0

    @property
    def start(self) -> int:
        """Position of the first new token; the ones before it are in the cache."""
        return self.seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_drafts == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk's last logits pick a token: it completes a generating (not pooling) sequence."""
        return self.completes and self.seq.pool is None

    @property
    def input_ids(self) -> list[int]:
        """The token ids this step feeds the model for this sequence."""
        return self.seq.token_ids[self.start : self.start + self.num_new_tokens] + self.draft_token_ids


@dataclass(slots=True)
class SampleRow:
    """One token to pick this step. `logits_row` indexes the completing sequences in scheduled order;
    parallel samples forked at their first token share their parent's row."""

    seq: Sequence
    logits_row: int  # with drafts, the first of len(draft_token_ids) + 1 consecutive rows
    forked_from: Sequence | None = None  # joins the request (sharing the parent's blocks) in `update`
    num_beam_candidates: int = 0  # a beam: its best continuations are returned instead of a sampled token
    draft_token_ids: list[int] = field(default_factory=list)  # the guesses its later rows check (`ScheduledSeq`'s)
    num_drafts: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Carried out by the worker before the forward pass, in this order: swap_out, copies, swap_in.
    # (Swapping out first keeps a block's content safe when the same step hands the block to someone else.)
    swap_out: list[BlockPair] = field(default_factory=list)
    copies: list[BlockPair] = field(default_factory=list)
    swap_in: list[BlockPair] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in)


@dataclass(slots=True)
class RowOutput:
    """What the worker picked for one `SampleRow`."""

    token_id: int = -1
    logprobs: dict[int, Logprob] | None = None  # the sampled token and the top `params.logprobs`
    logprob: float | None = None  # the sampled token's raw log-probability, where the row needs it
    candidates: list[tuple[float, int]] | None = None  # a beam's best (log-probability, token) continuations
    # With drafts: the tokens picked after this one, while each pick equalled the draft at its place (so the
    # next row's logits were computed after the right token); the last is the first pick that differed, or the
    # pick after the last draft.
    following: list[RowOutput] = field(default_factory=list)

    @property
    def tokens(self) -> list[RowOutput]:
        return [self, *self.following]


@dataclass(slots=True)
class ModelOutput:
    rows: list[RowOutput] = field(default_factory=list)  # one per `SchedulerOutput.samples` entry
    # For sequences that asked for prompt log-probabilities: the entries of the prompt positions scored
    # this step, continuing `seq.prompt_logprobs`.
    prompt_logprobs: list[tuple[Sequence, list[dict[int, Logprob]]]] = field(default_factory=list)
    # For pooling sequences: this step's part of each one's vector (`Pooler.part`), a float32 CPU tensor.
    pooled: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


@dataclass(slots=True)
class NewToken:
    seq: Sequence
    logprobs: dict[int, Logprob] | None
    stop: StopDecision | None  # a stop decided by the token or the length; stop strings are the output processor's
    # The sequence's length with this token (a step may append several tokens to one sequence: speculation).
    num_tokens: int
    logprob: float = 0.0  # the token's raw log-probability, for the output's cumulative one


@dataclass(slots=True)
class StepUpdate:
    """What a step changed, from which the engine makes each request's `RequestDelta`: tokens appended, and
    the requests that moved."""

    new_tokens: list[NewToken] = field(default_factory=list)
    groups: list[SequenceGroup] = field(default_factory=list)
    # Prompt log-probability entries scored this step, per sequence that asked for them.
    prompt_logprobs: list[tuple[Sequence, list[dict[int, Logprob]]]] = field(default_factory=list)
    # Pooling sequences finished this step, each with its vector (an embedding, or its scores).
    pooled: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)
