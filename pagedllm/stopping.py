"""When a sequence is done: EOS, stop token ids, stop strings, length limits."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.detokenizer import TextState
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class StopDecision:
    status: SequenceStatus
    reason: int | str | None = None
    hide_last_token_text: bool = False


def token_stop(seq: Sequence, token: int, eos_ids: frozenset[int]) -> StopDecision | None:
    """Stops decided by the token alone, before its text is appended (its text is hidden by default)."""
    params = seq.params
    if seq.num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token in eos_ids:
        return StopDecision(SequenceStatus.FINISHED_STOPPED, None, hide_last_token_text=True)
    if token in params.stop_token_ids:
        return StopDecision(SequenceStatus.FINISHED_STOPPED, token, not params.include_stop_str_in_output)
    return None


def grammar_stop(seq: Sequence, token: int) -> StopDecision | None:
    """A constrained sequence stops once its grammar has taken the stop token that ends it, whatever
    ignore_eos or min_tokens say: nothing may follow a finished structure. A token the grammar refuses
    (which the sampler's mask rules out) aborts the sequence rather than let unconstrained text out."""
    if seq.grammar is None:
        return None
    if not seq.grammar.accept_token(token):
        return StopDecision(SequenceStatus.FINISHED_ABORTED, "grammar refused the token", hide_last_token_text=True)
    if seq.grammar.is_terminated():
        return StopDecision(SequenceStatus.FINISHED_STOPPED, None, hide_last_token_text=True)
    return None


def string_stop(state: TextState, params: SamplingParams, num_output_tokens: int) -> StopDecision | None:
    """Look for a stop string in the text not yet searched (plus an overlap for strings cut across
    tokens) and truncate the text at it; the text is that of the first `num_output_tokens` output tokens."""
    if not params.stop or num_output_tokens < params.min_tokens:
        return None
    longest = max(len(s) for s in params.stop)
    search_from = max(state.checked_text_len - longest + 1, 0)
    hits = [(state.text.find(s, search_from), s) for s in params.stop]
    hits = [(at, s) for at, s in hits if at >= 0]
    state.checked_text_len = len(state.text)
    if not hits:
        return None
    at, stop = min(hits)
    state.text = state.text[: at + len(stop)] if params.include_stop_str_in_output else state.text[:at]
    return StopDecision(SequenceStatus.FINISHED_STOPPED, stop)


def length_stop(seq: Sequence, max_model_len: int) -> StopDecision | None:
    if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return StopDecision(SequenceStatus.FINISHED_LENGTH)
    return None
