"""Incremental detokenization: each new token decodes a short window, never the whole sequence."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pagedllm.sequence import Sequence

# How many prompt tokens seed the window, so the first output token decodes with its left context
# (a SentencePiece word piece decodes differently at the start of a string).
_PROMPT_CONTEXT = 5


def start_detokenizer(seq: Sequence) -> None:
    seq.detok_read_offset = seq.num_prompt_tokens
    seq.detok_prefix_offset = max(seq.num_prompt_tokens - _PROMPT_CONTEXT, 0)


def next_text(
    tokenizer: PreTrainedTokenizerBase, seq: Sequence, skip_special_tokens: bool, flush: bool, end: int
) -> str:
    """The text token `end - 1` adds (a step may have appended tokens after it). Empty while the window ends
    inside a multi-byte character: the held-back bytes come out with a later token, or as they are with the
    last one (`flush`)."""
    ids = seq.token_ids
    prefix = tokenizer.decode(
        ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=skip_special_tokens
    )
    full = tokenizer.decode(ids[seq.detok_prefix_offset : end], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
        return ""
    seq.detok_prefix_offset = seq.detok_read_offset
    seq.detok_read_offset = end
    return full[len(prefix) :]
