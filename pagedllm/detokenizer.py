"""Incremental detokenization: each new token decodes a short window, never the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the window, so the first output token decodes with its left context
# (a SentencePiece word piece decodes differently at the start of a string).
_PROMPT_CONTEXT = 5


@dataclass(slots=True)
class TextState:
    """One sequence's text as the output processor builds it: the token ids it has seen (the prompt's last
    few, then every output token), the decoding window over them, and how far stop strings were searched."""

    token_ids: list[int]
    prefix_offset: int
    read_offset: int
    text: str = ""
    checked_text_len: int = 0

    @classmethod
    def start(cls, prompt_token_ids: list[int]) -> TextState:
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        return cls(list(context), 0, len(context))


def next_text(tokenizer: PreTrainedTokenizerBase, state: TextState, skip_special_tokens: bool, flush: bool) -> str:
    """The text the state's last token adds. Empty while the window ends inside a multi-byte character: the
    held-back bytes come out with a later token, or as they are with the last one (`flush`)."""
    ids = state.token_ids
    prefix = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
        return ""
    state.prefix_offset = state.read_offset
    state.read_offset = len(ids)
    return full[len(prefix) :]
