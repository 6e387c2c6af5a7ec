"""Per-sequence state that the scheduler, worker and output processor share. One prompt with `n` samples
has n sequences."""

from __future__ import annotations

import copy
import enum
import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import SampleLogprobs
from pagedllm.pooling import PoolState
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

# The sampling side of a pooling sequence, which runs its prompt only and never gets a sample row.
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


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
    seed: int | None  # of the sampler's draws (None: greedy); a draw depends on it and the token's index only
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0  # a beam's score; samples' own are kept by the output processor
    cache_salt: str | None = None  # an extra key of the first block's hash: different salts never share
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    # Entry i is prompt token i + 1's; filled as prompt chunks are computed (only with params.prompt_logprobs).
    prompt_logprobs: SampleLogprobs | None = None
    grammar: xgr.GrammarMatcher | None = None  # the constraint's state after the tokens generated so far
    pool: PoolState | None = None  # a pooling sequence's vector so far (it runs its prompt only)
    token_type_ids: list[int] | None = None  # an encoder's token types, one per prompt token (None: all 0)

    @property
    def block_salt(self) -> str | None:
        """The extra key of its first block's hash: the cache salt and the adapter, each of which changes the
        K/V of the same tokens."""
        if self.lora is None:
            return self.cache_salt
        return json.dumps([self.cache_salt, self.lora.cache_key])

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

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt positions whose log-probabilities were asked for and not computed yet."""
        if self.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    def fork(self, seq_id: int, index: int, seed: int | None) -> Sequence:
        """A sibling that has produced exactly what this sequence has so far (its KV blocks are shared
        by the cache manager); from here on it draws with its own seed."""
        child = copy.copy(self)
        child.seq_id, child.index, child.seed = seq_id, index, seed
        child.token_ids = list(self.token_ids)
        child.prompt_logprobs = None  # the prompt's log-probabilities belong to the sequence that ran it
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child


class SequenceFactory:
    """Hands out sequence ids and per-sequence seeds, to new requests and to forks alike. Each random
    sequence owns its seed, so a seeded request samples the same tokens whatever shares its batch (and
    whether or not speculation guessed its tokens ahead)."""

    def __init__(self, seed: int) -> None:
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(seed)

    def new(self, request_id: str, token_ids: list[int], params: SamplingParams, max_tokens: int) -> Sequence:
        return Sequence(
            seq_id=next(self._ids),
            request_id=request_id,
            index=0,
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids),
            params=params,
            max_tokens=max_tokens,
            seed=self._seed(params, 0),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def new_pooled(
        self, request_id: str, token_ids: list[int], pool: PoolState, token_type_ids: list[int] | None = None
    ) -> Sequence:
        """A pooling request's one sequence: its prompt is run, and pooled into `pool`."""
        seq = self.new(request_id, token_ids, PREFILL_ONLY, 0)
        seq.pool = pool
        seq.token_type_ids = token_type_ids
        return seq

    def fork(self, parent: Sequence, index: int) -> Sequence:
        return parent.fork(next(self._ids), index, self._seed(parent.params, index))

    def _seed(self, params: SamplingParams, index: int) -> int | None:
        if params.is_greedy:
            return None
        seed = params.sample_seed(index)
        return int(torch.randint(2**62, (1,), generator=self._rng)) if seed is None else seed
