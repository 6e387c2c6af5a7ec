"""The frontend half of a step: from the engine core's `RequestDelta`s to what callers see. Detokenized text,
stop strings (decided here and sent back to the core as `StringStop`s, which it applies as it applies its own
stops), best_of selection, and one cumulative `RequestOutput` per request that moved.

It runs beside the engine in one process (`LLMEngine.step`), or in the server's process while the engine core
steps in a process of its own: the core then sends only what each step changed, and never detokenizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from pagedllm.beam_search import BeamSearchParams
from pagedllm.detokenizer import TextState, next_text
from pagedllm.outputs import (
    CompletionOutput,
    FinishedBeamOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestDelta,
    RequestOutput,
    SampleLogprobs,
    SequenceDelta,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.stopping import string_stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StringStop:
    """A stop string ended sample `index` of the request: the core finishes that sequence and frees its blocks."""

    request_id: str
    index: int


@dataclass(slots=True)
class _Sample:
    """One sample's output as the caller sees it."""

    index: int
    detok: TextState
    num_context: int  # prompt tokens at the head of `detok.token_ids`
    logprobs: SampleLogprobs | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.detok.token_ids[self.num_context :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.detok.token_ids) - self.num_context


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None for beam search
    num_samples: int  # how many samples it grows to (n, or best_of)
    samples: dict[int, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob]] | None = None
    beams: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None
    pooling: bool = False  # a pooling request: its output is its vector
    pooled: torch.Tensor | None = None

    def sample(self, index: int) -> _Sample:
        """The sample, started from the prompt when it is new (parallel samples fork at their first token)."""
        sample = self.samples.get(index)
        if sample is None:
            assert self.params is not None
            detok = TextState.start(self.prompt_token_ids)
            logprobs = [] if self.params.logprobs is not None else None
            sample = self.samples[index] = _Sample(index, detok, len(detok.token_ids), logprobs)
        return sample


@dataclass(slots=True)
class ProcessedStep:
    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    stops: list[StringStop] = field(default_factory=list)  # for the core to apply
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose processing raised; dropped here


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams | PoolingParams,
    ) -> None:
        if isinstance(params, BeamSearchParams):
            self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, None, params.beam_width)
            return
        if isinstance(params, PoolingParams):
            self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, None, 0, pooling=True)
            return
        request = _Request(request_id, prompt, prompt_token_ids, params, params.num_samples)
        request.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        self.requests[request_id] = request

    def abort(self, request_id: str) -> None:
        """Forget the request (aborted, or failed in the core); later deltas for it are ignored."""
        self.requests.pop(request_id, None)

    def process(self, deltas: list[RequestDelta]) -> ProcessedStep:
        """One request's failure (a detokenizer error, say) must not cost the rest of the batch its output: it
        is recorded in `failed` and the request dropped; the caller aborts it in the core."""
        step = ProcessedStep()
        for delta in deltas:
            request = self.requests.get(delta.request_id)
            if request is None:
                continue  # finished here by a stop string before the core heard, or aborted
            try:
                self._apply(request, delta, step)
            except Exception as error:
                logger.exception("request %s failed while processing its tokens", delta.request_id)
                step.failed[delta.request_id] = error
                del self.requests[delta.request_id]
                continue
            step.outputs.append(self._output(request))
            if request.finished:
                del self.requests[delta.request_id]
        return step

    def _apply(self, request: _Request, delta: RequestDelta, step: ProcessedStep) -> None:
        if delta.num_cached_tokens is not None:
            request.num_cached_tokens = delta.num_cached_tokens
        if request.prompt_logprobs is not None:
            for entry in delta.prompt_logprobs:
                self._decode(entry)
            request.prompt_logprobs.extend(delta.prompt_logprobs)
        for seq in delta.seqs:
            sample = request.sample(seq.index)
            if sample.finish_reason is None:  # else a stop string ended it here and the core has not heard yet
                self._take(request, sample, seq, step)
        if delta.pooled is not None:
            request.pooled = delta.pooled
        if delta.beams is not None:
            request.beams = [self._beam_completion(index, beam) for index, beam in enumerate(delta.beams)]
        done = sum(sample.finish_reason is not None for sample in request.samples.values())
        request.finished = delta.finished or (request.params is not None and done == request.num_samples)

    def _take(self, request: _Request, sample: _Sample, seq: SequenceDelta, step: ProcessedStep) -> None:
        """Append the sequence's new tokens and their text until one of them stops it. A stop string found at a
        token drops the tokens after it (speculation's accepted guesses), and the core is told."""
        params = request.params
        assert params is not None
        last = len(seq.token_ids) - 1
        for i, token_id in enumerate(seq.token_ids):
            finish = seq.finish_reason if i == last else None
            sample.detok.token_ids.append(token_id)
            if sample.logprobs is not None:
                assert seq.logprobs is not None
                self._decode(seq.logprobs[i])
                sample.logprobs.append(seq.logprobs[i])
            if seq.token_logprobs is not None:
                sample.cumulative_logprob += seq.token_logprobs[i]
            if finish is None or not seq.hide_last_token_text:
                sample.detok.text += next_text(
                    self.tokenizer, sample.detok, params.skip_special_tokens, flush=finish is not None
                )
            # A stop string outranks the length limit reached by the same token, not a stop token.
            if finish is not None and finish != "length":
                sample.finish_reason, sample.stop_reason = finish, seq.stop_reason
                return
            by_string = string_stop(sample.detok, params, sample.num_output_tokens)
            if by_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", by_string.reason
                if finish is None:
                    step.stops.append(StringStop(request.request_id, seq.index))
                return
            if finish is not None:
                sample.finish_reason, sample.stop_reason = finish, seq.stop_reason

    def _decode(self, entry: dict[int, Logprob]) -> None:
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id])

    def _beam_completion(self, index: int, beam: FinishedBeamOutput) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.tokenizer.decode(beam.token_ids, skip_special_tokens=True),
            token_ids=beam.token_ids,
            cumulative_logprob=beam.cumulative_logprob,
            logprobs=None,
            finish_reason="stop" if beam.ended_with_eos else "length",
        )

    def _output(self, request: _Request) -> RequestOutput | PoolingRequestOutput:
        if request.pooling:
            assert request.pooled is not None, "a pooling request moved without its vector"
            return PoolingRequestOutput(
                request.request_id,
                request.prompt,
                request.prompt_token_ids,
                PoolingOutput(request.pooled),
                request.finished,
                request.num_cached_tokens,
            )
        completions = request.beams if request.params is None else [_completion(request, s) for s in _returned(request)]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            completions,
            request.finished,
            _prompt_logprobs(request),
            request.num_cached_tokens,
        )


def _prompt_logprobs(request: _Request) -> PromptLogprobs | None:
    """Once the prompt is scored: None for its first token (nothing predicts it), then each token's entry."""
    entries = request.prompt_logprobs
    if entries is None or len(entries) < len(request.prompt_token_ids) - 1:
        return None
    return [None, *entries]


def _returned(request: _Request) -> list[_Sample]:
    """All samples, or with best_of the n best by cumulative logprob once the request is done."""
    assert request.params is not None
    samples = [request.samples[index] for index in sorted(request.samples)]
    if not request.params.ranks_samples:
        return samples
    if not request.finished:
        return []
    best = sorted(samples, key=lambda sample: sample.cumulative_logprob, reverse=True)[: request.params.n]
    return sorted(best, key=lambda sample: sample.index)


def _completion(request: _Request, sample: _Sample) -> CompletionOutput:
    assert request.params is not None
    keeps_cumulative = sample.logprobs is not None or request.params.ranks_samples
    return CompletionOutput(
        index=sample.index,
        text=sample.detok.text,
        token_ids=sample.output_token_ids,
        cumulative_logprob=sample.cumulative_logprob if keeps_cumulative else None,
        # A copy: the sample's list grows with later steps, and a caller may hold this output while it does.
        logprobs=None if sample.logprobs is None else list(sample.logprobs),
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
    )
