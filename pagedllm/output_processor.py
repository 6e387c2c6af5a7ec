"""From a step's new tokens to what callers see: detokenized text, stop strings, best_of selection
and one `RequestOutput` per request that moved."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedllm.detokenizer import next_text, start_detokenizer
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.request import SequenceGroup
from pagedllm.sequence import Sequence, SequenceStatus
from pagedllm.step import NewToken, StepUpdate
from pagedllm.stopping import string_stop

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[Sequence] = field(default_factory=list)  # finished by a stop string: their blocks go back
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose processing raised


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            start_detokenizer(seq)

    def process(self, update: StepUpdate) -> ProcessedStep:
        """One request's failure (a detokenizer error, say) must not cost the rest of the batch its
        output: it is recorded in `failed`, and the engine aborts that request alone."""
        step = ProcessedStep()
        for entry in update.prompt_logprobs:
            self._decode(entry)
        for new in update.new_tokens:
            request_id = new.seq.request_id
            if request_id in step.failed:
                continue
            if new.num_tokens > new.seq.num_tokens:
                new.seq.cumulative_logprob -= new.logprob  # a stop string ended its sequence at an earlier token
                continue
            try:
                self._text(new, step)
            except Exception as error:
                logger.exception("request %s failed while processing its token", request_id)
                step.failed[request_id] = error
        step.outputs = [self._output(group) for group in update.groups if group.request_id not in step.failed]
        return step

    def _text(self, new: NewToken, step: ProcessedStep) -> None:
        seq, stop = new.seq, new.stop
        if new.logprobs is not None:
            self._decode(new.logprobs)
        if stop is None or not stop.hide_last_token_text:
            skip = seq.params.skip_special_tokens
            seq.text += next_text(self.tokenizer, seq, skip, flush=stop is not None, end=new.num_tokens)
        # A stop string outranks the length limit reached by the same token, not a stop token.
        if stop is not None and stop.status is not SequenceStatus.FINISHED_LENGTH:
            return
        by_string = string_stop(seq, new.num_tokens - seq.num_prompt_tokens)
        if by_string is None:
            return
        if stop is None and not seq.status.finished:
            step.stopped.append(seq)
        _drop_after(seq, new.num_tokens)
        seq.status, seq.stop_reason = by_string.status, by_string.reason

    def _decode(self, entry: dict[int, Logprob]) -> None:
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id])

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.beam is not None:
            completions = self._beam_completions(group) if group.finished else []
        else:
            completions = [_completion(seq) for seq in _returned(group)]
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, completions, group.finished, _prompt_logprobs(group)
        )

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        assert group.beam is not None
        prompt_len = len(group.prompt_token_ids)
        return [
            CompletionOutput(
                index=index,
                text=self.tokenizer.decode(beam.token_ids[prompt_len:], skip_special_tokens=True),
                token_ids=beam.token_ids[prompt_len:],
                cumulative_logprob=beam.cumulative_logprob,
                logprobs=None,
                finish_reason="stop" if beam.ended_with_eos else "length",
            )
            for index, beam in enumerate(group.beam.ranked())
        ]


def _drop_after(seq: Sequence, num_tokens: int) -> None:
    """Forget the tokens a step appended after the one a stop string ended at (speculation's accepted guesses
    and the pick after them); their log-probabilities leave the cumulative one as `process` skips them."""
    del seq.token_ids[num_tokens:]
    if seq.logprobs is not None:
        del seq.logprobs[num_tokens - seq.num_prompt_tokens :]


def _prompt_logprobs(group: SequenceGroup) -> PromptLogprobs | None:
    """Once the prompt is scored: None for its first token (nothing predicts it), then each token's entry.
    Beam search scores no prompt (its parameters have no prompt_logprobs), and once every beam has ended
    at EOS its group holds no sequence at all."""
    if group.beam is not None:
        return None
    first = group.seqs[0]
    if first.prompt_logprobs is None or first.num_prompt_logprobs_missing:
        return None
    return [None, *first.prompt_logprobs]


def _returned(group: SequenceGroup) -> list[Sequence]:
    """All samples, or with best_of the n best by cumulative logprob once the request is done."""
    params = group.seqs[0].params
    if not params.ranks_samples:
        return group.seqs
    if not group.finished:
        return []
    best = sorted(group.seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[: params.n]
    return sorted(best, key=lambda seq: seq.index)


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=seq.text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None or seq.params.ranks_samples else None,
        logprobs=seq.logprobs,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
    )
